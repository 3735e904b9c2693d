"""One pass of a model over the new tokens of several sequences (batched decoding).

Each sequence has its own Runner over the same model, with its own region of the KV cache
(Runner.first_slot). `extend_together` scores every runner's tokens in ONE forward pass:
the linear layers see all rows at once, and each sequence's rows attend to its own region as
its own pass would (models/key_groups.py). Where the model's kernels are row-invariant
(Runner.pad False: kernels/rowgemm, kernels/qgemm) every row's logits are bitwise those of
`runner.extend(tokens)` alone, so a sequence's output does not depend on what shares its
passes; the cost of the pass is that of its rows, not of its sequences.
"""

from __future__ import annotations

import torch

from understudy.models.hf_fallback import FallbackLM
from understudy.models.key_groups import KeyGroup
from understudy.models.runner import Runner


def shares_passes(runner: Runner) -> bool:
    """Whether this runner's rows may share a pass: a padded pass (a fixed row budget over
    keys from slot 0) cannot hold other sequences' rows, nor can a model on transformers' own
    code (models/hf_fallback.py: one sequence, at slots equal to its positions)."""
    if isinstance(runner.model, FallbackLM):
        return False
    return runner.rows is None or not runner.pad


@torch.inference_mode()
def extend_together(
    runners: list[Runner], tokens: list[torch.Tensor], last_only: bool = False
) -> list[torch.Tensor]:
    """Feed tokens[i] [n_i] after runners[i]'s cache, all in one pass of their shared model;
    returns each one's logits [n_i, V] ([1, V] each with last_only) and advances each
    runner's length by n_i, as runner.extend(tokens[i], last_only) would."""
    assert len(runners) == len(tokens) and runners
    if len(runners) == 1:
        return [runners[0].extend(tokens[0], last_only)]
    model = runners[0].model
    device = model.device
    assert len({r.first_slot for r in runners}) == len(runners), "a region each"
    positions, slots, groups, logit_rows = [], [], [], []
    start = 0
    for runner, fed in zip(runners, tokens, strict=True):
        n = fed.shape[0]
        assert runner.model is model and shares_passes(runner), "one model, unpadded passes"
        assert runner.rows is None or n <= runner.rows, f"a pass holds at most {runner.rows}"
        where, slot, mask = runner.chain_rows(n)
        positions.append(where)
        slots.append(slot)
        groups.append(KeyGroup(slice(start, start + n), runner.first_slot, mask))
        logit_rows.extend(range(start + n - 1, start + n) if last_only else range(start, start + n))
        start += n
    fed_all = torch.cat([t.to(device) for t in tokens])  # [R]
    empty = torch.ones(start, 0, dtype=torch.bool, device=device)  # unused: groups decide
    hidden = model.hidden_states(
        fed_all, torch.cat(positions), torch.cat(slots), empty, groups=groups
    )  # [R, hidden]
    for runner, group, fed in zip(runners, groups, tokens, strict=True):
        runner.length += fed.shape[0]
        if runner.keep_hidden:
            runner.last_hidden = hidden[group.rows]
    logits = model.logits(hidden[torch.tensor(logit_rows, device=device)])  # [rows, V]
    sizes = [1 if last_only else t.shape[0] for t in tokens]
    return list(logits.split(sizes))

"""One pass of a model over the new rows of several sequences (batched decoding).

Each sequence has its own Runner over the same model, with its own region of the KV cache
(Runner.first_slot). `score_together` scores every runner's rows in ONE forward pass: a
chain's tokens, or a token tree's nodes (each over its path's keys in chain order,
Runner.place_tree). The linear layers see all rows at once, and each sequence's rows attend
to its own region exactly as its own pass would (models/key_groups.py). Where the model's
kernels are row-invariant (Runner.pad False: kernels/rowgemm, kernels/qgemm) every row's
logits are bitwise those of the sequence's pass alone, so a sequence's output does not
depend on what shares its passes; the cost of the pass is that of its rows, not of its
sequences. One sequence alone takes its runner's own pass (`score_alone`): the padded path
and the one-call fused layer stack live there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from understudy.models.hf_fallback import FallbackLM
from understudy.models.key_groups import KeyGroup
from understudy.models.runner import Runner


@dataclass(frozen=True)
class TreeRows:
    """A token tree's nodes as a target pass scores them (verify/token_tree.py): node i is
    tokens[i] at depth depths[i], in slot root + offsets[i], seeing the slots root + j where
    visible[i, j]. The root is the runner's newest token (its slot is `length`)."""

    tokens: torch.Tensor  # [n]
    depths: torch.Tensor  # [n]
    offsets: torch.Tensor  # [n]
    visible: torch.Tensor  # [n, span] bool


PassRows = torch.Tensor | TreeRows  # a chain's tokens [n], or a tree


def rows_in(rows: PassRows) -> int:
    return rows.tokens.shape[0] if isinstance(rows, TreeRows) else rows.shape[0]


def shares_passes(runner: Runner) -> bool:
    """Whether this runner's rows may share a pass: a padded pass (a fixed row budget over
    keys from slot 0) cannot hold other sequences' rows, nor can a model on transformers' own
    code (models/hf_fallback.py: one sequence, at slots equal to its positions)."""
    if isinstance(runner.model, FallbackLM):
        return False
    return runner.rows is None or not runner.pad


def score_alone(runner: Runner, rows: PassRows, last_only: bool = False) -> torch.Tensor:
    """One runner's own pass: a chain advances its length (`Runner.extend`); a tree leaves
    it for `keep_path` (`Runner.tree_pass`). Logits [n, V] ([1, V] with last_only)."""
    if isinstance(rows, TreeRows):
        return runner.tree_pass(rows.tokens, rows.depths, rows.offsets, rows.visible)
    return runner.extend(rows.to(runner.model.device), last_only)


@torch.inference_mode()
def score_together(
    runners: list[Runner], rows: list[PassRows], last_only: bool = False
) -> list[torch.Tensor]:
    """Score rows[i] after runners[i]'s cache, all in one pass of their shared model; returns
    each one's logits [n_i, V] ([1, V] each with last_only, chains only), exactly as
    score_alone(runners[i], rows[i]) would, with the same effect on each runner."""
    assert len(runners) == len(rows) and runners
    if len(runners) == 1:
        return [score_alone(runners[0], rows[0], last_only)]
    model = runners[0].model
    device = model.device
    assert len({r.first_slot for r in runners}) == len(runners), "a region each"
    positions, slots, groups, logit_rows = [], [], [], []
    start = 0
    for runner, fed in zip(runners, rows, strict=True):
        n = rows_in(fed)
        assert runner.model is model and shares_passes(runner), "one model, unpadded passes"
        assert runner.rows is None or n <= runner.rows, f"a pass holds at most {runner.rows}"
        key_slots = None
        if isinstance(fed, TreeRows):
            assert not last_only, "a tree's every node is scored"
            where, slot, mask, key_slots = runner.place_tree(
                fed.depths, fed.offsets, fed.visible, runner.length
            )
        else:
            where, slot, mask = runner.place_chain(n)
        positions.append(where)
        slots.append(slot)
        groups.append(KeyGroup(slice(start, start + n), runner.first_slot, mask, key_slots))
        logit_rows.extend(range(start + n - 1, start + n) if last_only else range(start, start + n))
        start += n
    tokens = [fed.tokens if isinstance(fed, TreeRows) else fed for fed in rows]
    fed_all = torch.cat([t.to(device) for t in tokens])  # [R]
    empty = torch.ones(start, 0, dtype=torch.bool, device=device)  # unused: groups decide
    taps: list[torch.Tensor] | None = [] if any(r.keep_hidden for r in runners) else None
    hidden = model.hidden_states(
        fed_all, torch.cat(positions), torch.cat(slots), empty, groups=groups, features=taps
    )  # [R, hidden]
    kept = torch.cat(taps, dim=-1) if taps else hidden  # what Runner.forward would keep
    for runner, group, fed in zip(runners, groups, rows, strict=True):
        if not isinstance(fed, TreeRows):
            runner.length += fed.shape[0]
        if runner.keep_hidden:
            runner.last_hidden = kept[group.rows]
    logits = model.logits(hidden[torch.tensor(logit_rows, device=device)])  # [rows, V]
    sizes = [1 if last_only else rows_in(fed) for fed in rows]
    return list(logits.split(sizes))

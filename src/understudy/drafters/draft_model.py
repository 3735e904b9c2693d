"""method="draft": a small model of the same family guesses K tokens autoregressively.

The draft keeps its own KV cache. Invariant: its cache holds valid entries for `fed[:length]`,
the tokens it has been fed; after a round `commit` truncates it to the longest prefix that
the real sequence shares, and the next `propose` first feeds the tokens it has not yet seen
(the catch-up: the corrected or bonus token, and the last accepted draft) in one pass.
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams
from understudy.drafters.base import Proposal, register
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.sampling import sample, warp_probs


@register("draft")
class DraftModelProposer:
    needs_draft_model = True

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> DraftModelProposer:
        assert draft is not None
        return cls(Runner(draft.model, max_context))

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.fed: list[int] = []  # tokens whose KV the draft computed, in order

    def begin(self, prompt_ids: list[int]) -> None:
        self.fed = []
        self.runner.truncate(0)

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        device = self.runner.model.device
        unseen = tokens[self.runner.length :]
        logits = self.runner.extend(torch.tensor(unseen, device=device), last_only=True)  # [1, V]
        self.fed = tokens[: self.runner.length]
        draft_ids: list[torch.Tensor] = []
        draft_probs: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                token = logits.argmax(-1)  # [1]
            else:
                q = warp_probs(logits, params)  # [1, V]
                token = sample(q, generator)
                draft_probs.append(q[0])
            draft_ids.append(token)
            if i < k - 1:
                logits = self.runner.extend(token.to(device))
                self.fed.append(int(token))
        ids = torch.cat(draft_ids).cpu()  # [k]
        return Proposal(ids, torch.stack(draft_probs).cpu() if draft_probs else None)

    def commit(self, tokens: list[int]) -> None:
        keep = 0
        limit = min(len(self.fed), len(tokens))
        while keep < limit and self.fed[keep] == tokens[keep]:
            keep += 1
        self.runner.truncate(min(keep, self.runner.length))
        del self.fed[keep:]

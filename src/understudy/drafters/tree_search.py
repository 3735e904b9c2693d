"""Growing a draft tree best-first (EAGLE-2, Li et al. 2024), for any drafter that can score
several tree nodes in one step (a draft model's tree pass, an EAGLE head's tree step).

Vocabulary: a *candidate* is a guessed token with a parent (-1 = the root, tokens[-1]); its
*score* is the sum of the drafter's log-probabilities along its path. Depth by depth, the
`branching` best candidates of the newest depth that can still make the final cut are
*expanded*: the drafter scores them in one step and each gets its `branching` likeliest
tokens as children. At the end the `nodes` best candidates form the tree.

Invariants:
  - a child's score never exceeds its parent's (log-probabilities are <= 0), so the final
    `nodes` best candidates (ties broken by depth, then age) are closed under parents;
  - an expanded candidate gets a slot offset from the root (the root is offset 0, expanded
    candidates 1, 2, ... in expansion order), and `visibility` tells each newly expanded
    candidate which offsets it sees: the root, its ancestors and itself;
  - the proposal lists the tree depth-first with likelier siblings first, so the likeliest
    path is laid out as a chain (tree.py: that path's logits are a chain's, bitwise).
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams
from understudy.drafters.base import Proposal
from understudy.verify.sampling import warp_probs


def tree_log_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] -> [n, V] log draft probabilities that rank tree candidates (greedy: the plain
    softmax, since the warped one is one-hot; sampling: the warped q)."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return warp_probs(logits, params).log()


class BestFirstTree:
    def __init__(self, nodes: int, branching: int) -> None:
        self.nodes = nodes
        self.branching = branching
        # candidates, parallel lists
        self.token: list[int] = []
        self.parent: list[int] = []
        self.score: list[float] = []
        self.level: list[int] = []
        self.offset: dict[int, int] = {}  # expanded candidate -> slot offset from the root
        self.newest: list[int] = []  # the candidates of the newest depth

    @property
    def fed(self) -> int:
        """Slots used from the root's on: the root and every expanded candidate."""
        return 1 + len(self.offset)

    def grow(self, parents: list[int], log_scores: torch.Tensor, ids: torch.Tensor | None) -> None:
        """Give each candidate in `parents` (-1: the root) its `branching` likeliest tokens as
        children; they become the newest depth. log_scores [len(parents), N]: the drafter's
        log-probabilities; ids [N]: their token ids (None: index = token id)."""
        first = len(self.token)
        for row, of in enumerate(parents):
            base = 0.0 if of == -1 else self.score[of]
            level = 1 if of == -1 else self.level[of] + 1
            top = torch.topk(log_scores[row], min(self.branching, log_scores.shape[-1]))
            for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if value == float("-inf"):
                    break
                self.token.append(index if ids is None else int(ids[index]))
                self.parent.append(of)
                self.score.append(base + value)
                self.level.append(level)
        self.newest = list(range(first, len(self.token)))

    def expansion(self) -> list[int]:
        """The newest depth's candidates worth expanding (best first; may be empty): those
        above the score of the current `nodes`-th best candidate, at most `branching`."""
        ranked = sorted(self.score, reverse=True)
        cut = ranked[self.nodes - 1] if len(ranked) >= self.nodes else float("-inf")
        better = sorted((c for c in self.newest if self.score[c] > cut), key=self._by_score)
        return better[: self.branching]

    def _by_score(self, c: int) -> float:
        return -self.score[c]

    def visibility(self, expand: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the candidates `expand` [e] their slots; return (offsets [e], visible
        [e, fed]) where visible[i, j]: expand[i] sees the slot at offset j (the root, its
        ancestors, itself)."""
        first = self.fed
        for row, c in enumerate(expand):
            self.offset[c] = first + row
        visible = torch.zeros(len(expand), self.fed, dtype=torch.bool)  # [e, span]
        visible[:, 0] = True  # the root
        for row, c in enumerate(expand):
            a = c
            while a != -1:
                visible[row, self.offset[a]] = True
                a = self.parent[a]
        return torch.arange(first, first + len(expand)), visible

    def proposal(self) -> Proposal:
        """The `nodes` best candidates as a tree, depth-first, likelier siblings first.
        draft_probs is None: tree drafts are deterministic (verified sibling by sibling)."""
        order_key = lambda c: (-self.score[c], self.level[c], c)  # noqa: E731
        keep = sorted(range(len(self.token)), key=order_key)[: self.nodes]
        kept = set(keep)
        kids: dict[int, list[int]] = {}
        for c in keep:  # best first, so siblings come likelier first
            assert self.parent[c] == -1 or self.parent[c] in kept  # closed under parents
            kids.setdefault(self.parent[c], []).append(c)
        order: list[int] = []
        stack = list(reversed(kids.get(-1, [])))
        while stack:
            c = stack.pop()
            order.append(c)
            stack.extend(reversed(kids.get(c, [])))
        index = {c: i for i, c in enumerate(order)}
        ids = torch.tensor([self.token[c] for c in order], dtype=torch.long)
        parents = torch.tensor(
            [index[self.parent[c]] if self.parent[c] != -1 else -1 for c in order],
            dtype=torch.long,
        )
        return Proposal(ids, None, parents)

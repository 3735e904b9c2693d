"""A token tree: many drafted continuations of one sequence, scored in one target pass.

Vocabulary (SpecInfer, Miao et al. 2024; EAGLE-2, Li et al. 2024). Node 0 is the root: the
last committed token, tokens[-1], which the target has not scored yet (exactly as the chain
loop feeds [tokens[-1], x_1..x_K]). Every other node is a drafted token whose parent is the
token it follows. A chain x_1..x_K is the tree with parents = [-1, 0, 1, ..., K-1].

Invariants (checked by `TokenTree.__init__`):
  - topological order: parents[0] == -1 and 0 <= parents[i] < i for i >= 1;
  - depths[i] = depths[parents[i]] + 1, depths[0] = 0;
  - siblings (nodes with one parent) carry distinct tokens (else a path would be ambiguous).

How a tree is laid out in a pass over a KV cache whose first `base` slots hold the committed
prefix tokens[:base] (base = len(tokens) - 1 for the target, whose cache lacks the root):
  - node i is written to cache slot base + offsets[i] (`slot_offsets`, offsets[0] = 0);
  - node i sits at rotary position base + depths[i]    (siblings share a position);
  - node i attends to slots < base (the prefix) and to slot base + offsets[j] for every j in
    ancestors(i), itself included (`ancestor_mask()[i, j]`, `region_mask`).
So a node sees exactly the tokens a chain decoding of its path would see, at the same
positions. After verification the accepted path is copied to slots base, base + 1, ...
(`Runner.keep_path`), which is the layout a chain of the same tokens would have written.

Bitwise (measured, torch 2.13 CPU, AVX-512; tests/test_tree.py): a node whose path occupies
the contiguous slots base, base + 1, ..., base + d (e.g. the first-child path of a tree in
depth-first order) gets logits bitwise equal to its path scored as a chain. A node whose
ancestors sit at other slots can differ from the chain in the last bits in float32 (up to
~1e-6 on the tiny test model; SDPA accumulates keys in lanes that depend on the slot, and
moving keys to slots congruent modulo 4 did not cure it), while bfloat16 matched in the
cases measured. So greedy tree decoding equals plain decoding except on float32 near-ties.
"""

from __future__ import annotations

import torch


class TokenTree:
    """tokens [N] int64, parents [N] int64 (parents[0] = -1), depths [N] int64."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        tokens = torch.as_tensor(tokens, dtype=torch.long).cpu()
        parents = torch.as_tensor(parents, dtype=torch.long).cpu()
        n = tokens.shape[0]
        assert n >= 1 and parents.shape == (n,), (tokens.shape, parents.shape)
        assert int(parents[0]) == -1, "node 0 is the root"
        index = torch.arange(n)
        assert bool(((parents[1:] >= 0) & (parents[1:] < index[1:])).all()), "not topological"
        depths = torch.zeros(n, dtype=torch.long)
        par = parents.tolist()
        for i in range(1, n):
            depths[i] = depths[par[i]] + 1
        pairs = {(par[i], int(tokens[i])) for i in range(1, n)}
        assert len(pairs) == n - 1, "siblings must carry distinct tokens"
        self.tokens = tokens  # [N]
        self.parents = parents  # [N]
        self.depths = depths  # [N]
        self._parent_list = par

    @classmethod
    def chain(cls, root: int, draft_ids: list[int] | torch.Tensor) -> TokenTree:
        """The chain [root, x_1..x_K]: parents = [-1, 0, ..., K-1]."""
        ids = torch.as_tensor(draft_ids, dtype=torch.long).reshape(-1)
        k = ids.shape[0]
        return cls(torch.cat([torch.tensor([root]), ids]), torch.arange(-1, k))

    @classmethod
    def from_drafts(cls, root: int, draft_ids: torch.Tensor, parents: torch.Tensor) -> TokenTree:
        """From a Proposal's view: draft i (node i + 1) follows draft parents[i] (-1 = root)."""
        return cls(
            torch.cat([torch.tensor([root]), draft_ids.cpu()]),
            torch.cat([torch.tensor([-1]), parents.cpu() + 1]),
        )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path, in drafted tokens."""
        return int(self.depths.max())

    def children(self) -> list[list[int]]:
        """children()[i]: the nodes whose parent is i, in node order (the sibling order)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            out[self._parent_list[i]].append(i)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: [i, j] is True iff j is i or an ancestor of i (lower-triangular)."""
        n = self.size
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                mask[i] = mask[self._parent_list[i]]
            mask[i, i] = True
        return mask

    def positions(self, base: int) -> torch.Tensor:
        """[N] rotary positions: base + depth (the root at base, where the chain puts it)."""
        return base + self.depths

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`, both included: [0, ..., node]."""
        out = [node]
        while out[-1] != 0:
            out.append(self._parent_list[out[-1]])
        return out[::-1]

    def slot_offsets(self) -> torch.Tensor:
        """[N] int64: node i's cache slot relative to the root's: the dense layout, i."""
        return torch.arange(self.size)

    def region_mask(self, offsets: torch.Tensor) -> torch.Tensor:
        """[N, span] bool over the tree's slot region (slots base .. base + span - 1,
        span = max(offsets) + 1): [i, offsets[j]] is True iff j is i or an ancestor of i."""
        span = int(offsets.max()) + 1
        mask = torch.zeros(self.size, span, dtype=torch.bool)
        mask[:, offsets] = self.ancestor_mask()
        return mask

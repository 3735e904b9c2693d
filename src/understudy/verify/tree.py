"""Tree verification: which root-to-node path of a token tree does the target keep?

The target scores every node of the tree in one pass (understudy.verify.token_tree): target row i is its
distribution p_i for the token after node i. The verifier walks from the root; at each node
it either moves to one of the node's children (that child's token is accepted) or stops and
emits one token of its own: the corrected token (the node had children, all rejected) or the
bonus token (the node is a leaf). Every round emits len(path) + 1 tokens.

Greedy: move to the child whose token is argmax(p_i); none: emit argmax(p_i).

Sampling, deterministic siblings (SpecInfer, Miao et al. 2024, multi-step speculative
sampling with q = one-hot per candidate; the drafter's top-b children are a deterministic
function of the context): at node i with children c_1..c_m (in node order) let r = p_i.
For j = 1..m: accept c_j with probability r(x_j) / sum(r); otherwise set r(x_j) = 0 and go
on. If every child is rejected, sample from r / sum(r).

Invariant (each emitted or accepted token is distributed exactly as the target's own sample
given the tokens before it): the token chosen at a node is x_j with probability
  prod_{l<j} (1 - r_l(x_l)/|r_l|) * r_j(x_j)/|r_j| = p(x_j)
since |r_{l+1}| = |r_l| - r_l(x_l) telescopes, and a token y outside the children is sampled
with probability (|r_m+1| / 1) * p(y) / |r_m+1| = p(y). The choice of the children does not
depend on the target, so the law of the path and the final token is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from understudy.verify.sampling import sample
from understudy.verify.token_tree import TokenTree


@dataclass(frozen=True)
class TreeVerdict:
    """path: the accepted nodes, root excluded, root to leaf (tree node indices);
    next_token: the corrected token (at a node with children) or the bonus token (at a leaf);
    bonus: whether the walk ended at a leaf."""

    path: list[int]
    next_token: int
    bonus: bool

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> TreeVerdict:
    """Greedy tree verification. target_logits: [N, vocab], row i = the target after node i."""
    target_ids = target_logits.argmax(-1).tolist()  # [N]
    tokens, children = tree.tokens.tolist(), tree.children()
    node = 0
    path: list[int] = []
    while True:
        nxt = next((c for c in children[node] if tokens[c] == target_ids[node]), None)
        if nxt is None:
            return TreeVerdict(path, target_ids[node], not children[node])
        node = nxt
        path.append(node)


def verify_tree_sampling(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> TreeVerdict:
    """Sampling tree verification with deterministic siblings (module docstring).

    target_probs: [N, vocab] float32, row i = p (warped) after node i."""
    tokens, children = tree.tokens.tolist(), tree.children()
    node, path = 0, []
    while True:
        residual = target_probs[node].double().clone()  # [vocab]; float64: long sibling lists
        moved = False
        for c in children[node]:
            total = float(residual.sum())
            x = tokens[c]
            if float(torch.rand((), generator=generator)) * total < float(residual[x]):
                node, moved = c, True
                path.append(c)
                break
            residual[x] = 0.0  # rejected: the rest of p, renormalised below
        if moved:
            continue
        if not children[node]:  # a leaf: the bonus token comes from p itself
            return TreeVerdict(path, int(sample(target_probs[node][None], generator)), True)
        total = float(residual.sum())
        if total <= 0:  # the children held all of p's mass (cannot all be rejected), rounding
            residual = target_probs[node].double()
            total = float(residual.sum())
        probs = (residual / total).float()[None]  # [1, vocab]
        return TreeVerdict(path, int(sample(probs, generator)), False)

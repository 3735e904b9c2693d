"""A round's proposal as target rows, and the verdict on them.

    fed = feed(request, proposal)          what one sequence adds to the round's target pass
    verified = judge(request, fed, raw)    its rows' logits raw -> kept guesses + one token

A chain feeds [tokens[-1], x_1..x_K] ([K + 1] rows); `judge` keeps the longest agreed
prefix (verify/chain.py) and rolls the target's cache back to the tokens it has now seen. A
tree feeds its nodes, the root tokens[-1] first (verify/token_tree.py); `judge` picks the
kept path (verify/tree.py) and compacts its KV to the chain's slots (Runner.keep_path). Both
leave the loop's invariant (engine/engine.py), and both hand the drafter the hidden states
of the rows it keeps where it reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from understudy.drafters.base import Proposal
from understudy.engine.request import Request, Verified
from understudy.models.shared_pass import PassRows, TreeRows
from understudy.verify.chain import verify_greedy, verify_sampling
from understudy.verify.sampling import warp_probs
from understudy.verify.token_tree import TokenTree
from understudy.verify.tree import verify_tree_greedy, verify_tree_sampling


@dataclass(frozen=True)
class Fed:
    """One sequence's rows of a round's target pass, and the proposal they came from."""

    proposal: Proposal
    rows: PassRows  # a chain's [K + 1] tokens, or a tree's nodes
    tree: TokenTree | None = None
    offsets: torch.Tensor | None = None  # [N] a tree's node slots, relative to its root


def feed(request: Request, proposal: Proposal) -> Fed:
    """What `proposal` adds to the round's target pass."""
    if proposal.parents is None:
        drafted = proposal.draft_ids.tolist()
        return Fed(proposal, torch.tensor([request.tokens[-1], *drafted]))  # [K + 1]
    tree = TokenTree.from_drafts(request.tokens[-1], proposal.draft_ids, proposal.parents)
    offsets = tree.slot_offsets()  # [N]
    rows = TreeRows(tree.tokens, tree.depths, offsets, tree.region_mask(offsets))
    return Fed(proposal, rows, tree, offsets)


def judge(request: Request, fed: Fed, raw: torch.Tensor) -> Verified:
    """Verify the sequence's rows raw [rows, V] of the pass; keep what the target agrees
    with, roll the cache back to it, and hand the drafter the kept rows' hidden states."""
    if fed.tree is None:
        return _judge_chain(request, fed.proposal, raw)
    return _judge_tree(request, fed, raw)


def _judge_chain(request: Request, proposal: Proposal, raw: torch.Tensor) -> Verified:
    tokens, params, runner = request.tokens, request.params, request.seat.runner
    drafted = proposal.draft_ids.tolist()
    logits = raw if request.processor is None else request.processor.process(raw, drafted)
    if params.greedy:
        verdict = verify_greedy(proposal.draft_ids, logits)
    else:
        probs = warp_probs(logits, params)  # [K+1, V]
        verdict = verify_sampling(
            proposal.draft_ids, proposal.draft_probs, probs, request.generator
        )
    a = verdict.accepted
    runner.truncate(len(tokens) + a)
    _hand_hidden(request, slice(0, a + 1), len(tokens) - 1)  # tokens[-1], kept guesses
    bonus = a == proposal.size
    return Verified(proposal, drafted[:a], verdict.next_token, bonus, proposal.size, raw[: a + 1])


def _judge_tree(request: Request, fed: Fed, raw: torch.Tensor) -> Verified:
    tree, offsets, proposal = fed.tree, fed.offsets, fed.proposal
    assert tree is not None and offsets is not None
    if request.params.greedy:
        verdict = verify_tree_greedy(tree, raw)
    else:
        verdict = verify_tree_sampling(tree, warp_probs(raw, request.params), request.generator)
    nodes = [0, *verdict.path]  # the root and the accepted nodes
    request.seat.runner.keep_path(offsets[nodes])
    _hand_hidden(request, nodes, len(request.tokens) - 1)
    path = [node - 1 for node in verdict.path]  # indices into drafted
    drafted = proposal.draft_ids.tolist()
    kept = [drafted[i] for i in path]
    return Verified(proposal, kept, verdict.next_token, verdict.bonus, tree.depth, raw[nodes], path)


def _hand_hidden(request: Request, rows: slice | list[int], start: int) -> None:
    """The target's hidden states of the kept rows, to a drafter that reads them."""
    runner, drafter = request.seat.runner, request.seat.drafter
    if runner.keep_hidden and drafter is not None:
        assert runner.last_hidden is not None
        drafter.observe_hidden(runner.last_hidden[rows], start)

"""The round: one draft -> verify -> keep cycle of every running sequence, in ONE target pass.

    plans     = each sequence's planner, capped by the batch plan     (policy/)
    proposals = Drafter.propose_batch(...)                            (drafters/)
    raws      = score_together(every sequence's rows)                 ONE target pass
    for each sequence: judge, emit, tell the drafter                  (engine/verdict.py)

A solo request is a batch of one: the same code, its pass its runner's own. Exactness, for a
batch of any size: each sequence's rows attend to its own region of the cache as in a pass of
its own, and the target's kernels are row-invariant (batched engines need them: seats.py
refuses seats otherwise), so every row's logits are bitwise its solo pass's; verification is
per sequence. A greedy answer is therefore its solo answer bit for bit, and a seeded sampled
one draws the same random numbers in the same order as alone: its plan is its own planner's
(the batch caps greedy chains only) and its draft steps are its own passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from understudy.drafters.base import EMPTY, DraftRequest, Proposal
from understudy.engine.outputs import RoundEvent
from understudy.engine.request import Request, Verified
from understudy.engine.sequence import Running
from understudy.engine.verdict import feed, judge
from understudy.models.shared_pass import rows_in, score_together
from understudy.policy.batch_plan import BatchCosts, Wish, choose_cap
from understudy.policy.planner import Plan

ProposeBatch = Callable[[list[DraftRequest]], list[Proposal]]


def run_round(
    running: list[Running], propose_batch: ProposeBatch | None, costs: BatchCosts | None
) -> int:
    """One round of every running sequence; returns the rows of its target pass. A
    sequence's own failure (its grammar, say) ends it alone: it is marked, the rest go on."""
    plans = plan_round(running, costs)
    t_draft = time.perf_counter()
    if propose_batch is None:  # plain decoding: every round a one-row pass
        proposals = [EMPTY] * len(running)
    else:
        proposals = propose_batch(
            [draft_request(s, p) for s, p in zip(running, plans, strict=True)]
        )
    t_pass = time.perf_counter()
    fed = [feed(s.request, p) for s, p in zip(running, proposals, strict=True)]
    raws = score_together([s.request.seat.runner for s in running], [f.rows for f in fed])
    t_done = time.perf_counter()
    for sequence, rows, raw in zip(running, fed, raws, strict=True):
        try:
            verified = judge(sequence.request, rows, raw.cpu())
            sequence.observe(verified, t_pass - t_draft, t_done - t_pass)
            close_round(sequence, verified)
        except Exception as error:  # this request's own: it alone ends
            sequence.error = error
    return sum(rows_in(f.rows) for f in fed)


def plan_round(running: list[Running], costs: BatchCosts | None) -> list[Plan]:
    """Each sequence's own plan; where the engine chooses K itself, with the batch's costs
    and several sequences, greedy plans are capped at the length that maximises the batch's
    modelled tokens per second, a capped tree becoming a chain, unless the plans as made
    model faster (policy/batch_plan.py). Sampled sequences keep their own plans."""
    plans = [s.planner.plan(s.request.emitter.remaining) for s in running]
    if costs is None or len(running) < 2 or running[0].planner.k != "auto":
        return plans
    wishes = [wish(s, plan) for s, plan in zip(running, plans, strict=True)]
    cap = choose_cap(wishes, costs)
    if cap is None:
        return plans
    return [p.capped(cap) if w.capped else p for p, w in zip(plans, wishes, strict=True)]


def wish(sequence: Running, plan: Plan) -> Wish:
    """The sequence's view of the round for the batch's cap: a greedy plan may be capped (a
    tree then a chain); a sampled one keeps its plan, and its rows (a tree's nodes) count."""
    tokens = sequence.planner.expected_tokens_upto(plan.k)  # one sweep
    return Wish(
        plan.k,
        sequence.params.greedy,
        lambda k: tokens[min(k, plan.k)],  # a tree: its chain's estimate at its depth
        sequence.draft_lag(),
        sequence.request.emitter.remaining,
        plan.nodes if plan.tree else 0,
        sequence.planner.expected_tree_tokens(plan.k) if plan.tree else 0.0,
    )


def draft_request(sequence: Running, plan: Plan) -> DraftRequest:
    request = sequence.request
    assert request.seat.drafter is not None
    return DraftRequest(
        request.seat.drafter, request.tokens, plan.k, request.params, request.generator,
        plan.tree, plan.nodes,
    )  # fmt: skip


def close_round(sequence: Running, verified: Verified) -> None:
    """Append the round's tokens, show the round, emit its tokens, tell the drafter."""
    request: Request = sequence.request
    proposal, kept, next_token = verified.proposal, verified.kept, verified.next_token
    request.tokens += [*kept, next_token]
    origin = "target" if proposal.size == 0 else "bonus" if verified.bonus else "corrected"
    parents = None if proposal.parents is None else proposal.parents.tolist()
    sequence.on_round(
        RoundEvent(
            sequence.rounds,
            proposal.draft_ids.tolist(),
            len(kept),
            next_token,
            origin,
            parents,
            verified.path,
            proposal.free,
        )  # fmt: skip
    )
    sequence.emit_round(verified, origin)
    if request.processor is not None:
        request.processor.commit(request.tokens)
    if request.seat.drafter is not None and not request.emitter.done:
        request.seat.drafter.commit(request.tokens)

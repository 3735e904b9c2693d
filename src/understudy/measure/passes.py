"""Timing the target's passes and a drafting step, once, when an engine is built.

Timings use a typical request's key window (MEASURE_SPAN slots), not the engine's whole
max_context: attention over thousands of empty slots would inflate a pass. Each figure is the
best of several timings after a warm-up, and they are taken in sweeps (a one-row pass and
the figure's own pass in turn, sweep after sweep), so a busy spell of a shared machine, which
lasts seconds, slows one sweep of every figure instead of every timing of one: timed repeat
after repeat, one count's timings all fell in one spell and moved the engine's plans for the
rest of its life (policy/costs.py says where each figure is used).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from understudy.models.runner import Runner
from understudy.models.shared_pass import PassRows, score_together
from understudy.policy.batch_plan import BatchCosts
from understudy.policy.costs import Costs, PassCurve, row_cost
from understudy.verify.token_tree import TokenTree

MEASURE_SPAN = 480  # key slots of a typical request (prompt + budget)
CONTEXT = 32  # tokens of the dummy context the passes are timed after
EVERY_ROW_UPTO = 8  # a solo curve times each row count up to this, then every fourth
CURVE_SWEEPS = 4  # a solo curve's timings of each row count, one a sweep
BATCH_SWEEPS = 2  # a batched engine's curves: passes of up to 8 x 16 rows, fewer sweeps
STEP_SWEEPS = 6  # timings of a one-row pass and of a drafting step, one of each a sweep

DraftStep = Callable[[], None]  # one drafting step that leaves the drafter as it was


def best_extend_seconds(
    runner: Runner, context: torch.Tensor, tokens: torch.Tensor, repeats: int
) -> float:
    """Best of `repeats` timings of one pass scoring `tokens` after `context` (already
    prefilled), after a warm-up pass; the cache is rolled back to `context` after each."""
    runner.truncate(context.shape[0])
    runner.extend(tokens)  # warm-up
    runner.truncate(context.shape[0])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.extend(tokens)
        times.append(time.perf_counter() - t0)
        runner.truncate(context.shape[0])
    return min(times)


def runner_step(runner: Runner) -> DraftStep:
    """A draft model's drafting step: one one-token pass after a CONTEXT-token prefix
    (prefilled now), rolled back after each call."""
    context = torch.arange(1, CONTEXT + 1, device=runner.model.device)
    runner.prefill(context, span=MEASURE_SPAN)

    def step() -> None:
        runner.extend(context[:1])
        runner.truncate(CONTEXT)

    return step


def curve_rows(rows: int) -> list[int]:
    """The row counts a solo pass curve times: every one up to EVERY_ROW_UPTO (where most
    rounds end, and where a kernel's row group steps), then every fourth and the budget."""
    return [n for n in range(1, rows + 1) if n <= EVERY_ROW_UPTO or n % 4 == 0 or n == rows]


def row_points(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (included): a batched engine's curve points."""
    points, rows = [], 1
    while rows < most:
        points.append(rows)
        rows *= 2
    return [*points, most]


def pass_curve(
    runners: list[Runner], points: list[int], sweeps: int, each: int | None = None
) -> PassCurve:
    """Seconds of a pass of n rows for each n of `points` (the first 1), spread over the
    runners (each holding at most `each` rows, default its row budget) after a CONTEXT-token
    prefix in each. Each count is timed once a sweep, right after a one-row pass, over
    `sweeps` sweeps after a warm-up; its figure is its best."""
    assert points[0] == 1, points
    device = runners[0].model.device
    context = torch.arange(1, CONTEXT + 1, device=device)
    for runner in runners:
        runner.prefill(context, span=MEASURE_SPAN)
    best = dict.fromkeys(points, float("inf"))
    for sweep in range(sweeps + 1):  # the first a warm-up
        for n in points[1:] or points:
            for m in (1, n):
                seconds = _time_rows(runners, m, each or runners[0].rows or m, context)
                if sweep:
                    best[m] = min(best[m], seconds)
    for runner in runners:
        runner.truncate(0)
    return PassCurve(tuple(points), tuple(best[n] for n in points))


def _time_rows(runners: list[Runner], rows: int, each: int, context: torch.Tensor) -> float:
    """One pass of `rows` rows, at most `each` a runner, timed; the runners rolled back."""
    sizes = [min(each, rows - i * each) for i in range(-(-rows // each))]
    assert len(sizes) <= len(runners), (rows, len(runners))
    parts = runners[: len(sizes)]
    device = context.device
    fed: list[PassRows] = [torch.arange(40, 40 + n, device=device) for n in sizes]
    t0 = time.perf_counter()
    score_together(parts, fed)
    seconds = time.perf_counter() - t0
    for runner in parts:
        runner.truncate(context.shape[0])
    return seconds


def tree_node_cost(runner: Runner, one_row: float, repeats: int = 3) -> float:
    """v_tree = (t(tree of `rows` nodes) / t(1 row) - 1) / (rows - 1), clamped to [0, 1]. The
    tree is a chain, which gathers as many keys as any tree of its size."""
    rows = runner.rows
    if rows is None or rows < 2:
        return 0.0
    device = runner.model.device
    context = torch.arange(1, CONTEXT + 1, device=device)
    tree = TokenTree.chain(40, list(range(41, 40 + rows)))
    offsets = tree.slot_offsets()  # [rows]
    visible = tree.region_mask(offsets)
    runner.prefill(context, span=MEASURE_SPAN)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        runner.tree_pass(tree.tokens.to(device), tree.depths, offsets, visible)
        times.append(time.perf_counter() - t0)
        runner.truncate(context.shape[0])
    runner.truncate(0)
    return min(max((min(times[1:]) / one_row - 1.0) / (rows - 1), 0.0), 1.0)


def catch_up_seconds(runner: Runner) -> float:
    """The draft's prefill time per token of a CONTEXT-token prompt."""
    context = torch.arange(1, CONTEXT + 1, device=runner.model.device)
    t0 = time.perf_counter()
    runner.prefill(context, span=MEASURE_SPAN)
    seconds = (time.perf_counter() - t0) / CONTEXT
    runner.truncate(0)
    return seconds


def one_row_and_step_seconds(
    target: Runner, step: DraftStep, sweeps: int = STEP_SWEEPS
) -> tuple[float, float]:
    """(a one-row target pass, one drafting step), each the best of `sweeps` sweeps that
    time one of each in turn (each after a warm-up of its own): c is their ratio."""
    context = torch.arange(1, CONTEXT + 1, device=target.model.device)
    passes, steps = [], []
    for _ in range(sweeps):
        target.prefill(context, span=MEASURE_SPAN)
        passes.append(best_extend_seconds(target, context, context[:1], 1))
        target.truncate(0)
        step()  # warm-up
        t0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t0)
    return min(passes), min(steps)


def one_row_seconds(target: Runner, sweeps: int = STEP_SWEEPS) -> float:
    """A one-row target pass, best of `sweeps` (a free drafter's engine needs only this)."""
    context = torch.arange(1, CONTEXT + 1, device=target.model.device)
    target.prefill(context, span=MEASURE_SPAN)
    seconds = best_extend_seconds(target, context, context[:1], sweeps)
    target.truncate(0)
    return seconds


def measure_costs(
    target: Runner, step: DraftStep | None, draft: Runner | None, unpadded: bool, trees: bool
) -> Costs:
    """The costs of a drafter against the target's runner. `step`: one drafting step (None:
    the drafter's guesses cost nothing); `draft`: its draft model's runner, if any. The pass
    curve only on unpadded passes (padded ones cost the same whatever their real rows), v_tree
    only where trees may be chosen (tree="auto"), c clamped to [0.01, 1] (0 when free)."""
    if step is None:
        one_row, step_s = one_row_seconds(target), 0.0
    else:
        one_row, step_s = one_row_and_step_seconds(target, step)
    rows = target.rows or 1
    curve = (
        pass_curve([target], curve_rows(rows), CURVE_SWEEPS)
        if unpadded and rows > 1
        else PassCurve()
    )
    return Costs(
        draft_step=0.0 if step_s == 0 else min(max(step_s / one_row, 0.01), 1.0),
        row=row_cost(curve.ratios),
        tree_node=tree_node_cost(target, one_row) if unpadded and trees else 0.0,
        catch_up=0.0 if draft is None else catch_up_seconds(draft) / one_row,
        pass_curve=curve,
    )


def measure_batch_costs(
    targets: list[Runner], drafts: list[Runner], most_rows: int, sweeps: int = BATCH_SWEEPS
) -> BatchCosts:
    """The target's pass curve up to `most_rows` rows and the draft's step curve up to one row
    per seat (None without a draft model), measured once when a batched engine is built."""
    target = pass_curve(targets, row_points(most_rows), sweeps)
    draft = pass_curve(drafts, row_points(len(drafts)), sweeps, each=1) if drafts else None
    return BatchCosts(target, draft)

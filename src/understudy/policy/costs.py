"""The measured costs a round's plan weighs, as fractions of a one-row target pass.

    c (draft_step)  one drafting step (one guess of a draft model or head) / one target pass
    v (row)         one more row in an unpadded target pass / a one-row pass
    v_tree          one more node in a tree pass (each node gathers its path's keys)
    catch_up        the draft's prefill time per token it has not yet seen / one target pass

A round of K chain guesses then costs 1 + K*c + K*v target passes (Leviathan et al. 2023,
Thm 3.8, plus v). They are measured ONCE, when the engine is built, and handed to it as one
frozen value: the plan of every round then depends only on the request and its seed, so
seeded sampling stays reproducible.

Timings use a typical request's key window (MEASURE_SPAN slots), not the engine's whole
max_context: attention over thousands of empty slots would inflate the target's pass. Each
figure is the best of a few timings after a warm-up, so a busy machine disturbs it less, and
they are taken in sweeps (a one-row pass and a drafting step in turn; the pass curve's row
counts in turn), so a busy spell of a few seconds slows one sweep, not every timing of one
figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from understudy.models.runner import Runner
from understudy.verify.token_tree import TokenTree

if TYPE_CHECKING:
    from understudy.drafters.base import Drafter

MEASURE_SPAN = 480  # key slots of a typical request (prompt + budget)
CONTEXT = 32  # tokens of the dummy context the passes are timed after
EVERY_ROW_UPTO = 8  # pass_curve times each row count up to this, then every fourth
CURVE_SWEEPS = 4  # pass_curve's timings of each row count, one a sweep
STEP_SWEEPS = 6  # timings of a one-row pass and of a drafting step, one of each a sweep


@dataclass(frozen=True)
class Costs:
    draft_step: float = 0.0  # c
    row: float = 0.0  # v (0 with padded passes, whose cost does not depend on real rows)
    tree_node: float = 0.0  # v_tree
    catch_up: float = 0.0
    # t(n rows) / t(1 row) for n = 1, 2, ... up to the row budget, on unpadded passes (empty
    # where not measured): a kernel that shares its weights among GROUP rows is flat up to
    # GROUP and steps there, which one slope v cannot say
    pass_curve: tuple[float, ...] = ()

    def row_steps(self) -> tuple[float, ...]:
        """What the (g + 2)-th row of a pass costs (in 1-row passes), g = 0, 1, ...: the row
        the (g + 1)-th guess of a round adds, read off the curve's lower convex hull."""
        return hull_steps(self.pass_curve)


def hull_steps(curve: tuple[float, ...]) -> tuple[float, ...]:
    """The slope of the lower convex hull of the points (n, curve[n - 1]) over each row after
    the first: nondecreasing, and summing to curve[-1] - 1.

    The path rule (drafters/calibration.py) weighs each guess alone: go on while the chance
    of keeping the round is above the guess's own cost. Chances fall guess by guess, so where
    those costs rise row by row (a convex curve) that rule is the best stopping rule there is.
    The hull gives every curve that shape: a step in the curve followed by cheap rows (a
    kernel's row group) is spread over them, so a guess is not charged the whole step when
    the rows after it come nearly free; and a pass timed in a busy moment, which reads above
    its neighbours, lies above the hull and changes nothing. Taken as they are, the curve's
    differences carried that noise into every round of the engine's life: on a shared
    2-core machine, three builds in a row gave the sixth guess a threshold of 0.90, 0.39 and 0.78."""
    if len(curve) < 2:
        return ()
    hull: list[tuple[int, float]] = []
    for point in enumerate(curve, start=1):
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (point[1] - y0) - (y1 - y0) * (point[0] - x0) > 0:
                break  # a left turn: hull[-1] stays on the lower hull
            hull.pop()
        hull.append(point)
    steps: list[float] = []
    for (x0, y0), (x1, y1) in zip(hull, hull[1:], strict=False):
        steps += [max((y1 - y0) / (x1 - x0), 0.0)] * (x1 - x0)
    return tuple(steps)


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


def curve_rows(rows: int) -> list[int]:
    """The row counts pass_curve times: every one up to EVERY_ROW_UPTO (where most rounds
    end, and where a kernel's row group steps), then every fourth and the budget itself."""
    return [n for n in range(1, rows + 1) if n <= EVERY_ROW_UPTO or n % 4 == 0 or n == rows]


def pass_curve(runner: Runner, sweeps: int = CURVE_SWEEPS) -> tuple[float, ...]:
    """t(n) / t(1) for unpadded passes of n = 1 .. the runner's row budget rows: timed at
    curve_rows, linear between them, and never below the pass of fewer rows (a timing that
    dips under its neighbour is noise, and would read as a step at the next row); () without
    a budget of 2 rows or more. Timing every count would cost the engine's build ~50 target
    passes more on a CPU whose rows are not flat.

    Each count is timed once a sweep, after a one-row pass, over `sweeps` sweeps; its figure
    is its best over the one-row pass's best. A busy spell of a shared machine lasts seconds:
    timed repeat after repeat, one count's timings all fell in one (four curves measured in a
    row read a 2-row pass at 1.38, 1.24, 1.09 and 1.22 one-row passes); spread over sweeps,
    it slows one sweep of every count. The curve decides whether a round drafts at all
    (policy/adaptive_k.py)."""
    rows = runner.rows
    if rows is None or rows < 2:
        return ()
    device = runner.model.device
    context = torch.arange(1, CONTEXT + 1, device=device)
    runner.prefill(context, span=MEASURE_SPAN)
    counts = curve_rows(rows)
    best = dict.fromkeys(counts, float("inf"))
    for sweep in range(sweeps + 1):  # the first a warm-up
        for n in counts[1:]:
            for m in (1, n):
                t0 = time.perf_counter()
                runner.extend(torch.arange(40, 40 + m, device=device))
                if sweep:
                    best[m] = min(best[m], time.perf_counter() - t0)
                runner.truncate(context.shape[0])
    runner.truncate(0)
    timed = {n: best[n] / best[1] for n in counts}
    known = sorted(timed)
    curve = [1.0]
    for n in range(2, rows + 1):
        upper = next(k for k in known if k >= n)
        lower = max(k for k in known if k <= n)
        share = 0.0 if upper == lower else (n - lower) / (upper - lower)
        value = timed[lower] + share * (timed[upper] - timed[lower])
        curve.append(max(curve[-1], value))
    return tuple(curve)


def row_cost(curve: tuple[float, ...]) -> float:
    """v = (t(rows) / t(1) - 1) / (rows - 1) at the full row budget, clamped to [0, 1]."""
    if len(curve) < 2:
        return 0.0
    return min(max((curve[-1] - 1.0) / (len(curve) - 1), 0.0), 1.0)


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
    target: Runner, drafter: Drafter, sweeps: int = STEP_SWEEPS
) -> tuple[float, float]:
    """(a one-row target pass, one drafting step), each the best of `sweeps` sweeps that
    time one of each in turn: c is their ratio. Timed repeat after repeat, a busy spell of a
    shared machine (it lasts seconds) takes every timing of one figure, and c with it; in
    sweeps it slows one timing of each."""
    context = torch.arange(1, CONTEXT + 1, device=target.model.device)
    passes, steps = [], []
    for _ in range(sweeps):
        target.prefill(context, span=MEASURE_SPAN)
        passes.append(best_extend_seconds(target, context, context[:1], 1))
        target.truncate(0)
        steps.append(drafter.step_seconds(1))
    return min(passes), min(steps)


def measure_costs(target: Runner, drafter: Drafter, unpadded: bool, trees: bool) -> Costs:
    """All the costs of `drafter` against the target's `runner`: v and the pass curve only
    on unpadded passes (padded ones cost the same whatever their real rows), v_tree only
    where trees may be chosen (tree="auto"), c clamped to [0.01, 1] (0 for a free drafter)."""
    one_row, step = one_row_and_step_seconds(target, drafter)
    draft = drafter.draft_runner()
    curve = pass_curve(target) if unpadded else ()
    return Costs(
        draft_step=0.0 if step == 0 else min(max(step / one_row, 0.01), 1.0),
        row=row_cost(curve),
        tree_node=tree_node_cost(target, one_row) if unpadded and trees else 0.0,
        catch_up=0.0 if draft is None else catch_up_seconds(draft) / one_row,
        pass_curve=curve,
    )

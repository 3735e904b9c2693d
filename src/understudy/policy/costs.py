"""The costs a round's plan weighs, as fractions of a one-row target pass, and the pass curve.

    c (draft_step)  one drafting step (one guess of a draft model or head) / one target pass
    v (row)         one more row in an unpadded target pass / a one-row pass
    v_tree          one more node in a tree pass (each node gathers its path's keys)
    catch_up        the draft's prefill time per token it has not yet seen / one target pass
    T(n)            a target pass of n rows / a one-row pass (the pass curve)

A round of K chain guesses then costs K*c + T(K + 1) target passes (Leviathan et al. 2023,
Thm 3.8, with the rows priced). The costs are measured ONCE, when the engine is built
(understudy/measure/), and handed to it as one frozen value: the plan of every round then
depends only on the request and its seed, so seeded sampling stays reproducible. This module
only decides from them; it times nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class PassCurve:
    """What one target pass costs by the rows it scores: `seconds[i]` for `rows[i]` rows
    (increasing; rows[0] == 1 where ratios are read), linear between the points and beyond
    the last two. Empty where nothing was measured: a padded pass costs the same whatever
    its real rows.

    A kernel that shares its weights among a group of rows is flat up to the group and
    steps there, which one slope v cannot say; the curve can."""

    rows: tuple[int, ...] = ()
    seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.rows) == len(self.seconds), (self.rows, self.seconds)
        assert list(self.rows) == sorted(set(self.rows)), f"rows must increase: {self.rows}"

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def most(self) -> int:
        """The most rows measured (0 where nothing was)."""
        return self.rows[-1] if self.rows else 0

    def seconds_at(self, n: float) -> float:
        """Seconds of a pass of n rows (0 rows: nothing to pass)."""
        if n <= 0 or not self.rows:
            return 0.0
        xs, ys = self.rows, self.seconds
        if len(xs) == 1:
            return ys[0] * n / xs[0]
        i = next((i for i in range(1, len(xs)) if n <= xs[i]), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (n - xs[i - 1]), 0.0)

    @cached_property
    def ratios(self) -> tuple[float, ...]:
        """T(n) = t(n) / t(1) for n = 1 .. most, never below T(n - 1): a timing that dips
        under its neighbour is noise, and would read as a step at the next row."""
        if not self.rows or self.rows[0] != 1:
            return ()
        one = self.seconds[0]
        out = [1.0]
        for n in range(2, self.most + 1):
            out.append(max(out[-1], self.seconds_at(n) / one))
        return tuple(out)


@dataclass(frozen=True)
class Costs:
    draft_step: float = 0.0  # c
    row: float = 0.0  # v (0 with padded passes, whose cost does not depend on real rows)
    tree_node: float = 0.0  # v_tree
    catch_up: float = 0.0
    pass_curve: PassCurve = field(default_factory=PassCurve)  # measured on unpadded passes

    def pass_cost(self, guesses: int) -> float:
        """T(guesses + 1) in one-row passes: the measured curve where it reaches, else
        1 + guesses * v."""
        ratios = self.pass_curve.ratios
        return ratios[guesses] if guesses < len(ratios) else 1.0 + guesses * self.row

    def row_steps(self) -> tuple[float, ...]:
        """What the (g + 2)-th row of a pass costs (in 1-row passes), g = 0, 1, ...: the row
        the (g + 1)-th guess of a round adds, read off the curve's lower convex hull."""
        return hull_steps(self.pass_curve.ratios)


def hull_steps(curve: tuple[float, ...]) -> tuple[float, ...]:
    """The slope of the lower convex hull of the points (n, curve[n - 1]) over each row after
    the first: nondecreasing, and summing to curve[-1] - 1.

    The path rule (drafters/calibration.py) weighs each guess alone: go on while the chance
    of keeping the round is above the guess's own cost. Chances fall guess by guess, so where
    those costs rise row by row (a convex curve) that rule is the best stopping rule there is.
    The hull gives every curve that shape: a step in the curve followed by cheap rows (a
    kernel's row group) is spread over them, so a guess is not charged the whole step when
    the rows after it come nearly free; and a pass timed in a busy moment, which reads above
    its neighbours, lies above the hull and changes nothing, where the curve's own
    differences would carry that noise into every round of the engine's life."""
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


def row_cost(curve: tuple[float, ...]) -> float:
    """v = (T(rows) - 1) / (rows - 1) at the full row budget, clamped to [0, 1]."""
    if len(curve) < 2:
        return 0.0
    return min(max((curve[-1] - 1.0) / (len(curve) - 1), 0.0), 1.0)

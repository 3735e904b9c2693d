"""method="draft" with draft_confidence: a round stops at a guess the draft itself doubts.

Lossless like every rule that looks only at the draft's side: greedy output equals plain
decoding, and the sampled joint law of the first 3 tokens is the target's (chi-squared,
p > 0.001, with the harness of test_exactness.py).
"""

from __future__ import annotations

import pytest

from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams, UnderstudyError


def test_greedy_identity_and_early_stop(tiny_pair):
    target, draft = tiny_pair
    sure = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5
    )
    doubting = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5, draft_confidence=0.9
    )
    plain = sure.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drafted = {"sure": 0, "doubting": 0}
    for prompt in random_prompts(4, seed=3):
        expected = plain.generate(prompt, params).token_ids
        for name, engine in (("sure", sure), ("doubting", doubting)):
            out = engine.generate(prompt, params)
            assert out.token_ids == expected, name
            drafted[name] += out.stats.drafted
    assert 0 < drafted["doubting"] < drafted["sure"], drafted  # rounds did stop early


def test_full_confidence_drafts_one_token(tiny_pair):
    """At 1.0 every guess after the first is doubted (its probability is below 1)."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5, draft_confidence=1.0
    )
    rounds = []
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    list(engine.stream([5, 6, 7], params, on_round=rounds.append))
    assert rounds and all(len(r.drafted) == 1 for r in rounds)


@pytest.mark.parametrize("value", [-0.1, 1.5, "high", True])
@pytest.mark.parametrize("name", ["draft_confidence", "draft_path_confidence"])
def test_bad_confidence_is_refused(tiny_pair, name, value):
    target, draft = tiny_pair
    with pytest.raises(UnderstudyError, match=name):
        Engine.from_pretrained(target=target, draft=draft, **{name: value})


@pytest.mark.parametrize(
    "rule", [{"draft_confidence": 0.5}, {"draft_path_confidence": 0.3}], ids=["token", "path"]
)
def test_sampling_law_with_early_stop(tmp_path_factory, rule):
    """The stop depends on the draft's own draws only: the target's law is kept."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("confidence"), seed=5, noise=0.5, tokenizer=False
    )
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=3, **rule
    )
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"


def test_auto_confidence_follows_k(tiny_pair):
    """draft_path_confidence="auto" (the default): on under automatic K, off under a fixed K;
    draft_confidence is off unless given."""
    from understudy.drafters.draft_model import AUTO_PATH_CONFIDENCE

    target, draft = tiny_pair
    automatic = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    fixed = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=4
    )
    chosen = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", draft_path_confidence=0.2
    )
    guess = automatic.costs.draft_step + automatic.costs.row
    assert automatic.drafter.path_confidence == min(max(AUTO_PATH_CONFIDENCE, guess), 1.0)
    assert automatic.drafter.path_confidence >= AUTO_PATH_CONFIDENCE > 0
    assert automatic.drafter.confidence == 0.0
    assert fixed.drafter.path_confidence == 0.0 and not fixed.drafter.stops_by_confidence
    assert chosen.drafter.path_confidence == 0.2


@pytest.mark.parametrize(
    ("c", "v", "automatic_k", "settled"),
    [
        (0.05, 0.0, True, 0.2),
        (0.45, 0.15, True, 0.6),
        (0.9, 0.3, True, 1.0),
        (0.45, 0.15, False, 0.0),
    ],
)
def test_auto_path_confidence_is_at_least_what_a_guess_costs(tiny_pair, c, v, automatic_k, settled):
    """A guess costs c + v target passes; plain decoding earns a token a pass, so under
    automatic K a round stops where the chance of keeping it falls below c + v (floor 0.2)."""
    from understudy.policy.costs import Costs

    target, draft = tiny_pair
    drafter = Engine.from_pretrained(target=target, draft=draft, dtype="float32").drafter
    drafter.path_confidence = None  # "auto", as the builder hands it over
    drafter.settle(Costs(draft_step=c, row=v), automatic_k)
    assert drafter.path_confidence == pytest.approx(settled)


def test_each_guess_pays_for_its_own_row_where_the_pass_curve_is_known(tiny_pair):
    """With a measured pass curve, guess g + 1's threshold is c plus what its row (row g + 2)
    adds to the pass on the curve's lower convex hull: small inside the kernel's row group,
    the step at its edge spread over the rows it buys; past the curve, the settled c + v.
    Without automatic K, none."""
    from understudy.policy.costs import Costs, PassCurve

    target, draft = tiny_pair
    drafter = Engine.from_pretrained(target=target, draft=draft, dtype="float32").drafter
    curve = (1.0, 1.02, 1.03, 1.05, 2.0, 2.01)  # t(n rows) / t(1), flat to 4 rows, then a step
    costs = Costs(draft_step=0.25, row=0.2, pass_curve=PassCurve(tuple(range(1, 7)), curve))
    assert costs.row_steps() == pytest.approx((0.015, 0.015, 0.02, 0.48, 0.48))
    drafter.path_confidence = None
    drafter.settle(costs, True)
    floors = [drafter.path_doubt(g) for g in range(7)]
    assert floors == pytest.approx([0.265, 0.265, 0.27, 0.73, 0.73, 0.45, 0.45])
    drafter.path_confidence = None
    drafter.settle(costs, False)
    assert [drafter.path_doubt(g) for g in range(3)] == [0.0, 0.0, 0.0]


def test_the_measured_pass_curve_starts_at_one_and_never_falls(tiny_pair):
    """The engine measures t(n rows) / t(1) up to its row budget on unpadded passes (every
    count to 8, every fourth beyond, linear between); a timing below a smaller pass's is
    noise and is raised to it, so no row reads as cheaper than none (row_steps >= 0) and
    the slope v is the curve's own."""
    from understudy.measure.passes import curve_rows
    from understudy.policy.costs import row_cost

    assert curve_rows(16) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]  # timed; linear in between
    assert curve_rows(10) == [1, 2, 3, 4, 5, 6, 7, 8, 10] and curve_rows(2) == [1, 2]

    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    curve = engine.costs.pass_curve.ratios
    assert len(curve) == engine.runner.rows and curve[0] == 1.0
    assert all(later >= earlier for earlier, later in zip(curve, curve[1:], strict=False))
    assert all(step >= 0.0 for step in engine.costs.row_steps())
    assert engine.costs.row == pytest.approx(row_cost(curve))


def test_path_confidence_stops_on_the_product(tiny_pair):
    """At path confidence 1.0 a round stops before its second guess (the product of
    probabilities below 1 is below 1); greedy output is still plain decoding's."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target,
        draft=draft,
        dtype="float32",
        num_speculative_tokens=5,
        draft_path_confidence=1.0,
    )
    rounds = []
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    stream = engine.stream([5, 6, 7], params, on_round=rounds.append)
    for _ in stream:
        pass
    assert rounds and all(len(r.drafted) == 1 for r in rounds)
    assert (
        stream.output.token_ids == engine.with_method("none").generate([5, 6, 7], params).token_ids
    )


def test_automatic_k_drafts_until_doubt(tiny_pair):
    """Under automatic K with the draft's doubt on, a round may draft up to the row budget
    (automatic K's own estimates stop it near 8 on these models: the mutation that keeps its
    K fails here). Greedy output stays plain decoding's."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    # the per-token rule at a low bar (the tiny models' probabilities are low, so a product
    # of them would stop every round early): the draft rarely doubts, rounds should run long
    engine.drafter.confidence, engine.drafter.path_confidence = 0.05, 0.0
    engine.drafter.path_floors = ()  # the per-row floors settled from the pass curve: off too
    k_max = engine.runner.rows - 1
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    longest = 0
    for prompt in random_prompts(3, seed=11):
        rounds = []
        stream = engine.stream(prompt, params, on_round=rounds.append)
        for _ in stream:
            pass
        assert stream.output.token_ids == plain.generate(prompt, params).token_ids
        longest = max([longest, *(len(r.drafted) for r in rounds)])
    assert longest > 8, (longest, k_max)  # past what automatic K's estimates alone allowed


def test_calibration_learns_what_the_target_kept():
    """A fresh calibration answers the draft's own p; a bin's record then takes over, and a
    guess after the first rejection is not observed (the target never judged it)."""
    from understudy.drafters.calibration import AcceptanceCalibration

    calibration = AcceptanceCalibration()
    assert all(calibration.estimate(p) == p for p in (0.05, 0.45, 0.95))
    for _ in range(40):  # under-confident at 0.45: always kept
        calibration.observe_round([0.45, 0.45], kept=2)
    for _ in range(40):  # over-confident at 0.95, and the 0.15 after it never judged
        calibration.observe_round([0.95, 0.15], kept=0)
    assert calibration.estimate(0.45) > 0.9
    assert calibration.estimate(0.95) < 0.1
    assert calibration.estimate(0.15) == 0.15  # never observed
    assert calibration.estimate(0.75) == 0.75  # another bin


def test_calibration_observes_each_judged_guess(tiny_pair):
    """Within a request the drafter observes exactly the guesses the target judged: up to and
    including the first rejection of every committed round (the last round is not committed)."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    engine.drafter.path_confidence = 0.05  # the tiny draft's probabilities are low
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rounds = []
    stream = engine.stream([5, 6, 7], params, on_round=rounds.append)
    for _ in stream:
        pass
    judged = sum(min(r.accepted + 1, len(r.drafted)) for r in rounds[:-1])
    kept = sum(r.accepted for r in rounds[:-1])
    calibration = engine.drafter.calibration
    assert judged > 0 and sum(calibration.seen) == judged
    assert sum(calibration.kept) == kept


def test_a_round_the_path_rule_must_end_skips_the_pass_that_would_show_it(tiny_pair, monkeypatch):
    """When the path times the highest calibrated estimate is under the next guess's floor,
    no draft can pass it: the chain ends without the draft pass that would only show that.
    Every round proposes the same guesses as with that pass taken (the bound disabled), the
    output is plain decoding's, and fewer draft passes run."""
    from understudy.drafters.calibration import AcceptanceCalibration

    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=6,
        draft_path_confidence=0.5,
    )  # fmt: skip
    runner = engine.drafter.draft_runner()
    extend = runner.extend
    passes = [0]

    def counted(*args, **kwargs):
        passes[0] += 1
        return extend(*args, **kwargs)

    monkeypatch.setattr(runner, "extend", counted)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(3, seed=11)
    plain = [engine.with_method("none").generate(p, params).token_ids for p in prompts]

    def run() -> tuple[list[list[int]], list[list[int]], int]:
        passes[0] = 0
        rounds, outputs = [], []
        for prompt in prompts:
            events = engine.stream(prompt, params, on_round=rounds.append)
            outputs.append([event.token_id for event in events])
        return [list(r.drafted) for r in rounds], outputs, passes[0]

    proposals, outputs, skipping = run()
    monkeypatch.setattr(AcceptanceCalibration, "highest_estimate", lambda self: float("inf"))
    proposals_on, outputs_on, drafting_on = run()
    assert proposals == proposals_on and outputs == outputs_on == plain
    assert skipping < drafting_on, (skipping, drafting_on)


@pytest.mark.parametrize("busy_row", [3, 6, 9])
def test_a_pass_timed_in_a_busy_moment_moves_no_threshold(busy_row):
    """Row costs come from the pass curve's lower convex hull: nondecreasing, summing to the
    curve's rise, and a pass that read high (a busy moment on a shared machine) lies above
    the hull and changes no row's cost. Taken as the curve's differences, that row would
    cost 0.6 more and the row after it nothing."""
    from understudy.policy.costs import hull_steps

    curve = tuple(1.0 + 0.25 * n for n in range(12))  # 12 rows, 0.25 of a pass each
    busy = tuple(t + (0.6 if n == busy_row - 1 else 0.0) for n, t in enumerate(curve))
    assert hull_steps(busy) == pytest.approx(hull_steps(curve))
    assert hull_steps(curve) == pytest.approx((0.25,) * 11)
    measured = (1.0, 1.05, 1.21, 1.38, 1.5, 1.75, 2.59, 2.59, 2.69, 2.94, 3.2, 3.46, 3.99, 4.52)
    steps = hull_steps(measured)
    assert all(b >= a for a, b in zip(steps, steps[1:], strict=False))
    assert sum(steps) == pytest.approx(measured[-1] - 1.0)
    assert all(s < 0.6 for s in steps)  # the 0.84 jump to 7 rows is spread, not charged
    assert hull_steps((1.0,)) == () and hull_steps((1.0, 0.9)) == (0.0,)


def test_a_busy_spell_while_the_curve_is_timed_slows_no_row_count(tiny_pair, monkeypatch):
    """pass_curve times each row count once a sweep, over several sweeps, best over best: a
    spell of slow passes (another tenant's burst on a shared machine) as long as a sweep
    slows one timing of each count, and the curve reads as without it. Timed count after
    count instead, the spell would take every timing of a few counts (ratios of ~50 here)."""
    import time as time_module

    from understudy.measure import passes as costs

    target, draft = tiny_pair
    runner = Engine.from_pretrained(target=target, draft=draft, dtype="float32").runner

    def curve() -> tuple[float, ...]:
        return costs.pass_curve([runner], costs.curve_rows(runner.rows), costs.CURVE_SWEEPS).ratios

    quiet = curve()
    extend, calls = runner.extend, []

    def busy_extend(tokens, *args, **kwargs):
        calls.append(len(calls))
        if 20 <= len(calls) < 20 + 2 * (len(costs.curve_rows(runner.rows)) - 1):
            time_module.sleep(0.05)  # a sweep's worth of passes, ~50x a tiny pass
        return extend(tokens, *args, **kwargs)

    monkeypatch.setattr(runner, "extend", busy_extend)
    busy = curve()
    assert len(busy) == len(quiet) == runner.rows
    assert max(busy) < 5.0, busy  # the spell's timings are never a count's best


def test_a_busy_spell_while_c_is_timed_slows_neither_of_its_figures(tiny_pair, monkeypatch):
    """c is a drafting step over a one-row target pass, each the best of sweeps that time
    one of each in turn: a spell of slow passes over the first sweeps leaves later sweeps'
    passes to be the best. Timed five in a row (as before sweeps), one spell took
    every timing of one figure (c read 0.26-0.47 over builds of the default pair)."""
    import time as time_module

    from understudy.measure import passes as costs

    target, draft = tiny_pair
    engine = Engine.from_pretrained(target=target, draft=draft, dtype="float32")
    runner, step = engine.runner, engine.drafter.timed_step()
    quiet_pass, quiet_step = costs.one_row_and_step_seconds(runner, step)
    extend, calls = runner.extend, []

    def busy_extend(tokens, *args, **kwargs):
        calls.append(len(calls))
        if len(calls) <= 7:  # passes of 3.5 sweeps (a warm-up and a timing each); timed
            time_module.sleep(0.05)  # in a row, a warm-up and all 6 timings
        return extend(tokens, *args, **kwargs)

    monkeypatch.setattr(runner, "extend", busy_extend)
    busy_pass, busy_step = costs.one_row_and_step_seconds(runner, step)
    assert busy_pass < 0.05 and quiet_pass < 0.05, (busy_pass, quiet_pass)
    assert len(calls) == 2 * costs.STEP_SWEEPS
    assert busy_step > 0.0 and quiet_step > 0.0

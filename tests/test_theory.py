"""Theory of speculative decoding (Leviathan et al. 2023, eq. 1 and Theorem 3.8) and the
`understudy simulate` command. Expected values are derived by hand in the comments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from understudy.cli.simulate import simulate, sparkline
from understudy.config import UnderstudyError
from understudy.policy.theory import (
    PassCost,
    alpha_from_acceptance_rate,
    expected_acceptance_rate,
    expected_speedup,
    expected_tokens_per_round,
    monte_carlo,
    optimal_k,
    parse_pass_curve,
    round_cost,
    simulate_report,
    speedup_curve,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


# --- expected tokens per round: E = (1 - a^(K+1)) / (1 - a) ----------------------------------


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [
        (0.5, 1, 1.5),  # (1 - 0.25) / 0.5 = 1.5
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.8, 4, 3.3616),  # (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616
        (0.0, 7, 1.0),  # every draft rejected: only the corrected token
        (1.0, 4, 5.0),  # limit a -> 1: K + 1
        (1.0, 64, 65.0),
    ],
)
def test_expected_tokens_per_round_hand_values(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens_per_round(alpha, k) == pytest.approx(expected, rel=1e-12)


def test_expected_tokens_per_round_is_continuous_at_alpha_one() -> None:
    # 1 + a + ... + a^4 at a = 1 - 1e-9 is 5 - (0+1+2+3+4)*1e-9 to first order = 5 - 1e-8
    assert expected_tokens_per_round(1 - 1e-9, 4) == pytest.approx(5 - 1e-8, abs=1e-12)


def test_closed_form_matches_for_generic_alpha() -> None:
    for alpha in (0.1, 0.37, 0.9, 0.999):
        for k in (1, 3, 16, 64):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert expected_tokens_per_round(alpha, k) == pytest.approx(closed, rel=1e-9)


def test_expected_acceptance_rate() -> None:
    # a = 0.8, K = 4: (3.3616 - 1) / 4 = 0.5904 -- below a, rejections cut off later tokens
    assert expected_acceptance_rate(0.8, 4) == pytest.approx(0.5904)
    # K = 1: the single drafted token is kept with probability a
    assert expected_acceptance_rate(0.3, 1) == pytest.approx(0.3)


# --- speedup = E / (K c + 1) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "k", "c", "expected"),
    [
        (0.5, 1, 0.0, 1.5),  # free drafter: speedup = E
        (0.5, 1, 0.5, 1.0),  # 1.5 / (0.5 + 1)
        (0.8, 4, 0.1, 3.3616 / 1.4),  # = 2.401142857...
        (1.0, 4, 0.25, 2.5),  # 5 / (4 * 0.25 + 1) = 5 / 2
        (0.0, 3, 1.0, 0.25),  # 1 / (3 + 1): a useless drafter is a 4x slowdown
    ],
)
def test_expected_speedup_hand_values(alpha: float, k: int, c: float, expected: float) -> None:
    assert expected_speedup(alpha, k, c) == pytest.approx(expected, rel=1e-12)


def test_optimal_k_alpha_08_c_01() -> None:
    # speedup(K) = (1 - 0.8^(K+1)) / 0.2 / (0.1 K + 1):
    #   K=4: 3.3616    / 1.4 = 2.40114
    #   K=5: 3.68928   / 1.5 = 2.45952     (1 - 0.8^6 = 1 - 0.262144)
    #   K=6: 3.951424  / 1.6 = 2.46964     (1 - 0.8^7 = 1 - 0.2097152)
    #   K=7: 4.1611392 / 1.7 = 2.44773     (1 - 0.8^8 = 1 - 0.16777216)
    # and it keeps falling after K=7, so K=6 with 2.46964.
    k, speedup = optimal_k(0.8, 0.1)
    assert k == 6
    assert isinstance(k, int)
    assert speedup == pytest.approx(3.951424 / 1.6, rel=1e-12)


def test_optimal_k_edge_cases() -> None:
    # a = 0.5, c = 0.5: K=1 gives 1.5/1.5 = 1.0, K=2 gives 1.75/2 = 0.875, later K worse
    assert optimal_k(0.5, 0.5) == (1, pytest.approx(1.0))
    # a = 0, c = 0: every K gives exactly 1.0 -- a tie, so the smallest K wins
    assert optimal_k(0.0, 0.0) == (1, 1.0)
    # a = 1, c = 0: speedup K + 1 grows without bound -> the largest K allowed
    assert optimal_k(1.0, 0.0) == (64, 65.0)
    assert optimal_k(1.0, 0.0, k_max=8) == (8, 9.0)


def test_speedup_curve_indexing() -> None:
    curve = speedup_curve(0.8, 0.1)
    assert len(curve) == 64
    assert curve[3] == pytest.approx(3.3616 / 1.4)  # element i is K = i + 1
    assert max(curve) == curve[5]


# --- the rows' cost: speedup = E / (K c + T(K+1)) --------------------------------------------

STEPPED = PassCost.from_curve((1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0))  # a 4-row kernel group


@pytest.mark.parametrize(
    "flat",
    [PassCost(), PassCost(row=0.0), PassCost(curve=(1.0,) * 16), PassCost.from_curve((1.0,) * 4)],
    ids=["default", "v=0", "flat curve", "flat curve extended"],
)
def test_a_flat_pass_is_exactly_leviathans_formula(flat: PassCost) -> None:
    # T(n) = 1 for every n: E / (K c + T(K+1)) is E / (K c + 1), bit for bit
    assert flat.flat
    for alpha in (0.0, 0.3, 0.8, 0.98, 1.0):
        for c in (0.0, 0.05, 0.27, 1.0):
            for k in (1, 2, 5, 16, 64):
                leviathan = expected_tokens_per_round(alpha, k) / (k * c + 1.0)
                assert expected_speedup(alpha, k, c, flat) == leviathan
                assert expected_speedup(alpha, k, c) == leviathan
            assert speedup_curve(alpha, c, passes=flat) == speedup_curve(alpha, c)
            assert optimal_k(alpha, c, passes=flat) == optimal_k(alpha, c)


def test_pass_cost_reads_a_slope_or_a_curve() -> None:
    assert PassCost(row=0.1).rows(1) == 1.0
    assert PassCost(row=0.1).rows(6) == pytest.approx(1.5)  # 1 + 5 * 0.1
    # the stepped curve: flat to 4 rows, 2 from 5 to 8; past it the line from (1, 1) to
    # (8, 2), slope 1/7: T(9) = 1 + 8/7
    assert STEPPED.row == pytest.approx(1 / 7)
    assert [STEPPED.rows(n) for n in (1, 4, 5, 8)] == [1.0, 1.0, 2.0, 2.0]
    assert STEPPED.rows(9) == pytest.approx(1 + 8 / 7)
    assert not STEPPED.flat and not PassCost(row=0.1).flat
    assert round_cost(4, 0.1, STEPPED) == pytest.approx(0.4 + 2.0)  # K = 4: a 5-row pass


@pytest.mark.parametrize(
    ("alpha", "k", "c", "row", "expected"),
    [
        (0.8, 4, 0.1, 0.1, 3.3616 / 1.8),  # K c = 0.4, T(5) = 1 + 4 * 0.1 = 1.4
        (1.0, 4, 0.25, 0.25, 5 / 3),  # 5 / (1 + 1 + 4 * 0.25)
        (0.5, 1, 0.0, 1.0, 0.75),  # a free drafter, but a 2-row pass costs 2: 1.5 / 2
    ],
)
def test_speedup_with_a_row_cost_hand_values(alpha, k, c, row, expected) -> None:
    assert expected_speedup(alpha, k, c, PassCost(row=row)) == pytest.approx(expected, rel=1e-12)


def test_optimal_k_under_a_stepped_curve() -> None:
    # a = 0.9, c = 0.05, T = 1 up to 4 rows, 2 from 5 to 8, 1 + (n - 1)/7 after:
    #   K=2: 2.71      / (0.10 + 1)     = 2.46364
    #   K=3: 3.439     / (0.15 + 1)     = 2.99043  (the last K whose pass is in the flat group)
    #   K=4: 4.0951    / (0.20 + 2)     = 1.86141  (a 5-row pass: the step)
    #   K=7: 5.6953279 / (0.35 + 2)     = 2.42354  (the best after the step)
    #   K=8: 6.1257951 / (0.40 + 15/7)  = 2.40902  and falling after
    assert optimal_k(0.9, 0.05, passes=STEPPED) == (3, pytest.approx(3.439 / 1.15, rel=1e-12))
    # without the rows' cost the same a and c want K = 13 (4.67x): the flat theory
    # overstates both the best K and what it buys
    flat_k, flat_speedup = optimal_k(0.9, 0.05)
    assert flat_k == 13 and flat_speedup > 4.6
    # a row as dear as a pass: the longer the round, the worse; K = 1 is best
    assert optimal_k(0.9, 0.05, passes=PassCost(row=1.0))[0] == 1


def test_monte_carlo_charges_rows_and_agrees_with_the_formula_not_the_flat_one() -> None:
    """The simulator charges each round its K drafter steps and its pass of K + 1 rows. The
    formula with T agrees within 4 standard errors; the mutant formula that drops the rows'
    cost (Leviathan's flat T = 1) is refused by the same test, for every case."""
    cases = [(0.9, 4, 0.05, STEPPED), (0.9, 9, 0.05, STEPPED), (0.8, 4, 0.1, PassCost(row=0.1)),
             (0.98, 5, 0.27, PassCost(row=0.3))]  # fmt: skip
    for alpha, k, c, passes in cases:
        mc = monte_carlo(alpha, c, k, rounds=40_000, spread=0.0, seed=2, passes=passes)
        assert mc["round_cost"] == pytest.approx(k * c + passes.rows(k + 1))
        band = 4 * mc["speedup_stderr"]
        assert abs(mc["speedup"] - expected_speedup(alpha, k, c, passes)) < band
        assert abs(mc["speedup"] - expected_speedup(alpha, k, c)) > band  # the mutant fails


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: PassCost(row=-0.1), "row_cost must be >= 0"),
        (lambda: PassCost(row=float("nan")), "row_cost must be a finite number"),
        (lambda: PassCost(curve=(1.1, 1.2)), "pass_curve must start at 1"),
        (lambda: PassCost(curve=(1.0, 1.3, 1.2)), "pass_curve must never fall"),
        (lambda: PassCost(curve=(1.0, float("inf"))), "pass_curve must be a finite number"),
        (lambda: parse_pass_curve("1,1.1,x"), "pass_curve must be numbers separated by commas"),
        (lambda: parse_pass_curve(""), "pass_curve must be numbers separated by commas"),
        (lambda: alpha_from_acceptance_rate(1.5, 4), "acceptance_rate must be in [0, 1]"),
    ],
)
def test_bad_pass_costs_are_refused_by_name(call, words: str) -> None:
    with pytest.raises(UnderstudyError, match=words.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_parse_pass_curve() -> None:
    assert parse_pass_curve("1,1.01, 1.06") == (1.0, 1.01, 1.06)
    assert parse_pass_curve("1") == (1.0,)


def test_alpha_from_acceptance_rate_inverts_the_expected_rate() -> None:
    # a = 0.8, K = 4: accepted / drafted = 0.5904 (above), so 0.5904 at K = 4 reads as 0.8
    assert alpha_from_acceptance_rate(0.5904, 4) == pytest.approx(0.8, abs=1e-12)
    assert alpha_from_acceptance_rate(0.3, 1) == pytest.approx(0.3, abs=1e-12)  # K = 1: a
    for rate in (0.0, 0.25, 0.9, 0.98, 1.0):
        alpha = alpha_from_acceptance_rate(rate, 5)
        assert expected_acceptance_rate(alpha, 5) == pytest.approx(rate, abs=1e-12)


# --- Monte Carlo -----------------------------------------------------------------------------


@pytest.mark.parametrize(("alpha", "k"), [(0.8, 4), (0.5, 1), (0.95, 16), (0.3, 64)])
def test_monte_carlo_agrees_with_analytic_at_zero_spread(alpha: float, k: int) -> None:
    mc = monte_carlo(alpha, 0.1, k, rounds=20_000, spread=0.0, seed=1)
    expected = expected_tokens_per_round(alpha, k)
    assert abs(mc["tokens_per_round"] - expected) < 4 * mc["stderr"]
    assert mc["speedup"] == pytest.approx(mc["tokens_per_round"] / (k * 0.1 + 1))
    assert mc["mean_accepted_length"] == pytest.approx(mc["tokens_per_round"])
    # acceptance_rate = accepted / drafted = (tokens_per_round - 1) / K
    assert mc["acceptance_rate"] == pytest.approx((mc["tokens_per_round"] - 1) / k)
    # position i is kept with probability a^(i+1); position 0 with probability a
    assert len(mc["per_position_acceptance"]) == k
    assert mc["per_position_acceptance"][0] == pytest.approx(alpha, abs=0.02)


def test_monte_carlo_extremes_are_exact() -> None:
    # a = 1: every round keeps all K and adds a bonus token; a = 0: only the correction
    assert monte_carlo(1.0, 0.0, 4, rounds=100, spread=0.3)["tokens_per_round"] == 5.0
    zero = monte_carlo(0.0, 0.0, 4, rounds=100, spread=0.3)
    assert zero["tokens_per_round"] == 1.0
    assert zero["stderr"] == 0.0


def test_monte_carlo_is_seeded() -> None:
    assert monte_carlo(0.7, 0.1, 5, rounds=1000, seed=3) == monte_carlo(
        0.7, 0.1, 5, rounds=1000, seed=3
    )


def test_monte_carlo_spread_raises_mean_by_jensen() -> None:
    # E(a) is convex in a, so a per-round a' with mean 0.8 gives at least E(0.8) on average
    mc = monte_carlo(0.8, 0.1, 8, rounds=40_000, spread=0.15, seed=0)
    assert mc["tokens_per_round"] > expected_tokens_per_round(0.8, 8)
    assert mc["spread_effective"] == 0.15


def test_monte_carlo_spread_wider_than_any_beta_falls_back() -> None:
    # sd of a' can be at most sqrt(a(1-a)) = sqrt(0.99 * 0.01) ~ 0.0995
    mc = monte_carlo(0.99, 0.0, 4, rounds=2000, spread=0.5, seed=0)
    assert mc["spread_effective"] == pytest.approx((0.99 * 0.01) ** 0.5)
    assert 1.0 <= mc["tokens_per_round"] <= 5.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_round(1.5, 4),
        lambda: expected_tokens_per_round(-0.1, 4),
        lambda: expected_tokens_per_round(float("nan"), 4),
        lambda: expected_tokens_per_round(0.5, 0),
        lambda: expected_tokens_per_round(0.5, 65),
        lambda: expected_tokens_per_round(0.5, 2.5),
        lambda: expected_tokens_per_round(0.5, True),
        lambda: expected_speedup(0.5, 4, -0.1),
        lambda: expected_speedup(0.5, 4, float("inf")),
        lambda: optimal_k(0.5, 0.1, k_max=0),
        lambda: monte_carlo(0.5, 0.1, 4, rounds=1),
        lambda: monte_carlo(0.5, 0.1, 4, spread=-0.1),
        lambda: monte_carlo(0.5, 0.1, 4, seed=-1),
        lambda: monte_carlo("0.5", 0.1, 4),  # type: ignore[arg-type]
        lambda: simulate_report(0.5, 0.1, k=100),
    ],
)
def test_invalid_inputs_raise(call) -> None:
    with pytest.raises(UnderstudyError) as info:
        call()
    assert "\n" not in str(info.value)


# --- report and CLI --------------------------------------------------------------------------

REQUIRED_KEYS = {
    "alpha",
    "c",
    "k",
    "expected_tokens_per_round",
    "speedup",
    "optimal_k",
    "optimal_speedup",
    "monte_carlo",
    "speedup_by_k",
}


def test_simulate_report_defaults_to_optimal_k() -> None:
    report = simulate_report(0.8, 0.1, rounds=2000, spread=0.0, seed=0)
    assert REQUIRED_KEYS <= report.keys()
    assert report["k"] == report["optimal_k"] == 6
    assert report["speedup"] == pytest.approx(report["optimal_speedup"])
    assert len(report["speedup_by_k"]) == 64


def test_simulate_report_given_k() -> None:
    report = simulate_report(0.8, 0.1, 4, rounds=2000, spread=0.1, seed=0)
    assert report["k"] == 4
    assert report["expected_tokens_per_round"] == pytest.approx(3.3616)
    assert report["speedup"] == pytest.approx(3.3616 / 1.4)
    assert report["optimal_k"] == 6


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("simulate")(simulate)

    @app.command("noop")  # a second command, so "simulate" must be named as in the real CLI
    def noop() -> None:
        pass

    return app


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by default


def test_cli_json_keys() -> None:
    result = _runner().invoke(
        _app(), ["simulate", "--alpha", "0.8", "--c", "0.1", "--rounds", "2000", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert REQUIRED_KEYS <= data.keys()
    assert isinstance(data["optimal_k"], int) and data["optimal_k"] == 6
    assert {"tokens_per_round", "stderr", "speedup"} <= data["monte_carlo"].keys()
    assert len(data["speedup_by_k"]) == 64


def test_cli_short_k_and_table() -> None:
    result = _runner().invoke(_app(), ["simulate", "--alpha", "0.8", "--c", "0.1", "-k", "4"])
    assert result.exit_code == 0, result.output
    assert "3.3616" in result.stdout  # analytic tokens per round at K = 4
    assert "speedup vs K=1..16" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--alpha", "1.5", "--c", "0.1"],
        ["--alpha", "0.8", "--c", "-1"],
        ["--alpha", "0.8", "--c", "0.1", "-k", "0"],
        ["--alpha", "0.8", "--c", "0.1", "--rounds", "0"],
        ["--alpha", "0.8"],  # no c, and nothing to measure it
        ["--alpha", "0.8", "--c", "0.1", "--row-cost", "-1"],
        ["--alpha", "0.8", "--c", "0.1", "--pass-curve", "1,x"],
        ["--alpha", "0.8", "--c", "0.1", "--pass-curve", "2,3"],
        ["--alpha", "0.8", "--c", "0.1", "--pass-curve", "1,1.3,1.2"],
        ["--alpha", "0.8", "--c", "0.1", "--row-cost", "0.1", "--pass-curve", "1,2"],
        ["--alpha", "0.8", "--row-cost", "0.1", "--measure"],  # refused before any measuring
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args: list[str]) -> None:
    result = _runner().invoke(_app(), ["simulate", *args])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def _json(*args: str) -> dict:
    result = _runner().invoke(_app(), ["simulate", *args, "--rounds", "2000", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cli_without_a_row_cost_says_rows_are_free() -> None:
    data = _json("--alpha", "0.8", "--c", "0.1", "-k", "4")
    assert data["pass_cost"] == {
        "row_cost": 0.0,
        "pass_curve": [],
        "flat": True,
        "model": "T(n) = 1, rows are free (v = 0: Leviathan et al.)",
        "source": "none given: v = 0",
    }
    assert data["speedup"] == data["leviathan_speedup"] == pytest.approx(3.3616 / 1.4)
    text = _runner().invoke(_app(), ["simulate", "--alpha", "0.8", "--c", "0.1"]).stdout
    assert "rows are free" in text and "none given: v = 0" in text


def test_cli_row_cost() -> None:
    data = _json("--alpha", "0.8", "--c", "0.1", "-k", "4", "--row-cost", "0.1")
    assert data["pass_cost"]["source"] == "--row-cost" and data["pass_cost"]["row_cost"] == 0.1
    assert data["round_cost"] == pytest.approx(1.8)  # 4 * 0.1 + 1 + 4 * 0.1
    assert data["speedup"] == pytest.approx(3.3616 / 1.8)
    assert data["leviathan_speedup"] == pytest.approx(3.3616 / 1.4)
    args = ["simulate", "--alpha", "0.8", "--c", "0.1", "--row-cost", "0.1"]
    text = _runner().invoke(_app(), args).stdout
    assert "T(n) = 1 + (n − 1)·0.1" in text and "speedup if rows were free" in text


def test_cli_says_when_no_k_pays() -> None:
    # a = 0.5, c = 0.5, v = 0.3: K = 1 gives 1.5 / (0.5 + 1.3) = 0.83, longer rounds less
    args = ["simulate", "--alpha", "0.5", "--c", "0.5", "--row-cost", "0.3"]
    assert "no K pays at these costs" in _runner().invoke(_app(), args).stdout
    args = ["simulate", "--alpha", "0.5", "--c", "0.5"]  # 1.5 / 1.5 = 1.0 without the rows
    assert "no K pays" not in _runner().invoke(_app(), args).stdout


def test_cli_pass_curve_moves_the_optimal_k() -> None:
    curve = "1,1,1,1,2,2,2,2"  # the stepped curve above: K = 3 beats the flat theory's K = 13
    data = _json("--alpha", "0.9", "--c", "0.05", "--pass-curve", curve)
    assert data["pass_cost"]["source"] == "--pass-curve"
    assert data["pass_cost"]["pass_curve"] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert data["pass_cost"]["row_cost"] == pytest.approx(1 / 7)
    assert (data["k"], data["optimal_k"], data["leviathan_optimal_k"]) == (3, 3, 13)
    assert data["optimal_speedup"] == pytest.approx(3.439 / 1.15)


def test_module_json_stdout_is_exactly_one_object() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "understudy.cli.simulate", "--alpha", "0.8", "--c", "0.1", "--json"],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(proc.stdout)
    assert proc.stdout[end:].strip() == ""  # nothing after the one object
    assert isinstance(data, dict) and data["optimal_k"] == 6


def test_module_bad_input_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "understudy.cli.simulate", "--alpha", "2", "--c", "0.1"],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_importing_theory_and_cli_does_not_import_torch() -> None:
    code = (
        "import sys, understudy.policy.theory, understudy.cli.simulate; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_sparkline() -> None:
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"  # (2-1)/(3-1)*7 = 3.5 rounds to 4 -> "▅"
    assert sparkline([2.0, 2.0]) == "▅▅"  # flat curve: middle block


# --- `make demo`: the bound for this machine --------------------------------------------------


def test_the_demo_sets_the_prediction_beside_the_measurement() -> None:
    from understudy.demo import machine_bound
    from understudy.engine.outputs import RoundEvent
    from understudy.policy.costs import Costs, PassCurve

    def kept_rounds(n: int, k: int, free: bool = False) -> list[RoundEvent]:
        """n rounds of k guesses each, every guess kept."""
        return [RoundEvent(i, [7] * k, k, 7, "bonus", free=free) for i in range(n)]

    def plain_rounds(n: int) -> list[RoundEvent]:
        return [RoundEvent(i, [], 0, 7, "target") for i in range(n)]

    curve = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)
    measured = PassCurve(tuple(range(1, len(curve) + 1)), curve)
    costs = Costs(draft_step=0.25, row=0.1, pass_curve=measured)
    # every guess kept (a = 1), 50 guesses over 10 rounds, all drafting: K = 5, E = 6 tokens;
    # a round costs 5 * 0.25 + T(6) = 1.25 + 1.5 = 2.75 -> 6 / 2.75 = 2.18x, and
    # 6 / (1.25 + 1) = 2.67x if the 6-row pass cost one one-row pass
    line = machine_bound(costs, kept_rounds(10, 5), 1.53)
    assert "c = 0.25" in line and "a pass of 6 rows 1.50" in line
    assert "acceptance 100% and K = 5 (the mean of the 10 of 10 rounds that drafted)" in line
    assert "2.18x[/bold] predicted, 1.53x measured (2.67x if rows were free)" in line
    padded = machine_bound(Costs(draft_step=0.25), kept_rounds(10, 5), 1.53)
    assert "padded passes" in padded and "2.67x[/bold] predicted" in padded
    # 3 of 10 rounds drafted 2 guesses each, all kept; 7 rounds of plain decoding:
    # tokens 7 + 3 * 3 = 16, passes 7 + 3 * (2 * 0.25 + T(3) = 1.7) = 12.1 -> 1.32x;
    # with free rows 7 + 3 * 1.5 = 11.5 -> 1.39x
    line = machine_bound(costs, kept_rounds(3, 2) + plain_rounds(7), 1.2)
    assert (
        "K = 2 (the mean of the 3 of 10 rounds that drafted, 1 token a pass in the other 7)" in line
    )
    assert "1.32x[/bold] predicted, 1.20x measured (1.39x if rows were free)" in line
    # free guesses cost no draft step: 3 drafted rounds as above (9 tokens, 5.1 passes) and 2
    # rounds of 4 free guesses, all kept (10 tokens, 2 * T(5) = 2.8 passes) -> 19 / 7.9 = 2.41x;
    # rows free: 19 / (3 * 1.5 + 2) = 2.92x
    line = machine_bound(costs, kept_rounds(3, 2) + kept_rounds(2, 4, free=True), 1.9)
    assert "2 rounds of free guesses (c = 0) at 100%, K = 4" in line
    assert "2.41x[/bold] predicted, 1.90x measured (2.92x if rows were free)" in line
    assert "drafted nothing" in machine_bound(costs, plain_rounds(10), 1.0)

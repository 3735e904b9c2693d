"""The `understudy` command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import pytest


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "understudy.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_generate_json_plain_and_speculative_agree(tiny_pair):
    target, draft = tiny_pair
    common = [
        "generate",
        "def add(a, b):",
        "--target",
        target,
        "--dtype",
        "float32",
        "--json",
        "--max-tokens",
        "12",
    ]
    fast = cli(*common, "--draft", draft, "-k", "2")
    slow = cli(*common, "--method", "none")
    assert fast.returncode == 0, fast.stderr
    a, b = json.loads(fast.stdout), json.loads(slow.stdout)
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    for key in (
        "method",
        "k",
        "tokens",
        "target_passes",
        "tokens_per_pass",
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "prefill_s",
        "decode_s",
        "wall_s",
        "tokens_per_s",
        "decode_tokens_per_s",
    ):
        assert key in a["stats"]
    assert b["stats"]["tokens_per_pass"] == 1.0


def test_generate_streams_with_summary(tiny_pair):
    target, draft = tiny_pair
    run = cli(
        "generate",
        "for i in",
        "--target",
        target,
        "--draft",
        draft,
        "--dtype",
        "float32",
        "--max-tokens",
        "8",
    )
    assert run.returncode == 0, run.stderr
    assert "tokens/pass" in run.stderr and "target passes" in run.stderr


def test_drafter_options_pass_through(tiny_pair):
    target, _ = tiny_pair
    ok = cli(
        "generate",
        "a b a b a b",
        "--target",
        target,
        "--method",
        "ngram",
        "--dtype",
        "float32",
        "--option",
        "prompt_lookup_max=3",
        "--json",
        "--max-tokens",
        "6",
    )
    assert ok.returncode == 0, ok.stderr
    bad = cli(
        "generate",
        "a b",
        "--target",
        target,
        "--method",
        "ngram",
        "--dtype",
        "float32",
        "--option",
        "no_such_option=1",
        "--json",
        "--max-tokens",
        "6",
    )
    assert bad.returncode == 2
    assert "no_such_option" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["-k", "0"], "num_speculative_tokens"),
        (["--method", "telepathy"], "Invalid value for '--method'"),
        (["--dtype", "float8"], "Invalid value for '--dtype'"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--target", "no-such-model"], "no-such-model"),
    ],
)
def test_bad_input_is_one_clear_line(args, message):
    run = cli("generate", "hello", *args, timeout=120)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""


def test_serve_refuses_a_mode_it_does_not_have_before_loading_anything():
    run = cli("serve", "--log-level", "loud", timeout=120)
    assert run.returncode == 2
    assert "Invalid value for '--log-level'" in run.stderr and "Traceback" not in run.stderr


def test_the_typed_choices_are_the_ones_their_owners_take():
    """config's Literal types list exactly the values the engine, the loader and the drafters
    validate against: the CLI's choices neither refuse a valid value nor pass a wrong one."""
    from understudy.config import BuiltMethod, DType, Method, Quantization, TreeMode
    from understudy.drafters.calibration import TREE_MODES
    from understudy.engine.builder import METHODS
    from understudy.models.loader import DTYPES, QUANTIZATIONS

    assert sorted(get_args(Method)) == sorted(("auto", *METHODS))  # auto: resolved at build
    assert sorted(get_args(BuiltMethod)) == sorted(METHODS)
    assert sorted(get_args(DType)) == sorted(("auto", *DTYPES))
    assert sorted(get_args(Quantization)) == sorted(QUANTIZATIONS)
    assert sorted(get_args(TreeMode)) == sorted(TREE_MODES)


def test_subcommands_have_help():
    for sub in ("generate", "simulate", "serve", "bench"):
        run = cli(sub, "--help", timeout=120)
        assert run.returncode == 0, (sub, run.stderr)


def test_simulate_help_says_measure_is_slow():
    run = cli("simulate", "--help", timeout=120)
    assert run.returncode == 0, run.stderr
    for option in ("--row-cost", "--pass-curve", "--measure", "SLOW"):
        assert option in run.stdout


@pytest.mark.e2e
def test_simulate_measure_reads_the_default_engines_costs():
    """--measure builds the default engine and predicts with the costs it measured: its c and
    its pass curve (flat where its passes are padded to one shape)."""
    run = cli("simulate", "--alpha", "0.95", "-k", "4", "--measure", "--json", timeout=1200)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)  # the engine's loading wrote nothing else to stdout
    passes = data["pass_cost"]
    assert passes["source"] == "measured on the default engine"
    assert 0.0 < data["c"] <= 1.0
    curve = passes["pass_curve"]
    assert curve == [] or (curve[0] == 1.0 and curve == sorted(curve))
    t5 = curve[4] if len(curve) >= 5 else 1.0 + 4 * passes["row_cost"]  # a pass of K + 1 rows
    e = (1 - 0.95**5) / 0.05
    assert data["round_cost"] == pytest.approx(4 * data["c"] + t5)
    assert data["speedup"] == pytest.approx(e / (4 * data["c"] + t5))

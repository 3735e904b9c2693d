"""The soak run's machinery (`understudy bench --soak`, bench/soak.py), not a soak: the same
code for seconds, 4 clients, against a real `understudy serve` process on the tiny models.

The run must hold every invariant and have exercised every kind of request; then each
invariant is shown to have power: the run's own record, broken in one place (a 5xx in the
tallies, a greedy answer that is not its solo answer, memory that grew, a seat left
running, ...), must fail that invariant and the run. The 10-minute soak on the real models
is a benchmark (docs/benchmarks.md), not a test.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from understudy.bench.prompts import load_prompts
from understudy.bench.soak_checks import CHECKS, Tally, judge
from understudy.bench.soak_client import Outcome, satisfies
from understudy.bench.soak_mix import Call, Plan, bad_calls, draw, scenarios
from understudy.cli.bench import bench

PROMPTS = [
    {"id": "c1", "category": "completion", "prompt": "def add(a, b):"},
    {"id": "c2", "category": "completion", "prompt": "class Stack:\n    def push(self, x):"},
    {"id": "h1", "category": "chat", "messages": [{"role": "user", "content": "for i in"}]},
    {"id": "h2", "category": "chat", "messages": [{"role": "user", "content": "Why a fox?"}]},
]
WELL_FORMED = {f"{route}{delivery}" for route in ("completions", "chat")
               for delivery in ("", " stream", " cancel")}  # fmt: skip
SERVER_ERROR = "no server error (5xx, error event, dropped connection)"
STATUSES = "every request got the status it must"
ANSWERS = "every answer as asked"
GREEDY = "greedy answers equal their solo answers"
MEMORY = "resident memory flat"
SEATS = "no seat or queue slot leaked"
SERVER = "the server's log clean, its exit status 0"


def app() -> typer.Typer:
    a = typer.Typer()
    a.command()(bench)
    return a


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("soak-prompts") / "four.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def soaked(tiny_pair, prompt_file, tmp_path_factory) -> dict[str, Any]:
    """`understudy bench --soak` for 15 s with 4 clients on the tiny pair: its soak.json."""
    target, draft = tiny_pair
    out = tmp_path_factory.mktemp("soak")
    args = ["--soak", "--clients", "4", "--duration", "15s", "--prompts", str(prompt_file),
            "--target", target, "--draft", draft, "--dtype", "float32", "--max-tokens", "16",
            "--max-context", "512", "--seed", "3", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app(), args)
    assert result.exit_code == 0, result.output + (out / "soak-server.log").read_text()
    return json.loads((out / "soak.json").read_text())


def test_a_short_soak_holds_every_invariant_and_covers_the_mix(soaked):
    assert soaked["ok"] is True
    assert set(soaked["invariants"]) == set(CHECKS)
    assert all(v["ok"] for v in soaked["invariants"].values()), soaked["invariants"]
    kinds = set(soaked["requests"])
    well_formed = kinds & WELL_FORMED  # a loaded machine sends fewer: every route and delivery
    assert {k.split()[0] for k in well_formed} == {"completions", "chat"}, kinds
    deliveries = {(k.split() + ["whole"])[1] for k in well_formed}
    assert deliveries == {"whole", "stream", "cancel"}, kinds
    assert len([k for k in kinds if k.startswith("bad: ")]) >= 5
    for feature in ("greedy", "sampled", "n>1", "logprobs", "json", "regex", "penalties"):
        assert soaked["features"].get(feature, 0) > 0, feature
    compared = sum(n for g in soaked["greedy"].values() for *_, n in g["answers"])
    assert compared > 0 and all(g["solo"] is not None for g in soaked["greedy"].values())
    drain = soaked["drain"]
    assert drain["burst"]["started"] == drain["burst"]["seats"] == 8  # the tiny pair: auto = 8
    assert soaked["memory"]["start"] > 0 and soaked["throughput"]["tokens"] > 0


def first_answered(results: dict[str, Any]) -> list:
    """The first greedy scenario's first recorded answer [text, finish, count]."""
    return next(g["answers"][0] for g in results["greedy"].values() if g["answers"])


def set_in(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(results: dict[str, Any]) -> None:
        node = results
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return apply


BREAKS: dict[str, tuple[Callable[[dict[str, Any]], None], set[str]]] = {
    "a 500": (lambda r: r["requests"]["chat"].update({"500": 1}), {SERVER_ERROR, STATUSES}),
    "an error event in a stream": (
        lambda r: r["requests"]["completions stream"].update({"stream error": 1}),
        {SERVER_ERROR, STATUSES},
    ),
    "a malformed request accepted": (
        lambda r: r["requests"].update({"bad: n = 0": {"200": 1}}), {STATUSES}
    ),
    "an answer not as asked": (
        lambda r: r.update(problem_count=1, problems=[{"problem": "2 choices asked, 1 came"}]),
        {ANSWERS},
    ),
    "a greedy answer changed": (
        lambda r: first_answered(r).__setitem__(0, first_answered(r)[0] + "x"), {GREEDY}
    ),
    "a greedy answer ended otherwise": (
        lambda r: first_answered(r).__setitem__(1, "other"), {GREEDY}
    ),
    "a cancelled greedy stream that is no prefix": (
        lambda r: next(iter(r["greedy"].values()))["cancelled"].append(["\x00", 1]), {GREEDY}
    ),
    "memory grown": (
        lambda r: r["memory"].update(end=int(r["memory"]["warm"] * 1.2)), {MEMORY}
    ),
    "a sequence still running": (set_in(("drain", "after_clients", "running"), 1), {SEATS}),
    "a slot still waiting": (set_in(("drain", "after_burst", "waiting"), 1), {SEATS}),
    "a seat that took no sequence": (set_in(("drain", "burst", "started"), 7), {SEATS}),
    "a traceback in the log": (set_in(("server", "tracebacks"), 1), {SERVER}),
    "a bad exit status": (set_in(("server", "exit_status"), 1), {SERVER}),
}  # fmt: skip


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_record_fails_its_invariant_and_the_run(soaked, name):
    """Mutation: the run's record with one fault must fail exactly the invariants that fault
    breaks, and the run."""
    results = copy.deepcopy(soaked)
    assert judge(results) is True  # the record as it came: every invariant holds
    breaking, expected = BREAKS[name]
    breaking(results)
    assert judge(results) is False
    failed = {n for n, v in results["invariants"].items() if not v["ok"]}
    assert failed == expected, results["invariants"]


def tiny_plan() -> Plan:
    prompts = load_prompts(["chat"], 2)
    return Plan("m", prompts, 8, scenarios(prompts, "m", 8, seed=0), bad_calls("m", 64, 32))


def greedy_call(plan: Plan) -> Call:
    s = plan.scenarios[0]
    return Call(s.route, s.kwargs, "whole", 0, s.key, s.constraint, ("greedy",))


@pytest.mark.parametrize("answer, holds", [("abc", True), ("abd", False)])
def test_the_tally_compares_greedy_answers_with_their_solo_answer(soaked, answer, holds):
    """Through the recorder: an answer equal to the solo answer holds, another fails."""
    plan = tiny_plan()
    tally = Tally(plan)
    for scenario in plan.scenarios:
        tally.solo(scenario, Outcome("200", 0.1, answers=[("abc", "length")]))
    tally.record(greedy_call(plan), Outcome("200", 0.1, answers=[(answer, "length")] * 2))
    results = {**copy.deepcopy(soaked), **tally.snapshot()}
    assert judge(results) is holds
    assert results["invariants"][GREEDY]["ok"] is holds


def test_a_5xx_recorded_by_the_tally_fails_the_run(soaked):
    plan = tiny_plan()
    tally = Tally(plan)
    for scenario in plan.scenarios:
        tally.solo(scenario, Outcome("200", 0.1, answers=[("abc", "length")]))
    tally.record(greedy_call(plan), Outcome("200", 0.1, answers=[("abc", "length")]))
    results = {**copy.deepcopy(soaked), **tally.snapshot()}
    assert judge(results) is True
    tally.record(greedy_call(plan), Outcome("503", 0.1, detail="overloaded"))
    results = {**copy.deepcopy(soaked), **tally.snapshot()}
    assert judge(results) is False and not results["invariants"][SERVER_ERROR]["ok"]
    assert results["unexpected"][0]["status"] == "503"


def test_the_mix_is_seeded_and_reaches_every_kind():
    plan = tiny_plan()
    rng_a, rng_b = random.Random(7), random.Random(7)
    drawn = [draw(rng_a, plan) for _ in range(3000)]
    assert drawn == [draw(rng_b, plan) for _ in range(3000)]
    assert drawn != [draw(random.Random(8), plan) for _ in range(3000)]
    kinds = {request.kind for request in drawn}
    assert WELL_FORMED | {bad.kind for bad in plan.bad} == kinds


@pytest.mark.parametrize(
    "constraint, text, ok",
    [
        ("regex", "123-ab", True), ("regex", "123-abc", False), ("regex", "12-ab", False),
        ("json", '{"color":"red","ok":true,"n":7}', True),
        ("json", '{"color":"pink","ok":true,"n":7}', False),
        ("json", '{"color":"red","ok":1,"n":7}', False),
        ("json", '{"color":"red","ok":true,"n":100}', False),
        ("json", '{"color":"red","ok":true}', False), ("json", '{"color":"red",', False),
    ],
)  # fmt: skip
def test_constrained_answers_are_checked_against_their_constraint(constraint, text, ok):
    assert satisfies(constraint, text) is ok


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--soak", "--concurrency", "2"), "does not take --concurrency"),
        (("--soak", "--temperature", "0.5"), "does not take --temperature"),
        (("--soak", "--methods", "none,draft"), "takes one method"),
        (("--soak", "--duration", "5 minutes"), "--duration takes seconds"),
        (("--soak", "--clients", "0"), "--clients must be >= 1"),
        (("--clients", "4"), "belong to the soak run"),
    ],
)
def test_the_soak_run_refuses_what_it_cannot_do(tmp_path, extra, message):
    result = CliRunner().invoke(app(), [*extra, "--out", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output, result.output

"""The soak run's record and its invariants.

`Tally` records every outcome as the clients report them (thread-safe): requests by kind
and status, what they exercised, latencies, tokens, the answers that were not as asked, and
every answer of every greedy scenario. `judge(results)` judges a finished run from its
JSON alone (so a saved soak.json can be judged again, and a test can break one record and
see the verdict fail):

- no server error: no 5xx, no error event inside a 200 stream, no dropped connection;
- every request got the status it must: 200 for a well-formed one, its 4xx for a malformed
  one;
- every answer as asked: n choices, a finish reason each, logprobs where asked and only
  there, constrained answers within their constraint, refusals naming the problem;
- every greedy answer is its scenario's solo answer (text and finish reason), and every
  cancelled greedy stream's text a prefix of it: the batch never changes a greedy answer;
- resident memory flat: at the end at most RSS_GROWTH above its level after the warm-up;
- no seat or queue slot leaked: nothing running or waiting once the clients stopped, and
  then every seat took a sequence at once (and freed it);
- the server's log holds no traceback, and SIGTERM ended it with status 0.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from understudy.bench.soak_client import SERVER_ERRORS, Outcome
from understudy.bench.soak_mix import BadCall, Call, Plan, Scenario

RSS_GROWTH = 0.05  # resident memory may end this fraction above its level after the warm-up
KEPT = 50  # examples of each kind of failure kept in the JSON


class Tally:
    """Every outcome of a run, as the JSON the report and the invariants read."""

    def __init__(self, plan: Plan) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, Counter[str]] = {}
        self.expected = {bad.kind: str(bad.status) for bad in plan.bad}
        self.features: Counter[str] = Counter()
        self.latencies: list[float] = []  # well-formed, answered whole or streamed to the end
        self.ttfts: list[float] = []
        self.bad_latencies: list[float] = []
        self.tokens = 0
        self.problems: list[dict[str, Any]] = []
        self.problem_count = 0
        self.unexpected: list[dict[str, Any]] = []  # requests that got another status
        self.greedy: dict[str, dict[str, Any]] = {
            s.key: {"request": s.kwargs, "solo": None, "answers": Counter(), "cancelled": Counter()}
            for s in plan.scenarios
        }

    def solo(self, scenario: Scenario, outcome: Outcome) -> None:
        """A scenario's answer alone (no other request in flight): the reference."""
        entry = self.greedy[scenario.key]
        if outcome.status == "200" and outcome.problem is None:
            entry["solo"] = list(outcome.answers[0])
        else:
            entry["solo_failed"] = {"status": outcome.status, "detail": outcome.detail,
                                    "problem": outcome.problem}  # fmt: skip

    def record(self, request: Call | BadCall, outcome: Outcome) -> None:
        with self._lock:
            self.requests.setdefault(request.kind, Counter())[outcome.status] += 1
            expected = self.expected.get(request.kind, "200")
            body = request.kwargs if isinstance(request, Call) else request.content[:300].decode()
            if outcome.status != expected and len(self.unexpected) < KEPT:
                self.unexpected.append({"kind": request.kind, "status": outcome.status,
                                        "request": body, "response": outcome.detail})  # fmt: skip
            if outcome.problem is not None:
                self.problem_count += 1
                if len(self.problems) < KEPT:
                    self.problems.append({"kind": request.kind, "problem": outcome.problem,
                                          "request": body})  # fmt: skip
            if isinstance(request, BadCall):
                self.bad_latencies.append(outcome.latency_s)
                return
            self.features.update(request.features)
            if outcome.status != "200":
                return
            if not outcome.cancelled:
                self.latencies.append(outcome.latency_s)
                self.tokens += outcome.tokens
            if outcome.ttft_s is not None:
                self.ttfts.append(outcome.ttft_s)
            if request.greedy is not None:
                self.record_greedy(request.greedy, outcome)

    def record_greedy(self, key: str, outcome: Outcome) -> None:
        entry = self.greedy[key]
        for text, finish in outcome.answers:
            if outcome.cancelled and finish is None:
                entry["cancelled"][text] += 1
            else:
                entry["answers"][(text, finish)] += 1

    def snapshot(self) -> dict[str, Any]:
        """The record as JSON-ready data."""
        with self._lock:
            greedy = {
                key: {
                    **{k: v for k, v in entry.items() if k not in ("answers", "cancelled")},
                    "answers": [[t, f, n] for (t, f), n in entry["answers"].items()],
                    "cancelled": [[t, n] for t, n in entry["cancelled"].items()],
                }
                for key, entry in self.greedy.items()
            }
            return {
                "requests": {kind: dict(statuses) for kind, statuses in self.requests.items()},
                "expected": self.expected,
                "features": dict(self.features),
                "problems": list(self.problems),
                "problem_count": self.problem_count,
                "unexpected": list(self.unexpected),
                "greedy": greedy,
                "tokens": self.tokens,
            }


def is_server_error(status: str) -> bool:
    return status in SERVER_ERRORS or (status.isdigit() and int(status) >= 500)


def check_server_errors(results: dict[str, Any]) -> tuple[bool, str]:
    found = {f"{kind} {status}": n for kind, statuses in results["requests"].items()
             for status, n in statuses.items() if is_server_error(status)}  # fmt: skip
    return not found, ", ".join(f"{k}: {n}" for k, n in found.items()) or "none"


def check_statuses(results: dict[str, Any]) -> tuple[bool, str]:
    expected = results["expected"]
    wrong = {f"{kind} {status} (not {expected.get(kind, '200')})": n
             for kind, statuses in results["requests"].items()
             for status, n in statuses.items() if status != expected.get(kind, "200")}  # fmt: skip
    total = sum(sum(s.values()) for s in results["requests"].values())
    detail = ", ".join(f"{k}: {n}" for k, n in wrong.items()) or f"all {total}"
    return not wrong and total > 0, detail


def check_answers(results: dict[str, Any]) -> tuple[bool, str]:
    count = results["problem_count"]
    first = results["problems"][0]["problem"] if results["problems"] else ""
    return count == 0, f"{count} not as asked" + (f", e.g. {first}" if first else "")


def check_greedy(results: dict[str, Any]) -> tuple[bool, str]:
    """Every greedy answer equals its scenario's solo answer; a cancelled one is a prefix."""
    compared, wrong = 0, []
    for key, entry in results["greedy"].items():
        solo = entry["solo"]
        if solo is None:
            wrong.append(f"{key}: no solo answer")
            continue
        for text, finish, n in entry["answers"]:
            compared += n
            if [text, finish] != solo:
                wrong.append(f"{key}: {n}x {text!r} ({finish}), alone {solo[0]!r} ({solo[1]})")
        for text, n in entry["cancelled"]:
            compared += n
            if not solo[0].startswith(text):
                wrong.append(f"{key}: {n}x cancelled {text!r}, not a prefix of {solo[0]!r}")
    ok = not wrong and compared > 0
    return ok, "; ".join(wrong[:5]) or f"{compared} answers of {len(results['greedy'])} requests"


def check_memory(results: dict[str, Any]) -> tuple[bool, str]:
    memory = results["memory"]
    mib = {k: memory[k] / 2**20 for k in ("start", "warm", "end", "peak")}
    limit = memory["warm"] * (1 + RSS_GROWTH)
    detail = ("RSS start {start:.0f} MiB, after warm-up {warm:.0f}, end {end:.0f}, "
              "peak {peak:.0f}").format(**mib)  # fmt: skip
    return memory["end"] <= limit, detail + f" (limit {limit / 2**20:.0f})"


def check_seats(results: dict[str, Any]) -> tuple[bool, str]:
    drain = results["drain"]
    idle = [drain[k]["running"] == 0 and drain[k]["waiting"] == 0
            for k in ("after_clients", "after_burst")]  # fmt: skip
    burst = drain["burst"]
    all_seats = burst["started"] == burst["seats"] and not burst["finished_early"]
    detail = (
        f"after the clients running {drain['after_clients']['running']}, waiting "
        f"{drain['after_clients']['waiting']}; {burst['started']}/{burst['seats']} seats took a "
        f"sequence at once; then running {drain['after_burst']['running']}, waiting "
        f"{drain['after_burst']['waiting']}"
    )
    return all(idle) and all_seats, detail


def check_server(results: dict[str, Any]) -> tuple[bool, str]:
    server = results["server"]
    ok = server["tracebacks"] == 0 and server["exit_status"] == 0
    return ok, f"{server['tracebacks']} tracebacks in its log, exit status {server['exit_status']}"


CHECKS = {
    "no server error (5xx, error event, dropped connection)": check_server_errors,
    "every request got the status it must": check_statuses,
    "every answer as asked": check_answers,
    "greedy answers equal their solo answers": check_greedy,
    "resident memory flat": check_memory,
    "no seat or queue slot leaked": check_seats,
    "the server's log clean, its exit status 0": check_server,
}


def judge(results: dict[str, Any]) -> bool:
    """Judge a finished run: sets results["invariants"] ({name: {"ok", "detail"}}) and
    results["ok"] (every invariant held), and returns the latter."""
    results["invariants"] = {}
    for name, check in CHECKS.items():
        ok, detail = check(results)
        results["invariants"][name] = {"ok": ok, "detail": detail}
    results["ok"] = all(v["ok"] for v in results["invariants"].values())
    return results["ok"]

"""`understudy serve --replicas 2`: the same API on two engine replicas run by Ray Serve.

One real server process for the module (it starts its own Ray instance on loopback, with
the tiny models of conftest.py); the tests run in file order: answers under concurrency,
/health and /metrics, a replica killed under load, and last SIGTERM, which must stop every
process of that Ray instance. They skip, saying why, only where Ray cannot start here.
The first three tests need no Ray: the pieces the server is built from, on their own.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess
from understudy.config import UnderstudyError
from understudy.server.metrics import Metrics
from understudy.server.replica_metrics import merged_exposition
from understudy.server.replicas import ScaleOptions

K = "2"  # as in test_server.py: fp32 CPU target passes of 3 rows keep greedy output exact
PROMPTS = [
    "def add(a, b):",
    "for i in range(10):",
    "The quick brown fox",
    "class Stack:",
    "print(",
    "def push(self, x):",
]
REPLICA_HEADER = "x-understudy-replica"
REPLICA_TITLE = "ray::ServeReplica:understudy:engine"  # the process title Ray gives a replica
WAIT_S = 240  # a bound on every wait below, so nothing here can hang


# --- without Ray -------------------------------------------------------------------------


def test_scale_options_refuse_impossible_counts():
    assert ScaleOptions(2).count_options() == {"num_replicas": 2}
    auto = ScaleOptions(2, min_replicas=1, max_replicas=4).count_options()
    assert auto["autoscaling_config"]["min_replicas"] == 1
    assert auto["autoscaling_config"]["initial_replicas"] == 2
    assert auto["autoscaling_config"]["max_replicas"] == 4
    for bad, named in (
        (ScaleOptions(0), "--replicas"),
        (ScaleOptions(2, min_replicas=3), "--min-replicas"),
        (ScaleOptions(2, max_replicas=1), "--max-replicas"),
        (ScaleOptions(2, min_replicas=0), "--min-replicas"),
        (ScaleOptions(2, replica_cpus=0.0), "--replica-cpus"),
    ):
        with pytest.raises(UnderstudyError, match=named):
            bad.check()


def test_merged_metrics_label_every_replica():
    a, b = Metrics("m", "draft"), Metrics("m", "draft")
    for _ in range(2):
        a.request("/health", 200)
    for _ in range(3):
        b.request("/health", 200)
    text = merged_exposition({"ra": a.render(0, 0), "rb": b.render(1, 2)}, 2, 5).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["understudy:replicas"].samples[0].value == 2
    assert families["understudy:requests_unavailable"].samples[0].value == 5
    requests = {
        s.labels["replica"]: s.value
        for s in families["understudy:http_requests"].samples
        if s.name.endswith("_total")
    }
    assert requests == {"ra": 2, "rb": 3}
    running = {
        s.labels["replica"]: s.value for s in families["understudy:num_requests_running"].samples
    }
    assert running == {"ra": 0, "rb": 1}
    assert text.count("# TYPE understudy:http_requests_total ") == 1  # one family, both replicas


def test_cli_refuses_ray_flags_without_replicas(tmp_path):
    with pytest.raises(RuntimeError, match="need --replicas"):
        ServerProcess(["--min-replicas", "1"], tmp_path / "serve.log", startup_s=60)


# --- one server on two replicas ------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tiny_pair, tmp_path_factory):
    pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'understudy[ray]'")
    target, draft = tiny_pair
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    args = ["--target", target, "--draft", draft, "--dtype", "float32", "-k", K,
            "--replicas", "2", "--log-level", "warning"]  # fmt: skip
    try:
        proc = ServerProcess(args, log, startup_s=WAIT_S)
    except RuntimeError as error:
        if "Ray could not start" in str(error):
            pytest.skip(f"Ray cannot start here: {str(error).splitlines()[-1]}")
        raise
    proc.model = httpx.get(proc.url + "/v1/models").json()["data"][0]["id"]
    yield proc
    proc.stop(120)


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def requests_for(model: str, max_tokens: int) -> list[dict]:
    """Each prompt twice: greedy, and sampled with a seed (both must repeat exactly)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        common = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        out.append({**common, "temperature": 0.0})
        out.append({**common, "temperature": 1.0, "seed": 100 + i})
    return out


def complete(client, request: dict) -> tuple[str, str, int]:
    """(text, replica, completion tokens) of one completion through the official client."""
    raw = client.completions.with_raw_response.create(**request, extra_body={"ignore_eos": True})
    out = raw.parse()
    return out.choices[0].text, raw.headers[REPLICA_HEADER], out.usage.completion_tokens


def replica_processes(service) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(service.proc.pid).children(recursive=True):
        try:
            if proc.name().startswith(REPLICA_TITLE) or REPLICA_TITLE in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def health(service) -> dict:
    return httpx.get(service.url + "/health", timeout=60).json()


def test_health_counts_the_running_replicas(service):
    report = health(service)
    assert report["status"] == "ok"
    assert report["replicas"] == 2
    assert len(replica_processes(service)) == 2
    lab = httpx.get(service.url + "/lab", timeout=60)  # the Lab, through a replica
    assert lab.status_code == 200 and lab.headers["content-type"].startswith("text/html")
    wrong = httpx.post(service.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert wrong.status_code == 404  # a replica's own error, relayed unchanged
    assert wrong.json()["error"]["code"] == "model_not_found"


def test_concurrent_answers_equal_solo_answers(service, client):
    requests = requests_for(service.model, max_tokens=24)
    assert len(requests) == 12
    solo = [complete(client, r)[0] for r in requests]  # one at a time
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: complete(client, r), requests))
    assert [text for text, _, _ in together] == solo
    assert all(n == 24 for _, _, n in together)
    assert len({replica for _, replica, _ in together}) == 2  # both replicas served some
    sampled = solo[1::2]
    assert sampled != solo[0::2]  # the seeded requests really sampled


def generated_by_replica(service) -> dict[str, float]:
    text = httpx.get(service.url + "/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return {
        s.labels["replica"]: s.value
        for s in families["understudy:generation_tokens"].samples
        if s.name.endswith("_total")
    }


def test_metrics_count_every_replica(service, client):
    """A finished generation is on /metrics, under its replica, once its client has it."""
    before = generated_by_replica(service)
    served = [complete(client, r) for r in requests_for(service.model, max_tokens=8)[:4]]
    expected = dict(before)
    for _, replica, tokens in served:
        expected[replica] = expected.get(replica, 0) + tokens
    assert generated_by_replica(service) == expected
    assert len(expected) == 2


class Stream(threading.Thread):
    """One streaming completion read with httpx; records how it ended."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.text = ""
        self.events: list[dict | str] = []
        self.first_token = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                self.status, self.headers = response.status_code, dict(response.headers)
                if response.status_code != 200:
                    self.events.append(json.loads(response.read()))
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    event = data if data == "[DONE]" else json.loads(data)
                    self.events.append(event)
                    if isinstance(event, dict) and event.get("choices"):
                        self.text += event["choices"][0]["text"]
                        self.first_token.set()
        except BaseException as error:  # recorded, and asserted on by the test
            self.failure = error
        finally:
            self.first_token.set()


def test_a_killed_replica_fails_its_requests_retryably_and_comes_back(service, client):
    long = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True, "stream": True}
    bodies = [{"model": service.model, "prompt": p, **long} for p in PROMPTS[:4]] * 2
    solo = {p: complete(client, {"model": service.model, "prompt": p, "max_tokens": 400,
                                 "temperature": 0.0})[0] for p in PROMPTS[:4]}  # fmt: skip
    before = {p.pid for p in replica_processes(service)}
    assert len(before) == 2
    streams = [Stream(service.url + "/v1/completions", body) for body in bodies]
    for stream in streams:
        stream.start()
    deadline = time.monotonic() + WAIT_S
    while len({s.headers.get(REPLICA_HEADER) for s in streams if s.text} - {None}) < 2:
        assert time.monotonic() < deadline, "the streams did not reach both replicas"
        time.sleep(0.05)
    victim = replica_processes(service)[0]
    os.kill(victim.pid, signal.SIGKILL)
    for stream in streams:
        stream.join(WAIT_S)
        assert not stream.is_alive(), "a request hung after its replica died"
        assert stream.failure is None, stream.failure

    lost = 0
    for stream in streams:
        if stream.status == 503:  # queued on the dead replica: refused, retryable
            assert stream.headers["retry-after"] == "1"
            assert stream.events[0]["error"]["code"] == "replica_unavailable"
            lost += 1
            continue
        assert stream.status == 200
        assert stream.events[-1] == "[DONE]"
        last = stream.events[-2]
        if "error" in last:  # streaming on the dead replica: ended with a retryable error
            assert last["error"]["code"] == "replica_unavailable"
            assert solo[stream.body["prompt"]].startswith(stream.text)
            lost += 1
        else:
            assert stream.text == solo[stream.body["prompt"]]
    assert lost >= 1  # the killed replica had requests in flight

    # new requests go to the replica left (or its replacement): none is lost
    for prompt in PROMPTS[:4]:
        request = {"model": service.model, "prompt": prompt, "max_tokens": 400, "temperature": 0}
        assert complete(client, request)[0] == solo[prompt]
    deadline = time.monotonic() + WAIT_S
    while health(service)["replicas"] != 2 or len(replica_processes(service)) != 2:
        assert time.monotonic() < deadline, "Ray Serve did not replace the dead replica"
        time.sleep(0.5)
    after = {p.pid for p in replica_processes(service)}
    assert victim.pid not in after and len(after & before) == 1
    metrics = {f.name: f for f in text_string_to_metric_families(
        httpx.get(service.url + "/metrics", timeout=60).text)}  # fmt: skip
    assert metrics["understudy:requests_unavailable"].samples[0].value >= lost


def test_sigterm_drains_then_stops_every_ray_process(service, client):
    ray_procs = psutil.Process(service.proc.pid).children(recursive=True)
    names = {p.name() for p in ray_procs}
    assert {"raylet", "gcs_server"} <= names, names  # the check below has something to check
    session_dirs = {
        arg.split("=", 1)[1]
        for p in ray_procs
        if p.name() == "raylet"
        for arg in p.cmdline()
        if arg.startswith("--session_dir=")
    }
    assert session_dirs
    body = {"model": service.model, "prompt": PROMPTS[0], "max_tokens": 200,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    stream = Stream(service.url + "/v1/completions", body)
    stream.start()
    assert stream.first_token.wait(WAIT_S) and stream.text
    service.terminate()
    stream.join(WAIT_S)
    assert stream.failure is None and stream.events[-1] == "[DONE]"
    assert "error" not in stream.events[-2]  # it finished before the replicas stopped
    assert stream.events[-2]["choices"][0]["finish_reason"] == "length"
    assert service.proc.wait(WAIT_S) == 0, service.log()

    deadline = time.monotonic() + WAIT_S
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ray_procs):
        assert time.monotonic() < deadline, [p for p in ray_procs if p.is_running()]
        time.sleep(0.5)
    strays = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if any(session in cmdline for session in session_dirs):
            strays.append(proc)
    assert strays == []

"""The server batching requests: many clients at once on one engine's seats, each answer
exactly the answer a one-at-a-time plain server gives.

Real `understudy serve` processes on loopback (tiny models, float32: row-invariant passes):
the batched one (method draft, --max-num-seqs 4) takes every request at once from client
threads; the references take them one at a time: plain decoding (method none) for greedy
requests, and the batched server itself, alone, for seeded sampled ones (a seeded
speculative run draws its own random numbers: its law is the target's, tested in
test_batch.py, and batched it must be its solo run bit for bit; another process would
measure other costs at start and choose other round lengths, so other draws). Greedy,
sampled, penalised and constrained requests must match field for field; the shared passes
show in /metrics. The in-process tests watch what needs the engine held: a disconnected
stream frees its seat, a burst past the bound gets 429, a bad request or an engine fault in
the batch fails alone and gives its seat back, the Lab runs beside the batch.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, serve_in_thread
from understudy.engine import scheduler as scheduler_module
from understudy.engine.engine import Engine
from understudy.engine.seats import kv_bytes_per_seat
from understudy.server.app import create_app

SEATS = 4
PROMPTS = ["def add(a, b):", "class Stack:", "import os\n", "for i in range(", "x = [", "# a"]


def start(tiny_pair, tmp_path_factory, name: str, *args: str) -> ServerProcess:
    target, draft = tiny_pair
    log = tmp_path_factory.mktemp(name) / "server.log"
    common = ["--target", target, "--draft", draft, "--dtype", "float32", "--log-level", "warning"]
    proc = ServerProcess([*common, *args], log)
    proc.model = Path(target).name
    return proc


@pytest.fixture(scope="module")
def batched(tiny_pair, tmp_path_factory):
    proc = start(tiny_pair, tmp_path_factory, "batched", "--max-num-seqs", str(SEATS))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def plain(tiny_pair, tmp_path_factory):
    proc = start(tiny_pair, tmp_path_factory, "plain", "--method", "none", "--max-num-seqs", "1")
    yield proc
    proc.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)


def requests_of_every_kind(model: str) -> list[dict]:
    """Greedy, n seeded sampled choices, penalised, biased, constrained: every serving mode."""
    kinds = [dict(prompt=p, max_tokens=40, temperature=0) for p in PROMPTS]
    kinds += [
        dict(prompt="def add(a, b):", max_tokens=30, temperature=0.9, seed=11, n=3),
        dict(prompt="class Stack:", max_tokens=30, temperature=0.7, top_p=0.9, seed=5),
        dict(prompt="import os\n", max_tokens=30, temperature=0, presence_penalty=0.8,
             frequency_penalty=0.4),
        dict(prompt="x = [", max_tokens=30, temperature=0,
             extra_body={"repetition_penalty": 1.3, "min_tokens": 10}),
        dict(prompt="# a", max_tokens=12, temperature=0,
             extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"}),
        dict(prompt="for i in range(", max_tokens=20, temperature=0.8, seed=3,
             extra_body={"guided_choice": ["alpha", "beta", "gamma"]}),
    ]  # fmt: skip
    for body in kinds:
        body["model"] = model
        body.setdefault("extra_body", {})["ignore_eos"] = "guided_choice" not in body.get(
            "extra_body", {}
        ) and "guided_regex" not in body.get("extra_body", {})
        body["logprobs"] = 2
    return kinds


def answer(response) -> list[tuple]:
    """What must match: each choice's text, token strings, logprobs and finish reason."""
    return [
        (c.index, c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs)
        for c in response.choices
    ]


def test_concurrent_requests_equal_their_one_at_a_time_answers(batched, plain):
    fast = client_of(batched)
    bodies = requests_of_every_kind(batched.model)
    expected = [  # one at a time
        answer(client_of(plain if body["temperature"] == 0 else batched).completions.create(**body))
        for body in bodies
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:  # all at once: they share the seats
        got = list(pool.map(lambda body: answer(fast.completions.create(**body)), bodies))
    for body, want, have in zip(bodies, expected, got, strict=True):
        assert have == want, body
    # the shared passes happened: some pass held more rows than one sequence's K + 1
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(batched.url + "/metrics").text)
    }
    rows = families["understudy:target_pass_rows"].samples
    count = next(s.value for s in rows if s.name.endswith("_count"))
    most_one_seq = next(s.value for s in rows if s.labels.get("le") == "4.0")
    assert count > 0 and most_one_seq < count


def test_streams_at_once_equal_their_plain_answers(batched, plain):
    body = {"model": batched.model, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    want = {
        p: httpx.post(plain.url + "/v1/completions", json={**body, "prompt": p}, timeout=120)
        .json()["choices"][0]["text"]
        for p in PROMPTS[:SEATS]
    }  # fmt: skip
    texts: dict[str, str] = {}

    def stream(prompt: str) -> None:
        pieces = []
        request = {**body, "prompt": prompt, "stream": True}
        with httpx.stream("POST", batched.url + "/v1/completions", json=request, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        texts[prompt] = "".join(pieces)

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:SEATS]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts == want


def test_health_shows_the_seats_and_their_memory(batched):
    health = httpx.get(batched.url + "/health").json()
    assert health["max_num_seqs"] == SEATS
    assert health["kv_bytes_per_seq"] > 0
    assert health["running"] == 0 and health["waiting"] == 0


def test_chat_and_the_lab_run_beside_the_batch(batched, plain):
    chat = {"model": batched.model, "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    want = httpx.post(plain.url + "/v1/chat/completions", json=chat, timeout=120).json()
    lab: list[dict] = []

    def run_lab() -> None:
        lab_body = {"mode": "spec", "prompt": "def add(a, b):", "max_tokens": 20}
        with httpx.stream("POST", batched.url + "/lab/api/run", json=lab_body, timeout=120) as r:
            lab.extend(json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: "))

    with ThreadPoolExecutor(4) as pool:
        chats = [
            pool.submit(httpx.post, batched.url + "/v1/chat/completions", json=chat, timeout=120)
            for _ in range(3)
        ]
        lab_run = pool.submit(run_lab)
        lab_run.result(120)
        for future in chats:
            got = future.result(120).json()
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert lab[-1]["type"] == "done" and lab[-1]["stats"]["tokens"] == 20


# --- in-process: the engine held, watched ------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(target, draft, dtype="float32", max_num_seqs=2)


def running(url: str) -> int:
    return httpx.get(url + "/health").json()["running"]


def wait_for(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_disconnected_stream_frees_its_seat_and_a_full_batch_says_429(engine):
    app = create_app(engine, max_queue=0)
    long = {"model": app.state.model_name, "prompt": "x", "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with serve_in_thread(app) as url:
        with httpx.stream("POST", url + "/v1/completions", json={**long, "n": 2}, timeout=60) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(line for line in lines if line.startswith("data: {"))
            assert wait_for(lambda: running(url) == 2)  # both choices hold a seat
            busy = httpx.post(url + "/v1/completions", json={**long, "stream": False}, timeout=30)
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
        # the client has gone: its sequences leave at the next round boundary
        assert wait_for(lambda: running(url) == 0), "the seats were not freed"
        short = {**long, "max_tokens": 5, "stream": False}
        again = httpx.post(url + "/v1/completions", json=short, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(url + "/health").json()["kv_bytes_per_seq"] == kv_bytes_per_seat(
            engine.scheduler.seats
        )


def test_a_bad_request_in_the_batch_fails_alone(engine):
    app = create_app(engine)
    name = app.state.model_name
    good = {"model": name, "prompt": "def add(a, b):", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    bad = {
        **good,
        "guided_regex": "(",
        "ignore_eos": False,
    }  # fails in the batch, as its seat is prefilled
    with serve_in_thread(app) as url:
        want = httpx.post(url + "/v1/completions", json=good, timeout=60).json()
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
                for body in (good, bad, good)
            ]
            first, failed, last = (f.result(60) for f in futures)
        assert failed.status_code == 400 and "compile" in failed.json()["error"]["message"]
        for response in (first, last):
            assert response.status_code == 200
            assert response.json()["choices"][0]["text"] == want["choices"][0]["text"]


def test_an_engine_fault_in_one_sequence_fails_it_alone_and_gives_its_seat_back(engine):
    """A fault that is no client error (here: the prefill of one prompt raises) is that
    request's 500; the others in the batch answer, and, more faults than seats later,
    every seat still takes a sequence."""
    app = create_app(engine)
    name = app.state.model_name
    marked = engine.encode("# fault")
    real_start = scheduler_module.start_request

    def faulty(target, max_context, prompt_ids, params, seat):
        if list(prompt_ids) == marked:
            raise RuntimeError("an engine fault")
        return real_start(target, max_context, prompt_ids, params, seat)

    good = {"model": name, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    scheduler_module.start_request = faulty
    try:
        with serve_in_thread(app) as url:
            want = httpx.post(url + "/v1/completions", json=good, timeout=60).json()
            bodies = [good, {**good, "prompt": "# fault"}] * (len(engine.scheduler.seats) + 1)
            with ThreadPoolExecutor(4) as pool:
                answers = list(
                    pool.map(lambda b: httpx.post(url + "/v1/completions", json=b, timeout=60),
                             bodies)
                )  # fmt: skip
            for body, response in zip(bodies, answers, strict=True):
                if body is good:
                    assert response.json()["choices"][0]["text"] == want["choices"][0]["text"]
                else:
                    assert response.status_code == 500, response.text
            health = httpx.get(url + "/health").json()
            assert (health["running"], health["waiting"]) == (0, 0)
            every_seat = {**good, "n": len(engine.scheduler.seats), "temperature": 1.0, "seed": 1}
            response = httpx.post(url + "/v1/completions", json=every_seat, timeout=60)
            assert response.json()["usage"]["completion_tokens"] == 12 * len(engine.scheduler.seats)
            assert len(engine.scheduler.free) == len(engine.scheduler.seats)
    finally:
        scheduler_module.start_request = real_start

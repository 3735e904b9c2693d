"""The OpenAI-compatible server, end to end, with the official `openai` client.

Most tests talk to a real `understudy serve` process on loopback (tiny models); the ones that
need to hold the engine busy or watch it (429, disconnects, the API key) serve the same app
on a thread of this process around a wrapped engine. The last test stops the real server
with SIGTERM while a request streams, and checks that the request finishes first.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, SlowEngine, check_sigterm_drains, serve_in_thread
from understudy.engine.engine import Engine

K = "2"  # fp32 CPU target passes hold 3 rows by default: K=2 keeps greedy output exact


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--target", target, "--draft", draft, "--dtype", "float32", "-k", K]
    proc = ServerProcess([*args, "--log-level", "warning"], log)
    proc.model = Path(target).name  # the served name: the directory's, never its path
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    target, draft = tiny_pair
    return Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=int(K)
    )


def spec_stats(response) -> dict:
    return response.model_extra["metrics"]["speculative_decoding"]


# --- the real server process -------------------------------------------------------------


def test_health_and_models(server, client):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [server.model] == [health["model"]]
    assert "/" not in server.model
    assert client.models.retrieve(server.model).id == server.model


def test_completion_carries_usage_and_speculative_stats(server, client):
    out = client.completions.create(
        model=server.model, prompt="def add(a, b):", max_tokens=24, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    stats = spec_stats(out)
    for key in ("method", "k", "tokens", "target_passes", "tokens_per_pass", "acceptance_rate",
                "mean_accepted_length", "per_position_acceptance", "prefill_s", "decode_s",
                "wall_s", "tokens_per_s", "decode_tokens_per_s"):  # fmt: skip
        assert key in stats, key
    assert stats["method"] == "draft" and stats["k"] == int(K)
    assert stats["tokens"] == 24
    assert stats["tokens_per_pass"] == pytest.approx(24 / stats["target_passes"])
    assert stats["drafted"] > 0 and stats["finish_reason"] == "length"


def test_completion_with_token_ids_prompt(server, client):
    out = client.completions.create(
        model=server.model, prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4


def test_chat_completion(server, client):
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Write a loop."}],
        max_tokens=16,
        temperature=0,
    )
    message = out.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens == spec_stats(out)["tokens"] <= 16


def test_streaming_equals_the_whole_response(server, client):
    kwargs = dict(model=server.model, prompt="for i in range(10):", max_tokens=40, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.usage.completion_tokens == 40
    assert spec_stats(final)["tokens"] == 40

    messages = [{"role": "user", "content": "Count to ten."}]
    chat = dict(model=server.model, messages=messages, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**chat)
    chunks = list(
        client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert spec_stats(chunks[-2])["tokens"] == whole.usage.completion_tokens


def test_seeded_sampling_is_reproducible(server, client):
    kwargs = dict(model=server.model, prompt="class Stack:", max_tokens=24, temperature=0.9, seed=7)
    a = client.completions.create(**kwargs, extra_body={"top_k": 50, "min_p": 0.01})
    b = client.completions.create(**kwargs, extra_body={"top_k": 50, "min_p": 0.01})
    assert a.choices[0].text == b.choices[0].text


def _ascii_stop(text: str) -> str | None:
    """A short printable substring that starts after the first character, if there is one."""
    for size in (3, 2, 1):
        for match in re.finditer(rf"[A-Za-z0-9(:]{{{size}}}", text[1:]):
            return match.group(0)
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, client, stream):
    kwargs = dict(model=server.model, prompt="def add(a, b):", temperature=0, max_tokens=48)
    full = client.completions.create(**kwargs).choices[0].text
    stop = _ascii_stop(full)
    assert stop, f"no usable stop string in {full!r}"
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(client.completions.create(**kwargs, stop=[stop, "never-there"], stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        out = client.completions.create(**kwargs, stop=stop)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == expected
    assert reason == "stop"


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def test_bad_requests_name_the_field(server, client):
    m = server.model
    cases = [
        (dict(model=m, prompt="x", n=0), 400, "n"),
        (dict(model=m, prompt="x", top_p=2.0), 400, "top_p"),
        (dict(model=m, prompt="x", temperature=-1.0), 400, "temperature"),
        (dict(model=m, prompt="x", max_tokens=0), 400, "max_tokens"),
        (dict(model=m, prompt="x", max_tokens=100_000), 400, "max_tokens"),
        (dict(model=m, prompt=""), 400, "prompt"),
        (dict(model=m, prompt=list(range(100)) * 50), 400, "prompt"),  # > the 4096 context
        (dict(model=m, prompt="x", temperature="hot"), 422, "temperature"),
        (dict(model=m, prompt="x", max_tokens="5"), 422, "max_tokens"),
        (dict(model=m, prompt="x", presence_penalty=2.5), 400, "presence_penalty"),
        (dict(model="gpt-4o", prompt="x"), 404, "model"),
    ]
    for kwargs, status, param in cases:
        error = _error(lambda kw=kwargs: client.completions.create(**kw))
        assert error.status_code == status, (kwargs, error)
        assert error.body["param"] == param, (kwargs, error.body)
        assert param in error.body["message"] or param == "model", error.body
    bad_message = [{"role": "user", "content": 5}]
    error = _error(lambda: client.chat.completions.create(model=m, messages=bad_message))
    assert error.status_code == 422 and error.body["param"] == "messages[0].content"
    error = _error(lambda: client.chat.completions.create(model=m, messages=[]))
    assert error.status_code == 422 and error.body["param"] == "messages"


def test_invalid_json_and_oversized_body(server):
    post = lambda content: httpx.post(  # noqa: E731
        server.url + "/v1/completions",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    response = post(b'{"model": "x", "prompt": ')
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]
    response = post(b"[1, 2, 3]")
    assert response.status_code == 422
    response = post(json.dumps({"model": server.model, "prompt": "x" * (2 << 20)}).encode())
    assert response.status_code == 413
    assert "body" in response.json()["error"]["message"]
    response = httpx.get(server.url + "/no/such/route")
    assert response.status_code == 404 and "error" in response.json()
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # still alive


def test_concurrent_greedy_requests_equal_alone(server):
    """32 requests at once: each answer equals the same request run alone; none lost."""
    requests = [
        dict(
            model=server.model,
            prompt=f"def f{i}(x):\n    return x * {i}",
            max_tokens=12 + i % 9,
            temperature=0,
        )
        for i in range(32)
    ]
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    alone = [sync.completions.create(**r).choices[0].text for r in requests]

    async def together() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120
        )

        async def one(i: int, r: dict) -> str:
            if i % 2:  # half of them stream
                stream = await client.completions.create(**r, stream=True)
                return "".join([c.choices[0].text async for c in stream])
            return (await client.completions.create(**r)).choices[0].text

        try:
            return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finally:
            await client.close()

    assert asyncio.run(together()) == alone


def scrape(url: str, **headers: str) -> dict[str, object]:
    """/metrics through prometheus_client's own parser: family name -> family."""
    response = httpx.get(url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def total(families: dict, name: str, sample: str | None = None, **labels: str) -> float:
    """The sum of a family's samples named `sample` (default: the family's own counter
    sample, name + "_total") whose labels include `labels`."""
    family = families[name]
    wanted = sample or (name + "_total" if family.type == "counter" else name)
    return sum(
        s.value
        for s in family.samples
        if s.name == wanted and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_prometheus_text(server, client):
    """Typed counters whose values move by exactly what the responses report."""
    before = scrape(server.url)
    outs = [
        client.completions.create(
            model=server.model,
            prompt=p,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for p in ("x = 1", "def f():")
    ]
    after = scrape(server.url)
    stats = [spec_stats(o) for o in outs]
    for name in ("http_requests", "request_success", "prompt_tokens", "generation_tokens",
                 "target_passes", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos"):  # fmt: skip
        assert after["understudy:" + name].type == "counter", name
    for name in ("num_requests_running", "num_requests_waiting", "spec_decode_acceptance_rate"):
        assert after["understudy:" + name].type == "gauge", name
    assert after["understudy:e2e_request_latency_seconds"].type == "histogram"

    def delta(name: str, sample: str | None = None, **labels: str) -> float:
        full = "understudy:" + name
        return total(after, full, sample, **labels) - total(before, full, sample, **labels)

    route = {"route": "/v1/completions", "code": "200"}
    assert delta("http_requests", **route) == 2
    assert delta("request_success", finished_reason="length") == 2
    assert delta("generation_tokens", model_name=server.model, method="draft") == 16
    assert delta("prompt_tokens") == sum(o.usage.prompt_tokens for o in outs)
    assert delta("target_passes") == sum(s["target_passes"] for s in stats)
    assert delta("spec_decode_num_drafts") == sum(s["rounds"] for s in stats)
    assert delta("spec_decode_num_draft_tokens") == sum(s["drafted"] for s in stats) > 0
    accepted = sum(s["accepted"] for s in stats)
    assert delta("spec_decode_num_accepted_tokens") == accepted
    assert delta("spec_decode_num_accepted_tokens_per_pos") == accepted
    assert delta("e2e_request_latency_seconds", "understudy:e2e_request_latency_seconds_count") == 2
    assert 0 <= total(after, "understudy:spec_decode_acceptance_rate") <= 1


def test_lab_page_and_api(server):
    page = httpx.get(server.url + "/lab")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert html.lower().startswith("<!doctype html>") and html.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing external
    for act in ("Act 1", "Act 2", "Act 3", "The race", "Check yourself"):
        assert act in html

    from understudy.policy.theory import simulate_report

    theory = httpx.get(server.url + "/lab/api/theory", params={"alpha": 0.7, "c": 0.2, "k": 3})
    expected = simulate_report(0.7, 0.2, 3, rounds=theory.json()["monte_carlo"]["rounds"])
    assert theory.json() == expected  # the same code as `understudy simulate`
    bad = httpx.get(server.url + "/lab/api/theory", params={"alpha": 2, "c": 0.2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "alpha"

    events = lab_run(server.url, "spec", 20)
    tokens = [e for e in events if e["type"] == "token"]
    assert events[0]["type"] == "start" and events[-1]["type"] == "done"
    assert len(tokens) == 20 == events[-1]["stats"]["tokens"]
    assert {t["origin"] for t in tokens} <= {"target", "accepted", "corrected", "bonus"}
    assert tokens[-1]["counters"]["passes"] == events[-1]["stats"]["target_passes"]
    assert tokens[-1]["counters"]["drafted"] == events[-1]["stats"]["drafted"]
    assert tokens[-1]["counters"]["accepted"] == events[-1]["stats"]["accepted"]
    for t in tokens:  # every round: its drafted tokens, the accepted ones a prefix of them
        if "drafted" in t:
            drafted, kept = [d["id"] for d in t["drafted"]], []
        if t["origin"] == "accepted":
            kept.append(t["id"])
            assert drafted[: len(kept)] == kept


def lab_run(url: str, mode: str, max_tokens: int) -> list[dict]:
    body = {"mode": mode, "prompt": "def add(a, b):", "max_tokens": max_tokens}
    with httpx.stream("POST", url + "/lab/api/run", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_zz_sigterm_drains_and_exits_cleanly(server):
    """Runs last: SIGTERM while a request streams; the request completes, then the process
    exits with status 0."""
    check_sigterm_drains(server, server.model)


# --- in-process server around a wrapped engine ------------------------------------------


def test_api_key(engine):
    from understudy.server import create_app

    app = create_app(engine, api_key="sekrit", model_name="tiny")
    with serve_in_thread(app) as url:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.post(url + "/v1/completions", content=b"{not json", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        out = good.completions.create(
            model="tiny", prompt="x", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 3
        assert httpx.get(url + "/health").status_code == 200  # open without a key
        run = httpx.post(url + "/lab/api/run", json={"mode": "plain", "prompt": "x"})
        assert run.status_code == 401


def test_full_queue_answers_429(engine):
    from understudy.server import create_app

    gate = threading.Event()
    slow = SlowEngine(engine, gate=gate)
    app = create_app(slow, max_queue=1, model_name="tiny")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        results: list = []

        def call() -> None:  # ignore_eos: a sampled EOS would end a request early, not lose it
            extra = {"ignore_eos": True}
            results.append(
                client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
            )

        running = threading.Thread(target=call)
        running.start()
        assert slow.started.wait(30)  # the worker is busy (held at the gate)
        waiting = threading.Thread(target=call)
        waiting.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=4)
        assert "busy" in info.value.body["message"]
        gate.set()
        running.join(30)
        waiting.join(30)
        assert [r.usage.completion_tokens for r in results] == [4, 4]  # none lost


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_generation(engine, stream):
    from understudy.server import create_app

    slow = SlowEngine(engine, delay_s=0.005)  # 1500 tokens would take >= 7.5 s
    app = create_app(slow, model_name="tiny")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": stream}  # fmt: skip
    with serve_in_thread(app) as url:
        t0 = time.monotonic()
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                next(r.iter_lines())  # one chunk arrives, then the client goes away
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        assert slow.finished.wait(5), "the generation was not cancelled"
        assert time.monotonic() - t0 < 5
        assert slow.produced < 1500
        # the engine is free again and answers the next request
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        slow.delay_s = 0.0
        assert client.completions.create(model="tiny", prompt="y", max_tokens=3).usage


class BrokenEngine(SlowEngine):
    """An engine that fails in the middle of a generation."""

    def stream(self, prompt, params):
        inner = self._engine.stream(prompt, params)

        def events():
            yield next(iter(inner))
            raise RuntimeError("the engine broke")

        class Stream:
            prompt_ids = inner.prompt_ids
            output = None

            def __iter__(self):
                return events()

        return Stream()


def test_an_engine_failure_is_a_500_and_the_server_lives_on(engine):
    from understudy.server import create_app

    broken = BrokenEngine(engine)
    with serve_in_thread(create_app(broken, model_name="tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt="x", max_tokens=5)
        with pytest.raises(openai.APIError, match="internal error"):  # an error event mid-stream
            list(client.completions.create(model="tiny", prompt="x", stream=True))
        broken.stream = engine.stream  # mended: the same server answers again
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_the_lab_works_with_any_method(tiny_pair, method):
    from understudy.drafters import DRAFTERS
    from understudy.server import create_app

    if method != "none" and method not in DRAFTERS:
        pytest.skip(f"method {method!r} is not in this build")
    engine = Engine.from_pretrained(
        target=tiny_pair[0], method=method, dtype="float32", num_speculative_tokens=2
    )
    with serve_in_thread(create_app(engine, model_name="m")) as url:
        assert httpx.get(url + "/lab/api/info").json()["method"] == method
        plain, spec = lab_run(url, "plain", 16), lab_run(url, "spec", 16)
        assert plain[-1]["stats"]["method"] == "none"
        assert spec[-1]["stats"]["method"] == method
        assert plain[-1]["token_ids"] == spec[-1]["token_ids"]  # greedy: lossless
        assert engine.drafter is None or type(engine.drafter).__name__ != "RecordingDrafter"

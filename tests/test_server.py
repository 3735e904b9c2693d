"""The OpenAI-compatible server, end to end, with the official `openai` client.

Every test talks to one real `understudy serve` process on loopback (tiny models); the tests
that hold the engine busy or watch it serve the app on a thread of this process
(test_server_inprocess.py, test_server_limits.py). The last test stops the server with
SIGTERM while a request streams, and checks that the request finishes first.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import ServerProcess, check_sigterm_drains, lab_run

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


def spec_stats(response) -> dict:
    return response.model_extra["metrics"]["speculative_decoding"]


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


def test_zz_sigterm_drains_and_exits_cleanly(server):
    """Runs last: SIGTERM while a request streams; the request completes, then the process
    exits with status 0."""
    check_sigterm_drains(server, server.model)

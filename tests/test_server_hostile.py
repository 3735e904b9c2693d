"""Hostile input against the real server: every probe is a 200 with a right answer or a 4xx
naming the field, never a 500, and the server stays healthy after each.

The module's server is a real `understudy serve` process (tiny models) with short header and
body timeouts and a served model name that holds a newline and a quote; the probes that need
an API key, a chat template that raises or a held engine serve the app on a thread of this
process. The official `openai` client sends what it can; raw JSON and raw sockets send what
it cannot (lone surrogates, slow heads, slow bodies).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from server_helpers import (
    ServerProcess,
    check_sigterm_drains,
    serve_in_thread,
)
from understudy.config import MIN_TEMPERATURE, SamplingParams, UnderstudyError
from understudy.engine.engine import Engine

NAME = 'tiny\n"pair"'  # a served name the metrics text must escape
HEAD_TIMEOUT_S = "1"
BODY_TIMEOUT_S = "2"


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    log = tmp_path_factory.mktemp("hostile") / "server.log"
    args = ["--target", target, "--draft", draft, "--dtype", "float32", "-k", "2",
            "--served-model-name", NAME, "--header-timeout", HEAD_TIMEOUT_S,
            "--body-timeout", BODY_TIMEOUT_S, "--log-level", "warning"]  # fmt: skip
    proc = ServerProcess(args, log)
    yield proc
    proc.stop()


@pytest.fixture(autouse=True)
def healthy_after(request):
    """After every probe against the module's server, it still answers /health."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        if server.proc.poll() is None:
            assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def refused(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value


def post_raw(url: str, path: str, text: str, **headers: str) -> httpx.Response:
    """POST `text` as the JSON body, byte for byte (escapes the clients would never send)."""
    headers = {"content-type": "application/json", **headers}
    return httpx.post(url + path, content=text.encode(), headers=headers, timeout=60)


def greedy(client, **kwargs) -> str:
    return client.completions.create(model=NAME, temperature=0, seed=1, **kwargs).choices[0].text


# --- sampling parameters at the edge of float arithmetic -------------------------------


def test_seed_past_64_bits_is_a_400_naming_seed(client):
    kwargs = dict(model=NAME, prompt="x", max_tokens=4, temperature=0.8)
    for seed in (2**64, 2**70, -1):
        error = refused(lambda s=seed: client.completions.create(**kwargs, seed=s))
        assert error.status_code == 400 and error.body["param"] == "seed", error.body
    a = client.completions.create(**kwargs, seed=2**64 - 1)  # the largest seed torch takes
    b = client.completions.create(**kwargs, seed=2**64 - 1)
    assert a.choices[0].text == b.choices[0].text


def test_a_temperature_below_float32_is_a_400_naming_temperature(client):
    for temperature in (1e-38, 1e-300, 5e-324):
        error = refused(
            lambda t=temperature: client.completions.create(
                model=NAME, prompt="x", max_tokens=4, temperature=t
            )
        )
        assert error.status_code == 400 and error.body["param"] == "temperature", error.body
        assert "temperature" in error.body["message"]


def test_the_smallest_temperature_samples_the_argmax(client):
    """At T = 2**-126 every logit but the top one is >= 2**100 below it after division:
    the law is the argmax, and sampled speculative output equals greedy output."""
    kwargs = dict(prompt="def add(a, b):", max_tokens=24, extra_body={"ignore_eos": True})
    sampled = client.completions.create(model=NAME, temperature=MIN_TEMPERATURE, seed=3, **kwargs)
    assert sampled.choices[0].text == greedy(client, **kwargs)


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(client):
    kwargs = dict(prompt="for i in range(10):", max_tokens=24, extra_body={"ignore_eos": True})
    for top_p in (1e-46, 5e-324):
        out = client.completions.create(model=NAME, temperature=1.0, top_p=top_p, seed=5, **kwargs)
        assert out.choices[0].text == greedy(client, **kwargs)


def test_sampling_params_refuse_the_same_values_for_python_callers():
    for kwargs, field in [
        ({"seed": 2**64}, "seed"),
        ({"temperature": 1e-39}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"stop": ["\ud800"]}, "stop"),
    ]:
        with pytest.raises(UnderstudyError, match=f"^{field}"):
            SamplingParams(**kwargs)
    SamplingParams(temperature=MIN_TEMPERATURE, top_p=5e-324, seed=2**64 - 1)


# --- text that is no Unicode ------------------------------------------------------------


def test_lone_surrogates_are_400s_naming_the_field(server):
    name = json.dumps(NAME)
    cases = [
        ("/v1/completions", f'{{"model": {name}, "prompt": "a\\ud800b"}}', "prompt"),
        ("/v1/completions", f'{{"model": {name}, "prompt": ["\\udfff"]}}', "prompt[0]"),
        ("/v1/completions", f'{{"model": {name}, "prompt": "x", "stop": ["\\ud800"]}}', "stop[0]"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
        (
            "/v1/chat/completions",
            f'{{"model": {name}, "messages": [{{"role": "user", "content": "hi \\ud83d"}}]}}',
            "messages[0].content",
        ),
        ("/lab/api/run", '{"mode": "spec", "prompt": "\\ud800"}', "prompt"),
        (  # named as the client spells it ("schema", not the model's field "schema_")
            "/v1/chat/completions",
            f'{{"model": {name}, "messages": [{{"role": "user", "content": "x"}}], '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "a", '
            '"schema": {"enum": ["\\ud800"]}}}}',
            "response_format.json_schema.schema.enum[0]",
        ),
    ]
    for path, text, param in cases:
        response = post_raw(server.url, path, text)
        assert response.status_code in (400, 422), (path, text, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    # a surrogate pair is one character (U+1F600), and fine
    pair = f'{{"model": {name}, "prompt": "\\ud83d\\ude00", "max_tokens": 2}}'
    assert post_raw(server.url, "/v1/completions", pair).status_code == 200


def test_engine_encode_refuses_a_lone_surrogate(engine):
    with pytest.raises(UnderstudyError, match="surrogate"):
        engine.encode("a\ud800")
    with pytest.raises(UnderstudyError, match="surrogate"):
        engine.encode([{"role": "user", "content": "\udc00"}])


# --- a chat template that raises ----------------------------------------------------------

STRICT_TEMPLATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<|im_end|>{{ m['role'] }}\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_end|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def strict_engine(tiny_pair):
    engine = Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")
    engine.tokenizer.chat_template = STRICT_TEMPLATE  # as many real templates do
    return engine


def test_a_chat_template_that_raises_is_a_400_naming_messages(strict_engine):
    from understudy.server import create_app

    with serve_in_thread(create_app(strict_engine, model_name="strict")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        wrong_order = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]
        for stream in (False, True):
            error = refused(
                lambda s=stream: client.chat.completions.create(
                    model="strict", messages=wrong_order, max_tokens=4, stream=s
                )
            )
            assert error.status_code == 400 and error.body["param"] == "messages", error.body
            assert "alternate" in error.body["message"]
        good = client.chat.completions.create(
            model="strict", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert good.choices[0].message.content is not None
        lab = httpx.post(url + "/lab/api/run", json={"mode": "plain", "prompt": "x", "chat": True})
        assert lab.status_code == 200  # one user message: the template takes it
        assert httpx.get(url + "/health").json()["status"] == "ok"


# a template that fails with no TemplateError, and one that refuses a lone user message
FAILING_TEMPLATES = [
    "{% for m in messages %}{{ m['content'] / 2 }}{% endfor %}",  # a TypeError
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
]


@pytest.mark.parametrize("template", FAILING_TEMPLATES)
def test_any_failure_of_the_template_is_a_400_on_v1_and_in_the_lab(tiny_pair, template):
    from understudy.server import create_app

    engine = Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")
    engine.tokenizer.chat_template = template
    with serve_in_thread(create_app(engine, model_name="t")) as url:
        for stream in (False, True):
            body = {"model": "t", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2, "stream": stream}  # fmt: skip
            response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "messages"
        run = {"mode": "plain", "prompt": "hi", "chat": True, "max_tokens": 2}
        response = httpx.post(url + "/lab/api/run", json=run, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and (health["running"], health["waiting"]) == (0, 0)


# --- constraints that leave no token to draw: a 400 naming them, and no seat lost --------

VOCAB = 320  # the tiny tokenizer's
CONTRADICTIONS = [
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # rounds to 0 as a divisor
    ({"stop_token_ids": list(range(VOCAB)), "min_tokens": 2}, "min_tokens"),  # all tokens stop
    ({"guided_choice": ["ab"], "stop_token_ids": list(range(1, VOCAB))}, "guided_choice"),
]


def test_constraints_that_leave_no_token_are_400s_and_free_their_seats(server, client):
    """Each was a 500 that kept its seat and its place in /health's `waiting`: more of them
    than there are seats, streamed or not, then a request that takes every seat."""
    seats = httpx.get(server.url + "/health").json()["max_num_seqs"]
    for _ in range(seats // (2 * len(CONTRADICTIONS)) + 1):
        for extra, param in CONTRADICTIONS:
            for stream in (False, True):
                error = refused(
                    lambda e=extra, s=stream: client.completions.create(
                        model=NAME, prompt="def", max_tokens=4, temperature=0.8, stream=s,
                        extra_body=e,
                    )
                )  # fmt: skip
                assert error.status_code == 400 and error.body["param"] == param, error.body
    health = httpx.get(server.url + "/health").json()
    assert (health["running"], health["waiting"]) == (0, 0)
    every_seat = client.completions.create(
        model=NAME, prompt="def", max_tokens=3, n=seats, temperature=1.0, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert every_seat.usage.completion_tokens == 3 * seats


# --- the Lab's API gets the same answers ------------------------------------------------


def test_lab_run_refuses_what_the_v1_routes_refuse(server):
    for body, param in [
        ({"mode": "spec", "prompt": "x", "seed": 2**64}, "seed"),
        ({"mode": "spec", "prompt": "x", "temperature": 1e-40}, "temperature"),
        ({"mode": "plain", "prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ]:
        response = httpx.post(server.url + "/lab/api/run", json=body, timeout=60)
        assert response.status_code in (400, 422), (body, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    body = {"mode": "spec", "prompt": "x", "temperature": MIN_TEMPERATURE, "max_tokens": 4}
    with httpx.stream("POST", server.url + "/lab/api/run", json=body, timeout=60) as response:
        events = [json.loads(x[6:]) for x in response.iter_lines() if x.startswith("data: ")]
    assert response.status_code == 200 and events[-1]["type"] == "done"


# --- the model id, the OpenAPI document, 405 ---------------------------------------------


def test_the_default_model_id_is_the_base_name_never_a_path(tiny_pair):
    target = tiny_pair[0]
    log = Path(target).parent / "default-name.log"
    proc = ServerProcess(["--target", target, "--method", "none", "--dtype", "float32"], log)
    try:
        models = httpx.get(proc.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [Path(target).name]
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=Path(target).name, prompt="x", max_tokens=2)
        assert out.model == Path(target).name
        assert target not in httpx.get(proc.url + "/health").text
        assert target not in httpx.get(proc.url + "/metrics").text
    finally:
        assert proc.stop() == 0


def test_openapi_lists_the_error_responses_and_the_event_stream(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "408", "413", "422", "429", "500"} <= set(responses)
        assert "401" not in responses  # no key on this server
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        schema = responses["400"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/ErrorBody")
    run = spec["paths"]["/lab/api/run"]["post"]["responses"]
    assert "text/event-stream" in run["200"]["content"] and "429" in run
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_a_405_names_the_allowed_methods(server):
    response = httpx.post(server.url + "/health")
    assert response.status_code == 405 and "GET" in response.headers["allow"]
    response = httpx.get(server.url + "/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


# --- /metrics: the library's text, escaped labels ---------------------------------------


def test_metrics_parse_with_an_escaped_model_name(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=NAME, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = families["understudy:generation_tokens"]
    assert tokens.type == "counter"
    assert {s.labels["model_name"] for s in tokens.samples} == {NAME}
    assert sum(s.value for s in tokens.samples if s.name.endswith("_total")) >= 3


# --- runs last: the server still drains on SIGTERM after all of the above ----------------


def test_zz_sigterm_still_drains(server):
    check_sigterm_drains(server, NAME)

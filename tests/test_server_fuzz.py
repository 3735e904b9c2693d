"""Schemathesis against the real server: requests generated from /openapi.json itself, valid
and invalid (schemathesis' positive and negative modes), for every operation.

Every answer must be no 5xx, a status the document lists for that operation, a content type
it lists, and a body that matches the listed schema. The served model name is pinned in the
generated bodies (otherwise nearly every request would stop at the 404 for an unknown model
and the generating paths would go untried), and the engine's context is small, so that any
generation stays short. Bounded and reproducible: a fixed number of examples per operation,
derandomized (hypothesis draws from a seed fixed by the test's name).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server_helpers import serve_in_thread
from understudy.engine.engine import Engine

MODEL = "tiny"
EXAMPLES = 30  # per operation and mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api_url(tiny_pair):
    from understudy.server import create_app

    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=2, max_context=48
    )
    with serve_in_thread(create_app(engine, model_name=MODEL)) as url:
        yield url
        assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def api_schema(api_url):
    return schemathesis.openapi.from_url(api_url + "/openapi.json")


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/lab"),
    ("GET", "/lab/api/info"),
    ("POST", "/lab/api/run"),
    ("GET", "/lab/api/theory"),
    ("GET", "/lab/api/alpha"),
]


def test_every_documented_operation_is_fuzzed(api_schema):
    documented = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


TAKING_INPUT = {  # the operations with parameters or a body a request can get wrong
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/lab/api/run"),
    ("GET", "/lab/api/theory"),
    ("GET", "/lab/api/alpha"),
}
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if (m, p) in TAKING_INPUT
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=str)
def test_no_5xx_and_every_answer_as_documented(api_schema, api_url, method, path, mode):
    operation = api_schema[path][method]

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,  # the same examples every run
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is shown as found
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        case.call_and_validate(base_url=api_url, checks=CHECKS, timeout=120)

    check()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/lab/api/run"])
def test_the_documented_examples_answer_200_as_documented(api_schema, api_url, path):
    """Each request body the document shows as an example is answered 200, and the answer
    (JSON, or the event stream) passes the same checks as the generated ones."""
    spec = httpx.get(api_url + "/openapi.json").json()
    examples = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    assert len(examples["examples"]) >= 2
    for example in examples["examples"].values():
        # a /v1 example names the served model, as a client sends it
        assert example["value"].get("model", MODEL) == MODEL
        case = api_schema[path]["POST"].Case(body=example["value"], media_type="application/json")
        response = case.call_and_validate(base_url=api_url, checks=CHECKS, timeout=120)
        assert response.status_code == 200, response.text


def test_zz_the_generating_paths_were_reached(api_url):
    """The requests above went through to generation (200s: the documented examples always,
    generated ones with the pinned model name too), not only to the validation that refuses
    them."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(api_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ok = {
        s.labels["route"]
        for s in families["understudy:http_requests"].samples
        if s.name.endswith("_total") and s.labels["code"] == "200" and s.value > 0
    }
    assert {"/v1/completions", "/v1/chat/completions", "/lab/api/run"} <= ok, ok

"""The server around a wrapped engine, served on a thread of this process (tiny models): a
client that disconnects cancels its generation, an engine failure is a 500 and the server
lives on, and the Lab works over any method. The API key and the queue are in
test_server_limits.py.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from server_helpers import SlowEngine, lab_run, serve_in_thread
from understudy.engine.engine import Engine


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

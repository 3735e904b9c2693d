"""The server's limits, through a real HTTP server: the API key (what it guards, which keys
it refuses at start), the time a connection may take for its head and body, idle
connections, and the queue (full: a 429; a queued client that has gone leaves it).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from server_helpers import ROOT, SlowEngine, free_port, serve_in_thread

# --- the API key --------------------------------------------------------------------------


def test_the_key_guards_metrics_and_the_lab_api(engine):
    from understudy.server import create_app

    key = {"Authorization": "Bearer sekrit"}
    for public in (False, True):
        app = create_app(engine, api_key="sekrit", model_name="tiny", public_metrics=public)
        with serve_in_thread(app) as url:
            for path in ("/lab/api/info", "/lab/api/theory?alpha=0.5&c=0.1", "/lab/api/alpha"
                         "?acceptance_rate=0.5&k=2"):  # fmt: skip
                assert httpx.get(url + path).status_code == 401, path
                assert httpx.get(url + path, headers=key).status_code == 200, path
            assert httpx.get(url + "/metrics").status_code == (200 if public else 401)
            assert httpx.get(url + "/metrics", headers=key).status_code == 200
            assert httpx.get(url + "/health").status_code == 200
            assert httpx.get(url + "/lab").status_code == 200  # the page asks for the key
            spec = httpx.get(url + "/openapi.json").json()["paths"]
            assert "401" in spec["/v1/completions"]["post"]["responses"]
            assert ("401" in spec["/metrics"]["get"]["responses"]) is not public


def test_the_key_guards_v1(engine):
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


def test_a_key_no_client_can_send_is_refused_at_start(engine):
    from understudy.server import create_app

    for bad in ("ключ", "two words", ""):
        with pytest.raises(ValueError, match="API key"):
            create_app(engine, api_key=bad)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli.serve", "--api-key", "ключ", "--port", str(free_port())],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "visible ASCII" in done.stderr


# --- timeouts -----------------------------------------------------------------------------


def closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (30 s at most)."""
    sock.settimeout(30)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_idle_and_slow_connections_are_closed(engine):
    from understudy.server import create_app
    from understudy.server.guard import head_timeout_protocol

    app = create_app(engine, model_name="tiny", body_timeout_s=2.0)
    with serve_in_thread(app, http=head_timeout_protocol(1.0)) as url:
        check_connections_closed(int(url.rsplit(":", 1)[1]))
        assert httpx.get(url + "/health").json()["status"] == "ok"


def check_connections_closed(port: int) -> None:
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    slow_head = socket.create_connection(("127.0.0.1", port))
    slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    slow_body = socket.create_connection(("127.0.0.1", port))
    slow_body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": '
    )
    try:
        for sock in idle:
            assert closed_by_server(sock) == b""
        assert closed_by_server(slow_head) == b""
        answer = closed_by_server(slow_body)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"code": "timeout"' in answer or b'"code":"timeout"' in answer
    finally:
        for sock in [*idle, slow_head, slow_body]:
            sock.close()


def test_serve_help_states_the_timeouts():
    done = subprocess.run(
        [sys.executable, "-m", "understudy.cli.serve", "--help"],
        capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"},
        timeout=120,
    )  # fmt: skip
    for flag in ("--header-timeout", "--body-timeout", "--keep-alive-timeout", "--public-metrics"):
        assert flag in done.stdout, flag


# --- the queue: one request runs, max_queue more wait, a client that has gone leaves -------


def waiting(url: str) -> int:
    return httpx.get(url + "/health").json()["waiting"]


def wait_for(url: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while waiting(url) != count:
        assert time.monotonic() < deadline, f"waiting stayed {waiting(url)}, not {count}"
        time.sleep(0.02)


@contextmanager
def one_running_at_most_one_waiting(engine) -> Iterator[tuple[str, openai.OpenAI, Callable]]:
    """A server with max_queue=1 whose worker holds one request at a gate; yields its URL, a
    client and `call()`, which starts another 4-token request on a thread. On leaving, the
    gate opens and every request started by `call` must have its 4 tokens: none lost."""
    from understudy.server import create_app

    gate = threading.Event()
    slow = SlowEngine(engine, gate=gate)
    app = create_app(slow, max_queue=1, model_name="tiny")
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        results: list = []
        threads: list[threading.Thread] = []

        def call() -> None:  # ignore_eos: a sampled EOS would end a request early, not lose it
            def run() -> None:
                extra = {"ignore_eos": True}
                out = client.completions.create(
                    model="tiny", prompt="x", max_tokens=4, extra_body=extra
                )
                results.append(out)

            threads.append(threading.Thread(target=run))
            threads[-1].start()

        call()
        try:
            assert slow.started.wait(30)  # the worker is busy (held at the gate)
            yield url, client, call
        finally:
            gate.set()
            for thread in threads:
                thread.join(60)
        assert [r.usage.completion_tokens for r in results] == [4] * len(threads)


def test_full_queue_answers_429(engine):
    with one_running_at_most_one_waiting(engine) as (url, client, call):
        call()
        wait_for(url, 1)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=4)
        assert "busy" in info.value.body["message"]


def test_a_queued_request_whose_client_goes_leaves_the_queue(engine):
    with one_running_at_most_one_waiting(engine) as (url, client, call):
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 4}'
        gone = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        gone.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(url, 1)
        gone.close()  # the queued request's client goes away
        wait_for(url, 0)  # its place is free at once, while the worker is still held
        call()  # admitted, not a 429
        wait_for(url, 1)

"""Helpers for the server and Lab tests: a real `understudy serve` process, or the app served
by uvicorn on a thread of the test process, both on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m understudy.cli.serve ...` as a child process."""

    def __init__(self, args: list[str], log_path: Path, startup_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "understudy.cli.serve", *args, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start in {startup_s} s:\n{self.log()}")
            time.sleep(0.25)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@contextmanager
def serve_in_thread(app: Any, **config: Any) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a thread of this process; yields its base URL.
    `config`: more uvicorn.Config arguments (timeouts, the `http` protocol)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **config
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


class SlowEngine:
    """Wraps a real engine: its streams can wait for a gate and sleep between tokens, and it
    records how far each one got, so tests can hold the worker busy or watch a cancel."""

    def __init__(self, engine: Any, delay_s: float = 0.0, gate: threading.Event | None = None):
        self._engine = engine
        self.delay_s = delay_s
        self.gate = gate
        self.started = threading.Event()
        self.finished = threading.Event()
        self.produced = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, prompt: Any, params: Any) -> Any:
        inner = self._engine.stream(prompt, params)
        outer = self

        class Stream:
            prompt_ids = inner.prompt_ids
            output = None

            def __iter__(self) -> Iterator[Any]:
                outer.started.set()
                try:
                    if outer.gate is not None:
                        outer.gate.wait(60)
                    for event in inner:
                        outer.produced += 1
                        time.sleep(outer.delay_s)
                        yield event
                    Stream.output = inner.output
                finally:
                    outer.finished.set()

        return Stream()


def check_sigterm_drains(server: ServerProcess, model: str) -> None:
    """SIGTERM while a request streams: the request completes, no new connection is taken
    meanwhile, and the process exits with status 0."""
    import json

    url = server.url + "/v1/completions"
    body = {"model": model, "prompt": "x", "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    chunks: list[dict] = []
    first = threading.Event()

    def read() -> None:
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(60)
    server.terminate()
    time.sleep(0.3)
    try:  # no new connections while draining
        httpx.get(server.url + "/health", timeout=2)
        raise AssertionError("a new connection was accepted while draining")
    except httpx.HTTPError:
        pass
    reader.join(120)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 800
    assert server.proc.wait(60) == 0, server.log()


def lab_run(url: str, mode: str, max_tokens: int) -> list[dict]:
    """One Lab run (`/lab/api/run`, mode "plain" or "spec"): its server-sent events, decoded."""
    body = {"mode": mode, "prompt": "def add(a, b):", "max_tokens": max_tokens}
    with httpx.stream("POST", url + "/lab/api/run", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]

"""A server under test: a child process on a free loopback port, started and waited for
until its /health answers, then stopped (the serving benchmark's servers, ours and a peer's)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from understudy.config import UnderstudyError

STARTUP_S = 900.0  # loading real models and measuring their costs, on a slow CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerUnderTest:
    """A server as a child process on a free loopback port, up (its /health answers 200) until
    `stop()`: `python -m understudy.cli.serve ARGS`, or the command `launch(port)` gives (a
    peer's server), with `env` added to its environment. `health` is /health's JSON, or {}."""

    def __init__(self, args: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 launch: Callable[[int], list[str]] | None = None) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        ours = [sys.executable, "-m", "understudy.cli.serve", *args, "--port", str(self.port)]
        command = launch(self.port) if launch is not None else ours
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})  # fmt: skip
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                tail = log_path.read_text(errors="replace")[-2000:]
                raise UnderstudyError(f"the server exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise UnderstudyError(f"the server did not start in {STARTUP_S:.0f} s")
            time.sleep(0.5)
        try:
            self.health: dict[str, Any] = httpx.get(self.url + "/health", timeout=10).json()
        except ValueError:  # a peer's /health may answer 200 with no body
            self.health = {}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

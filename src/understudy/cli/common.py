"""What the commands share: how a user-facing error ends a command, and how a server's
drain ends the process."""

from __future__ import annotations

import signal

import typer
from rich.console import Console


def fail(message: str) -> None:
    """Print `message` as one error line and exit with status 2 (no traceback)."""
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)


def exit_zero_after_drain() -> None:
    """uvicorn handles SIGTERM/SIGINT itself (stop accepting, drain, shut down), then raises
    the signal again under the handler that was there before it: make that one a no-op, so a
    drained server exits with status 0 instead of dying by the signal. Call it once the
    server is about to run (uvicorn installs its own handlers when it starts)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)


def _drained(signum: int, frame: object) -> None:
    """The signal arrives again once uvicorn has drained: nothing left to do."""

"""What every command shares: how a user-facing error ends a command."""

from __future__ import annotations

import typer
from rich.console import Console


def fail(message: str) -> None:
    """Print `message` as one error line and exit with status 2 (no traceback)."""
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)

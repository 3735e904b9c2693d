"""`understudy serve --replicas N [--ray-address ADDR]`: the command-line side of
server/replicas.py (flag checks, messages, signals); the serving itself lives there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console

from understudy.cli.common import exit_zero_after_drain


def serve_on_replicas(
    err: Console,
    fail: Callable[[str], None],
    engine_options: dict[str, Any],
    app_options: dict[str, Any],
    uvicorn_options: dict[str, Any],
    replicas: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    replica_cpus: float,
    ray_address: str | None,
) -> None:
    """Serve through Ray Serve until SIGTERM; `fail` (which exits) on any problem."""
    from understudy.config import UnderstudyError

    if replicas is None:
        fail("--ray-address, --min-replicas and --max-replicas need --replicas N")
        return
    try:
        from understudy.server.replica import ReplicaSpec
        from understudy.server.replicas import ScaleOptions, serve_replicas
    except ImportError as error:
        fail(f"--replicas needs Ray Serve ({error}): pip install 'understudy[ray]'")
        return
    scale = ScaleOptions(replicas, min_replicas, max_replicas, replica_cpus, ray_address)
    host, port = uvicorn_options["host"], uvicorn_options["port"]
    shown = f"[{host}]" if ":" in host else host

    def ready() -> None:
        err.print(
            f"serving {engine_options['target'] or 'the default pair'} on {replicas} "
            f"replica(s) at http://{shown}:{port}/v1   Lab: http://{shown}:{port}/lab"
            + ("   (API key required)" if app_options["api_key"] else "")
        )
        exit_zero_after_drain()  # so the replicas and Ray stop before the exit with 0

    try:
        serve_replicas(
            ReplicaSpec(engine_options, app_options),
            scale,
            uvicorn_options=uvicorn_options,
            say=err.print,
            on_ready=ready,
        )
    except UnderstudyError as error:  # RayUnavailable included: its message says so
        fail(str(error))

"""`understudy serve --replicas N`: the same server, on N engine replicas run by Ray Serve.

    understudy serve --replicas 2                          # a private Ray instance on loopback
    understudy serve --replicas 4 --ray-address HOST:6379  # join a cluster (`ray start --head`)
    understudy serve --replicas 2 --min-replicas 1 --max-replicas 4   # autoscaling

Layout: one Serve deployment, `EngineReplica` (replica.py), whose replicas each load the
engine once and run `create_app`'s app and worker thread; a front (front.py) served by
uvicorn in this process on --host/--port, which forwards every request to a replica through
the deployment's handle; a `MetricsBoard` actor for GET /metrics (replica_metrics.py).
Ray's own HTTP proxy stays off: the front owns the port, so SIGTERM drains requests exactly
as the single-process server does, and replica failures map to the API's retryable errors.

Without --ray-address a Ray instance of this process's own is started: every Ray server
on 127.0.0.1, no dashboard, no usage stats, its files in a fresh temporary directory that
is removed on exit. SIGTERM (or Ctrl-C): the front stops accepting, lets the requests in
flight finish (up to --drain-timeout seconds), then the replicas stop and the Ray instance
with them (on a joined cluster only this app is deleted), and the process exits with 0.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from understudy.config import UnderstudyError
from understudy.server.replica import (
    APP_NAME,
    DEPLOYMENT_NAME,
    EngineReplica,
    ReplicaSpec,
    running_replicas,
)

LIGHT_ROUTE_SLOTS = 4  # /health, /v1/models, the Lab's info: calls beside a full queue
HEALTH_CHECK_PERIOD_S = 2.0  # Ray Serve's check that a replica still answers
TARGET_ONGOING_REQUESTS = 1.0  # autoscaling: an engine decodes one request at a time
CONSTRUCTOR_RETRIES = 2  # a model that does not load fails the start, not 20 times


class RayUnavailable(UnderstudyError):
    """Ray could not be started or joined (the message says why)."""


@dataclass(frozen=True)
class ScaleOptions:
    """How many replicas, where, and how much of a node each one reserves.

    With min_replicas == max_replicas == replicas (the default) the count is fixed; a range
    turns on Ray Serve's autoscaling, starting at `replicas`, targeting one request in
    flight per replica (TARGET_ONGOING_REQUESTS)."""

    replicas: int
    min_replicas: int | None = None
    max_replicas: int | None = None
    replica_cpus: float = 1.0
    ray_address: str | None = None

    @property
    def low(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def high(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas

    def check(self) -> None:
        if self.replicas < 1:
            raise UnderstudyError(f"--replicas must be >= 1, got {self.replicas}")
        if not 1 <= self.low <= self.replicas <= self.high:
            raise UnderstudyError(
                "need 1 <= --min-replicas <= --replicas <= --max-replicas, got "
                f"{self.low} <= {self.replicas} <= {self.high}"
            )
        if not self.replica_cpus > 0:
            raise UnderstudyError(f"--replica-cpus must be > 0, got {self.replica_cpus}")

    def count_options(self) -> dict[str, Any]:
        if self.low == self.high:
            return {"num_replicas": self.replicas}
        return {
            "autoscaling_config": {
                "min_replicas": self.low,
                "initial_replicas": self.replicas,
                "max_replicas": self.high,
                "target_ongoing_requests": TARGET_ONGOING_REQUESTS,
            }
        }


def serve_replicas(
    spec: ReplicaSpec,
    scale: ScaleOptions,
    *,
    uvicorn_options: dict[str, Any],
    say: Callable[[str], None],
    on_ready: Callable[[], None],
) -> None:
    """Start (or join) Ray, deploy the replicas, serve the front with `uvicorn.run(front,
    **uvicorn_options)` until SIGTERM (`on_ready` runs just before), then clean up.

    Raises RayUnavailable when Ray cannot start or be joined, UnderstudyError when the
    replicas cannot be deployed (the model does not load, too few CPUs, a name clash)."""
    import uvicorn

    scale.check()
    log_level = uvicorn_options.get("log_level", "info")
    drain_s = uvicorn_options.get("timeout_graceful_shutdown")
    max_queue = _app_setting(spec, "max_queue")
    from understudy.engine.seats import AUTO_SEATS  # (torch: not at this module's import)

    seats = spec.engine.get("max_num_seqs", 1)  # a replica runs this many at once
    running = AUTO_SEATS if seats == "auto" else int(seats)
    with ray_instance(scale.ray_address, log_level) as local:
        from ray import serve

        from understudy.server.front import Front
        from understudy.server.replica_metrics import board_actor

        _check_room(scale)
        serve_logs = {"log_level": _ray_log_level(log_level), "enable_access_log": False}
        serve.start(proxy_location="Disabled", logging_config=serve_logs)
        if APP_NAME in serve.status().applications:
            raise UnderstudyError(
                f"this Ray cluster already runs a Serve application named {APP_NAME!r} "
                "(another `understudy serve --replicas`?): stop it first"
            )
        deployment = serve.deployment(
            EngineReplica,
            name=DEPLOYMENT_NAME,
            ray_actor_options={"num_cpus": scale.replica_cpus},
            max_ongoing_requests=max_queue + running + LIGHT_ROUTE_SLOTS,
            max_queued_requests=max(1, max_queue),
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            max_constructor_retry_count=CONSTRUCTOR_RETRIES,
            **({} if drain_s is None else {"graceful_shutdown_timeout_s": drain_s}),
            **scale.count_options(),
        )
        board = board_actor().remote()
        say(f"starting {scale.replicas} replica(s) on Ray ...")
        try:
            handle = serve.run(
                deployment.bind(spec, board),
                name=APP_NAME,
                route_prefix=None,
                logging_config=serve_logs,
            )
        except RuntimeError as error:
            _stop_app(local)
            raise UnderstudyError(f"the replicas did not start: {_last_line(error)}") from None

        async def replica_count() -> int:
            return await asyncio.to_thread(running_replicas)

        front = Front(
            handle,
            board,
            replica_count,
            api_key=_app_setting(spec, "api_key"),
            public_metrics=_app_setting(spec, "public_metrics"),
            max_body_bytes=_app_setting(spec, "max_body_bytes"),
            body_timeout_s=_app_setting(spec, "body_timeout_s"),
        )
        on_ready()
        try:
            uvicorn.run(front, **uvicorn_options)
        finally:
            _stop_app(local)


def _app_setting(spec: ReplicaSpec, name: str) -> Any:
    """A create_app keyword as the replicas see it: the spec's, else create_app's default."""
    from understudy.server.app import create_app

    return spec.app.get(name, inspect.signature(create_app).parameters[name].default)


@contextmanager
def ray_instance(address: str | None, log_level: str) -> Iterator[bool]:
    """Ray, connected: a private local instance when `address` is None (yields True), else
    the cluster at `address` (yields False). Disconnects (and stops a private one) on exit."""
    temp_dir = None
    if address is None:
        # Ray's switch for single-machine use: its node address becomes 127.0.0.1, so every
        # server it starts (GCS, raylet, workers, agents) binds the loopback interface only.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        temp_dir = tempfile.mkdtemp(prefix="understudy-ray-")
    try:
        import ray
    except ImportError as error:
        raise RayUnavailable(
            f"--replicas needs Ray Serve ({error}): pip install 'understudy[ray]'"
        ) from None
    level = _ray_log_level(log_level)
    try:
        if address is None:
            ray.init(
                address="local",
                include_dashboard=False,
                _temp_dir=temp_dir,
                logging_level=level,
                configure_logging=True,
            )
        else:
            ray.init(address=address, logging_level=level, configure_logging=True)
    except Exception as error:  # Ray raises many kinds; each means it did not start
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        where = "a local Ray instance" if address is None else f"the Ray cluster at {address}"
        raise RayUnavailable(f"Ray could not start {where}: {_last_line(error)}") from None
    logging.getLogger("ray.serve").setLevel(level)  # its driver-side notices
    try:
        yield address is None
    finally:
        ray.shutdown()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_app(local: bool) -> None:
    """Stop the replicas: all of Serve on a private instance, only this app on a cluster."""
    from ray import serve

    if local:
        serve.shutdown()
    else:
        serve.delete(APP_NAME)


def _check_room(scale: ScaleOptions) -> None:
    import ray

    cpus = ray.cluster_resources().get("CPU", 0.0)
    needed = scale.replicas * scale.replica_cpus
    if needed > cpus:
        raise UnderstudyError(
            f"{scale.replicas} replica(s) x {scale.replica_cpus} CPU need {needed:g} CPUs; "
            f"this Ray cluster has {cpus:g}: lower --replica-cpus or --replicas"
        )


def _ray_log_level(uvicorn_level: str) -> str:
    level = uvicorn_level.upper()
    return "DEBUG" if level == "TRACE" else level


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__

"""`understudy serve`: the OpenAI-compatible server and the Lab, on one engine.

    python -m understudy.cli.serve [--target T] [--draft D] [--method M] [-k K|auto]
                                   [--host 127.0.0.1] [--port 8000] [--api-key KEY]
                                   [--replicas N [--ray-address ADDR]]

Binds to 127.0.0.1 unless told otherwise. SIGTERM (or Ctrl-C) stops accepting connections,
lets the requests in flight finish (up to --drain-timeout seconds), then exits with status 0.
No connection stays open for nothing: its request head must arrive within --header-timeout
seconds, its body within --body-timeout, and an idle keep-alive connection closes after
--keep-alive-timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, NoReturn

import typer
from rich.console import Console

from understudy.cli.common import exit_zero_after_drain
from understudy.config import DType, Method, Quantization

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]  # uvicorn's

ERROR_EXIT_CODE = 2


def serve(
    target: Annotated[
        str | None, typer.Option(help="Target model: registry name, HF id, directory or .gguf.")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model (method=draft).")] = None,
    method: Annotated[
        Method,
        typer.Option(
            help="The drafter, or none (plain decoding). auto: the target's own head where "
            "one is found for it, else the draft model."
        ),
    ] = "auto",
    k: Annotated[
        str,
        typer.Option(
            "-k", "--num-speculative-tokens", help="Tokens drafted per round: 1..64 or auto."
        ),
    ] = "auto",
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 = every interface).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="UNDERSTUDY_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1, the Lab's API and /metrics "
            "(/health and the Lab's page stay open). Visible ASCII characters only.",
        ),
    ] = None,
    public_metrics: Annotated[
        bool, typer.Option(help="Serve /metrics without the API key.")
    ] = False,
    max_num_seqs: Annotated[
        str,
        typer.Option(
            help="Sequences decoded together (a request's n choices count n): an integer, or "
            "auto (8 where the target's passes can hold several sequences' rows: float32 or "
            "a GGUF model's own blocks on a CPU; else 1)."
        ),
    ] = "auto",
    max_queue: Annotated[
        int,
        typer.Option(help="Sequences that may wait while the seats are full; more get HTTP 429."),
    ] = 64,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model id clients send (default: the target's name).")
    ] = None,
    dtype: Annotated[
        DType, typer.Option(help="Weights' dtype (auto: bf16 where native).")
    ] = "auto",
    quantization: Annotated[
        Quantization, typer.Option(help="gguf: a GGUF model from its own blocks, on a CPU.")
    ] = "auto",
    max_context: Annotated[int, typer.Option(help="Prompt + generation, in tokens.")] = 4096,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted.")] = 1 << 20,
    header_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a connection may take to send a request's head (line and headers), "
            "from its opening or its previous response; then it is closed."
        ),
    ] = 10.0,
    body_timeout: Annotated[
        float,
        typer.Option(help="Seconds a request's whole body may take to arrive; then HTTP 408."),
    ] = 30.0,
    keep_alive_timeout: Annotated[
        int, typer.Option(help="Seconds an idle keep-alive connection stays open.")
    ] = 5,
    drain_timeout: Annotated[
        float, typer.Option(help="On SIGTERM, seconds to let requests in flight finish.")
    ] = 120.0,
    log_level: Annotated[LogLevel, typer.Option(help="uvicorn log level.")] = "info",
    replicas: Annotated[
        int | None,
        typer.Option(
            help="Serve N engine replicas through Ray Serve (each loads the models once); "
            "without it, one engine in this process."
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --replicas: join the Ray cluster at this address (e.g. HOST:6379, "
            "or auto); without it a private Ray instance on 127.0.0.1 is started."
        ),
    ] = None,
    min_replicas: Annotated[
        int | None, typer.Option(help="With --replicas: autoscale down to this many.")
    ] = None,
    max_replicas: Annotated[
        int | None, typer.Option(help="With --replicas: autoscale up to this many.")
    ] = None,
    replica_cpus: Annotated[
        float, typer.Option(help="With --replicas: CPUs Ray reserves for each replica.")
    ] = 1.0,
) -> None:
    """Serve the engine over OpenAI's HTTP API, with the live Lab at /lab."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def fail(message: str) -> NoReturn:
        err.print(f"[red]error:[/red] {message}")
        raise typer.Exit(ERROR_EXIT_CODE)

    timeouts = {"--header-timeout": header_timeout, "--body-timeout": body_timeout,
                "--keep-alive-timeout": keep_alive_timeout}  # fmt: skip
    seqs = checked_flags(fail, port, max_queue, max_num_seqs, max_body_bytes, timeouts)
    try:  # what serving needs, before anything starts
        import uvicorn  # noqa: F401

        from understudy.server import create_app  # noqa: F401
        from understudy.server.guard import api_key_problem, head_timeout_protocol
    except ImportError as error:
        fail(f"serving needs fastapi and uvicorn ({error}): pip install 'understudy[serve]'")
    problem = api_key_problem(api_key)
    if problem is not None:
        fail(f"--api-key (or UNDERSTUDY_API_KEY): {problem}")
    engine_options = dict(
        target=target,
        draft=draft,
        method=method,
        num_speculative_tokens=k,
        dtype=dtype,
        quantization=quantization,
        max_context=max_context,
        max_num_seqs=seqs,
    )
    app_options = dict(
        api_key=api_key,
        max_queue=max_queue,
        model_name=served_model_name,
        max_body_bytes=max_body_bytes,
        public_metrics=public_metrics,
        body_timeout_s=body_timeout,
    )
    uvicorn_options = dict(
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=drain_timeout,
        timeout_keep_alive=keep_alive_timeout,
        http=head_timeout_protocol(header_timeout),
    )
    if any(flag is not None for flag in (replicas, ray_address, min_replicas, max_replicas)):
        from understudy.cli.serve_replicas import serve_on_replicas

        serve_on_replicas(
            err, fail, engine_options, app_options, uvicorn_options,
            replicas, min_replicas, max_replicas, replica_cpus, ray_address,
        )  # fmt: skip
        return
    serve_in_process(err, fail, engine_options, app_options, uvicorn_options)


def checked_flags(
    fail: Callable[[str], NoReturn],
    port: int,
    max_queue: int,
    max_num_seqs: str,
    max_body_bytes: int,
    timeouts: dict[str, float],
) -> int | Literal["auto"]:
    """`fail` on the first flag out of its range (a timeout: flag -> seconds); else
    --max-num-seqs as the engine takes it."""
    if not 1 <= port <= 65535:
        fail(f"--port must be in 1..65535, got {port}")
    if max_queue < 0:
        fail(f"--max-queue must be >= 0, got {max_queue}")
    if max_num_seqs != "auto" and (not max_num_seqs.isdecimal() or int(max_num_seqs) < 1):
        fail(f"--max-num-seqs must be an integer >= 1 or auto, got {max_num_seqs!r}")
    if max_body_bytes < 1024:
        fail(f"--max-body-bytes must be at least 1024, got {max_body_bytes}")
    for flag, seconds in timeouts.items():
        if not 0 < seconds < float("inf"):
            fail(f"{flag} must be a positive number of seconds, got {seconds}")
    return "auto" if max_num_seqs == "auto" else int(max_num_seqs)


def serve_in_process(
    err: Console,
    fail: Callable[[str], NoReturn],
    engine_options: dict[str, Any],
    app_options: dict[str, Any],
    uvicorn_options: dict[str, Any],
) -> None:
    """Load the engine here and serve it with uvicorn until SIGTERM (then exit with 0)."""
    import uvicorn

    from understudy.config import UnderstudyError
    from understudy.engine.engine import Engine
    from understudy.server import create_app

    shown_target = engine_options["target"] or "the default pair"
    method, k = engine_options["method"], engine_options["num_speculative_tokens"]
    err.print(f"loading {shown_target} (method={method}, k={k}) ...")
    try:
        engine = Engine.from_pretrained(**engine_options)
    except UnderstudyError as error:
        fail(str(error))
    app = create_app(engine, **app_options)
    host, port = uvicorn_options["host"], uvicorn_options["port"]
    shown = f"[{host}]" if ":" in host else host
    err.print(
        f"serving [bold]{app.state.model_name}[/bold] ({engine.method}, k={engine.k}, "
        f"{len(engine.scheduler.seats)} seqs at once) on "
        f"http://{shown}:{port}/v1   Lab: http://{shown}:{port}/lab"
        + ("   (API key required)" if app_options["api_key"] else "")
    )
    exit_zero_after_drain()
    uvicorn.run(app, **uvicorn_options)


def main() -> None:
    typer.run(serve)


if __name__ == "__main__":
    main()

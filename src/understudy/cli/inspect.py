"""`understudy inspect MODEL`: what the engine would do with a model, in seconds, without
loading its weights (engine/inspect.py builds the report; this file prints it)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from understudy.cli.common import fail

PATH_NAMES = {
    "blocks": "our Transformer on the GGUF file's own blocks (the integer fast path)",
    "dense": "our Transformer, dense",
    "transformers": "transformers' own code (the fallback)",
}


def inspect_command(
    model: Annotated[
        str,
        typer.Argument(
            help="Packaged name (e.g. qwen2.5-coder-1.5b), .gguf file, Hugging Face folder or id."
        ),
    ],
    draft: Annotated[
        str | None,
        typer.Option(help="Draft model to check against MODEL (default: the packaged pair's)."),
    ] = None,
    max_context: Annotated[int, typer.Option(help="Prompt + generation, in tokens.")] = 4096,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    quantization: Annotated[
        str, typer.Option(help="auto | none | gguf, as `generate --quantization`.")
    ] = "auto",
    fetch: Annotated[
        bool, typer.Option(help="Download a packaged model that is not in the cache yet.")
    ] = False,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object instead (its keys are listed above; sizes in bytes).",
        ),
    ] = False,
) -> None:
    """Say which path MODEL takes and why, whether speculation is exact there, its family,
    shape and quantization mix, the memory of its weights and KV cache, which methods run
    and which draft fits. Reads metadata and the tensor table only: no engine is built,
    nothing is timed, no weight is read.

    --json keys: model, file (the .gguf or null), family (GGUF architecture or model_type),
    path (blocks | dense | transformers), why_path, dtype, layers, hidden_size,
    intermediate_size, heads, kv_heads, head_dim, vocab_size, context_length, rope_theta,
    rope_scaling (null: plain rope), sliding_window; tensors (GGUF: a list of {type, runs:
    blocks | float32 | vector, count, file_bytes, held_bytes}), blocks_refused (why
    --quantization gguf would refuse it; null: it would run); weights_bytes (resident, as
    the engine holds them), kv_bytes_per_token, max_context (as asked), context (as the
    engine keeps it), kv_bytes (the target's cache at that context); pass_rows, padded,
    exact (stats.exact of speculative methods), why_inexact; methods (a list of {method,
    runs, why}); draft ({model, compatible, why, path, weights_bytes, kv_bytes,
    quantization}); eagle_head (the trained head's folder, or null)."""
    from understudy.config import UnderstudyError
    from understudy.engine.inspect import inspect_model

    try:
        report = inspect_model(
            model, draft, max_context, dtype=dtype, quantization=quantization, fetch=fetch
        )
    except UnderstudyError as err:
        fail(str(err))
        return
    if json_out:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
        return
    show(report.to_dict(), Console(highlight=False))


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def yes(flag: bool | None) -> str:
    return "[green]yes[/green]" if flag else "[red]no[/red]"


def show(r: dict, out: Console) -> None:
    """The report as a readable summary."""
    file = r["file"] if r["file"] not in (None, r["model"]) else None
    out.print(f"[bold]{r['model']}[/bold]" + (f"  [dim]{file}[/dim]" if file else ""))
    out.print(f"[bold]path[/bold]     {PATH_NAMES[r['path']]}, {r['dtype']}")
    out.print(f"         [dim]{r['why_path']}[/dim]")
    passes = (
        f"passes padded to {r['pass_rows']} rows" if r["padded"]
        else f"passes of up to {r['pass_rows']} rows on row-invariant kernels"
    )  # fmt: skip
    exact = (
        "greedy speculative output is plain decoding's, bit for bit" if r["exact"]
        else f"greedy output may differ from plain decoding on near-ties: {r['why_inexact']}"
    )  # fmt: skip
    out.print(f"[bold]exact[/bold]    {yes(r['exact'])}: {exact} ({passes})")
    heads = f"heads {r['heads']} / kv {r['kv_heads']} x {r['head_dim']}"
    out.print(
        f"[bold]family[/bold]   {r['family']}: {r['layers']} layers, hidden {r['hidden_size']}, "
        f"ffn {r['intermediate_size']}, {heads}, vocab {r['vocab_size']:,}, "
        f"context {r['context_length']:,}"
    )
    scaling = r["rope_scaling"]
    kind = "plain" if scaling is None else scaling.get("kind", scaling.get("rope_type"))
    rope = "no rope" if r["rope_theta"] is None else f"rope theta {r['rope_theta']:g} ({kind})"
    window = "" if r["sliding_window"] is None else f", sliding window {r['sliding_window']}"
    out.print(f"         {rope}{window}")
    if r["tensors"]:
        show_tensors(r, out)
    context = f"{r['context']} tokens" + (
        "" if r["context"] == r["max_context"] else f" (lowered from {r['max_context']})"
    )
    out.print(
        f"[bold]memory[/bold]   weights {size(r['weights_bytes'])}, KV "
        f"{size(r['kv_bytes_per_token'])} a token, {size(r['kv_bytes'])} at {context}"
    )
    show_methods(r, out)


def show_tensors(r: dict, out: Console) -> None:
    table = Table(title="tensors (as the blocks path runs them)", title_justify="left")
    for name in ("type", "runs", "count", "in the file", "held"):
        table.add_column(name, justify="left" if name in ("type", "runs") else "right")
    for g in r["tensors"]:
        table.add_row(
            g["type"], g["runs"], str(g["count"]), size(g["file_bytes"]), size(g["held_bytes"])
        )
    out.print(table)
    refused = r["blocks_refused"]
    out.print(
        "[bold]blocks[/bold]   --quantization gguf: "
        + ("runs" if refused is None else f"[red]refused[/red]: {refused}")
    )


def show_methods(r: dict, out: Console) -> None:
    table = Table(title="methods", title_justify="left")
    table.add_column("method")
    table.add_column("runs")
    table.add_column("why", overflow="fold")
    for m in r["methods"]:
        table.add_row(m["method"], yes(m["runs"]), m["why"])
    out.print(table)
    d = r["draft"]
    if d["compatible"] is None:
        out.print(f"[bold]draft[/bold]    {d['why']}")
    elif not d["compatible"]:
        out.print(f"[bold]draft[/bold]    {d['model']}: [red]incompatible[/red]: {d['why']}")
    else:
        out.print(f"[bold]draft[/bold]    {d['model']}: compatible, {d['why']}")
        out.print(
            f"         {PATH_NAMES[d['path']]}; weights {size(d['weights_bytes'])}, KV "
            f"{size(d['kv_bytes'])}; draft_quantization auto: {d['quantization'] or 'none'}"
        )

"""The `understudy` command line: generate, simulate, serve and bench.

Errors a user can cause (bad flags, unknown models, a prompt too long) print one line and
exit with status 2; no traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from understudy.cli.bench import bench
from understudy.cli.common import fail
from understudy.cli.inspect import inspect_command
from understudy.cli.serve import serve
from understudy.cli.simulate import simulate
from understudy.cli.train_head import pack_head_command, train_head_command
from understudy.config import DType, Method, Quantization

app = typer.Typer(
    help="Lossless speculative decoding: a cheap drafter guesses, the target verifies.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("simulate", help="The theory: expected tokens per round, speedup and the best K.")(
    simulate
)
app.command("bench", help="Methods and peers side by side on the same prompts, with plots.")(bench)
app.command(
    "train-head", help="Train the target's own prediction head for method=eagle (resumable)."
)(train_head_command)
app.command("pack-head", help="Pack a trained head (int4) to ship it with the package.")(
    pack_head_command
)
app.command(
    "inspect", short_help="What the engine would do with a model, without loading its weights."
)(inspect_command)
app.command("serve", help="Serve the engine over OpenAI's HTTP API, with the live Lab at /lab.")(
    serve
)

ORIGIN_STYLE = {"accepted": "green", "corrected": "yellow", "bonus": "cyan", "target": "default"}


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt text (or a chat message with --chat).")],
    target: Annotated[
        str | None, typer.Option(help="Target model: registry name, HF id, directory or .gguf.")
    ] = None,
    draft: Annotated[
        str | None,
        typer.Option(help="Draft model (method=draft) or trained head folder (method=eagle)."),
    ] = None,
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
    max_tokens: Annotated[int, typer.Option(help="Maximum new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    min_p: Annotated[float, typer.Option()] = 0.0,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    chat: Annotated[
        bool, typer.Option(help="Treat PROMPT as a user message; apply the chat template.")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of streaming.")
    ] = False,
    dtype: Annotated[
        DType, typer.Option(help="Weights' dtype (auto: bf16 where native).")
    ] = "auto",
    quantization: Annotated[
        Quantization, typer.Option(help="gguf: a GGUF model from its own blocks, on a CPU.")
    ] = "auto",
    max_context: Annotated[int, typer.Option(help="Prompt + generation, in tokens.")] = 4096,
    draft_quantization: Annotated[
        str,
        typer.Option(
            help="auto | none | int8 | int4 | int4-g32 (the draft model or eagle's head); "
            "q4_0 (a GGUF draft's Q5_0 tensors as Q4_0; eagle's head in Q4_0 blocks), "
            "q8_0 (eagle's head in Q8_0 blocks)."
        ),
    ] = "auto",
    option: Annotated[
        list[str] | None,
        typer.Option(help="Drafter option key=value (repeatable), e.g. prompt_lookup_max=3."),
    ] = None,
) -> None:
    """Generate text, streaming tokens coloured by origin: accepted (green), corrected
    (yellow), bonus (cyan), target-only (plain)."""
    from understudy.config import SamplingParams, UnderstudyError, parse_options
    from understudy.engine.engine import Engine

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            stop=list(stop or []),
        )
        drafter_options = parse_options(option or [])
        engine = Engine.from_pretrained(
            target=target,
            draft=draft,
            method=method,
            num_speculative_tokens=k,
            dtype=dtype,
            quantization=quantization,
            max_context=max_context,
            draft_quantization=draft_quantization,
            **drafter_options,
        )
        request = [{"role": "user", "content": prompt}] if chat else prompt
        stream = engine.stream(request, params)
        out = Console(highlight=False, soft_wrap=True)
        for event in stream:
            if not json_out:
                out.print(event.text, style=ORIGIN_STYLE[event.origin], end="")
    except UnderstudyError as err:
        fail(str(err))
        return
    result = stream.output
    assert result is not None
    if json_out:
        payload = {
            "text": result.text,
            "token_ids": result.token_ids,
            "stats": result.stats.to_dict(),
        }
        sys.stdout.write(json.dumps(payload) + "\n")
        return
    s = result.stats
    err = Console(stderr=True, highlight=False)
    err.print()
    err.print(
        f"[dim]{s.method} k={s.k}: {s.tokens} tokens in {s.wall_s:.2f}s "
        f"({s.tokens_per_s:.2f} tok/s), {s.target_passes} target passes, "
        f"{s.tokens_per_pass:.2f} tokens/pass, acceptance {s.acceptance_rate:.0%}[/dim]"
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()

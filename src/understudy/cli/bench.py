"""`understudy bench`: methods side by side on the same prompts, with the peers and plots.

    understudy bench                                   # headline: 3 prompts/category, 96 tokens
    understudy bench --compare hf                      # + transformers' generate() peers
    understudy bench --compare hf,llama.cpp            # + llama.cpp's programs (built by you)
    understudy bench --prompts my.jsonl --methods none,draft,draft:k=2 --repeats 3
    understudy bench --per-category 0                  # every shipped prompt

Writes OUT/results.json (rewritten after every run), OUT/results.md and OUT/*.png.
Ctrl-C stops early and keeps what has been measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from understudy.bench.prompts import DEFAULT_PER_CATEGORY

INTERRUPTED_EXIT_CODE = 130


def bench(
    prompts: Annotated[
        list[str] | None,
        typer.Option(
            "--prompts",
            help="Prompt set: a .jsonl file or a shipped set (completion, editing, chat, "
            "summarize); repeatable or comma-separated. Default: the four shipped sets.",
        ),
    ] = None,
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated methods, each optionally with options, e.g. "
            "none,draft,draft:k=2,ngram. 'none' (the baseline) is always run."
        ),
    ] = "none,draft",
    k: Annotated[
        str, typer.Option("-k", "--k", help="num_speculative_tokens: 1..64 or auto.")
    ] = "auto",
    max_tokens: Annotated[int, typer.Option(help="New tokens per prompt.")] = 96,
    temperature: Annotated[float, typer.Option(help="0 = greedy (identity is checked).")] = 0.0,
    repeats: Annotated[int, typer.Option(help="Repeat the whole run; medians and spread.")] = 1,
    compare: Annotated[
        str | None,
        typer.Option(
            help="hf: also run transformers' generate() plain, with assistant_model= and with "
            "prompt_lookup_num_tokens= on the same weights; or a comma list of hf-plain, "
            "hf-assisted, hf-lookup. llama.cpp: also run llama.cpp's llama-speculative-simple "
            "(llama.cpp-plain, llama.cpp-draft, llama.cpp-draft:k=N; greedy) and llama-bench "
            "on the same GGUF files; it needs those programs built (see --llama-cpp-bin)."
        ),
    ] = None,
    llama_cpp_bin: Annotated[
        str | None,
        typer.Option(
            help="Folder of llama.cpp's llama-bench and llama-speculative-simple (build them "
            "from llama.cpp's sources with cmake). Default: $UNDERSTUDY_LLAMA_CPP_BIN, else "
            "<cache>/llama.cpp/bin, else PATH."
        ),
    ] = None,
    per_category: Annotated[
        int,
        typer.Option(help="Use the first N prompts of each category (0 = all of them)."),
    ] = DEFAULT_PER_CATEGORY,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("bench-results"),
    target: Annotated[
        str | None, typer.Option(help="Target model: registry name, HF id, directory or .gguf.")
    ] = None,
    draft: Annotated[str | None, typer.Option(help="Draft model.")] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    max_context: Annotated[int, typer.Option(help="Prompt + generation, in tokens.")] = 4096,
    seed: Annotated[int, typer.Option(help="Sampling seed (temperature > 0).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    resume: Annotated[
        bool,
        typer.Option(
            help="Keep the prompts an interrupted run with the same settings finished in "
            "OUT/results.json, and run only the rest."
        ),
    ] = False,
) -> None:
    """Benchmark methods side by side (interleaved prompt by prompt): tokens/s, speedup vs
    plain, tokens per pass, acceptance, identity with plain decoding; table, JSON, plots."""
    from rich.console import Console

    from understudy.bench.run import Bench, BenchConfig
    from understudy.config import UnderstudyError

    specs = [s.strip() for item in prompts or [] for s in item.split(",") if s.strip()]
    config = BenchConfig(
        prompts=specs or None,
        methods=methods,
        k=k,
        max_tokens=max_tokens,
        temperature=temperature,
        repeats=repeats,
        compare=compare,
        per_category=per_category,
        out=out,
        target=target,
        draft=draft,
        dtype=dtype,
        max_context=max_context,
        seed=seed,
        resume=resume,
        llama_cpp_bin=llama_cpp_bin,
    )
    err = Console(stderr=True, highlight=False)
    runner = Bench(config, err, progress=progress)
    try:
        runner.run()
    except UnderstudyError as error:
        err.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # before the first run (loading): nothing to keep
        err.print("[yellow]interrupted[/yellow]")
        raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)  # a log file: do not squeeze the table
    console.print(runner.table())
    results = runner.results
    err.print(
        f"[dim]{len(results['runs'])}/{results['planned_runs']} runs in "
        f"{results['elapsed_s']:.0f}s; wrote {out / 'results.json'}, {out / 'results.md'}"
        + "".join(f", {out / p}" for p in results.get("plots", []))
        + "[/dim]"
    )
    if results["interrupted"]:
        raise typer.Exit(INTERRUPTED_EXIT_CODE)


def main() -> None:
    typer.run(bench)


if __name__ == "__main__":
    main()

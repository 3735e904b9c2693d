"""`understudy bench`: methods side by side on the same prompts, with the peers and plots.

    understudy bench                                   # headline: 3 prompts/category, 96 tokens
    understudy bench --compare hf                      # + transformers' generate() peers
    understudy bench --compare hf,llama.cpp            # + llama.cpp's programs (built by you)
    understudy bench --prompts my.jsonl --methods none,draft,draft:k=2 --repeats 3
    understudy bench --per-category 0                  # every shipped prompt
    understudy bench --concurrency 1,2,4,8,16          # serving: the HTTP server under load
    understudy bench --concurrency 1,2,4,8 --compare vllm   # + vLLM's server (vllm_peer.py)
    understudy bench --soak --clients 32 --duration 10m    # soak: invariants under load (soak.py)

Writes OUT/results.json (rewritten after every run), OUT/results.md and OUT/*.png; the
soak run OUT/soak.json, and it exits 1 when one of its invariants fails.
Ctrl-C stops early and keeps what has been measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from understudy.bench.prompts import DEFAULT_PER_CATEGORY
from understudy.config import DType

INTERRUPTED_EXIT_CODE = 130
SOAK_FAILED_EXIT_CODE = 1


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
        str | None,
        typer.Option(
            help="Comma-separated methods, each optionally with options, e.g. "
            "none,draft,draft:k=2,ngram. 'none' (the baseline) is always run. Default: "
            "none,draft; the soak run takes one method name (default: the server's)."
        ),
    ] = None,
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
            "hf-assisted, hf-lookup. llama.cpp: also run llama.cpp's llama-completion "
            "(llama.cpp-plain) and llama-speculative-simple (llama.cpp-draft, "
            "llama.cpp-draft:k=N; greedy) and llama-bench "
            "on the same GGUF files; it needs those programs built (see --llama-cpp-bin). "
            "vllm (serving mode only): also run vLLM's OpenAI server (vllm-plain, "
            "vllm-draft[:k=N], vllm-ngram[:k=N]) on the same GGUF dequantized to bfloat16; "
            "it needs vLLM in an environment of its own, whose python $UNDERSTUDY_VLLM_PYTHON "
            "names."
        ),
    ] = None,
    llama_cpp_bin: Annotated[
        str | None,
        typer.Option(
            help="Folder of llama.cpp's llama-bench, llama-completion and "
            "llama-speculative-simple (build them "
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
    dtype: Annotated[
        DType, typer.Option(help="Weights' dtype (auto: bf16 where native).")
    ] = "auto",
    max_context: Annotated[int, typer.Option(help="Prompt + generation, in tokens.")] = 4096,
    seed: Annotated[int, typer.Option(help="Sampling seed (temperature > 0).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="Serving mode: drive the real HTTP server (`understudy serve`, one per "
            "method) with this many concurrent clients, e.g. 1,2,4,8,16; reports aggregate "
            "tokens/s, latency and time to first token p50/p95, identity across levels, "
            "and throughput.png."
        ),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(help="Serving mode: requests at each concurrency (default: the largest)."),
    ] = None,
    soak: Annotated[
        bool,
        typer.Option(
            help="Soak run: --clients clients send a seeded mix of requests (both routes, "
            "streamed, cancelled, n > 1, logprobs, constrained, sampled, malformed) to one "
            "real server for --duration; checks no 5xx, every status as it must be, greedy "
            "answers equal to their solo answers, flat resident memory, no leaked seat."
        ),
    ] = False,
    clients: Annotated[
        int | None, typer.Option(help="Soak run: concurrent clients (default 32).")
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option(
            help="Soak run: how long the clients send: seconds, or 90s, 10m, 1h (default 10m)."
        ),
    ] = None,
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
    err = Console(stderr=True, highlight=False)
    if soak:
        refused = [flag for flag, used in (
            ("--concurrency", concurrency is not None), ("--requests", requests is not None),
            ("--compare", compare is not None), ("--repeats", repeats != 1),
            ("--resume", resume), ("--llama-cpp-bin", llama_cpp_bin is not None),
            ("--temperature (it mixes its own)", temperature != 0)) if used]  # fmt: skip
        soak_run(err, refused, specs or None, methods, k, max_tokens, per_category, out, target,
                 draft, dtype, max_context, seed, progress, clients, duration)  # fmt: skip
        return
    if clients is not None or duration is not None:
        err.print("[red]error:[/red] --clients and --duration belong to the soak run: give --soak")
        raise typer.Exit(2)
    methods = methods or "none,draft"
    if concurrency is not None:
        from understudy.bench.vllm_peer import is_vllm

        peers = [p.strip() for p in (compare or "").split(",") if p.strip()]
        refused = [flag for flag, used in (("--resume", resume), ("--repeats", repeats != 1),
                                           (f"--compare {compare}", not all(map(is_vllm, peers))))
                   if used]  # fmt: skip
        if refused:
            err.print(
                f"[red]error:[/red] serving mode (--concurrency) does not take {refused[0]}"
                + (" (its peer is vllm)" if refused[0].startswith("--compare") else "")
            )
            raise typer.Exit(2)
        serving(err, specs or None, methods, k, max_tokens, temperature, per_category, out,
                target, draft, dtype, max_context, seed, concurrency, requests, peers)  # fmt: skip
        return
    elif requests is not None:
        err.print("[red]error:[/red] --requests belongs to serving mode: give --concurrency")
        raise typer.Exit(2)
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


def serving(err, prompts, methods, k, max_tokens, temperature, per_category, out, target,
            draft, dtype, max_context, seed, concurrency, requests, peers) -> None:  # fmt: skip
    """`understudy bench --concurrency ...`: the serving benchmark (bench/serving.py)."""
    from rich.console import Console

    from understudy.bench import serving_report
    from understudy.bench.serving import ServingConfig, parse_concurrency, run_serving
    from understudy.config import UnderstudyError

    try:
        levels = parse_concurrency(concurrency)
        config = ServingConfig(
            concurrency=levels,
            methods=[m.strip() for m in methods.split(",") if m.strip()],
            requests=requests or max(levels),
            max_tokens=max_tokens, temperature=temperature, seed=seed, k=k,
            prompts=prompts, per_category=per_category, target=target, draft=draft,
            dtype=dtype, max_context=max_context, out=out, compare=peers,
        )  # fmt: skip
        results = run_serving(config, lambda line: err.print(f"[dim]{line}[/dim]"))
    except UnderstudyError as error:
        err.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/yellow]: what was measured is in {out / 'serving.json'}")
        raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
    (out / "serving.md").write_text(serving_report.markdown(results))
    picture = serving_report.plot(results, out)
    Console(highlight=False, width=160).print(serving_report.rich_table(results))
    err.print(f"[dim]wrote {out / 'serving.json'}, {out / 'serving.md'}, {picture}[/dim]")


def soak_run(err, refused, prompts, method, k, max_tokens, per_category, out, target, draft,
             dtype, max_context, seed, progress, clients, duration) -> None:  # fmt: skip
    """`understudy bench --soak`: the soak run (bench/soak.py); exits 1 if an invariant fails.
    `refused`: the flags of other modes that were given."""
    from rich.console import Console

    from understudy.bench.soak import SoakConfig, parse_duration, run_soak
    from understudy.bench.soak_report import rich_tables
    from understudy.config import UnderstudyError

    if refused:
        err.print(f"[red]error:[/red] the soak run (--soak) does not take {refused[0]}")
        raise typer.Exit(2)
    try:
        config = SoakConfig(
            clients=32 if clients is None else clients,
            duration_s=parse_duration(duration or "10m"),
            method=method, k=k, max_tokens=max_tokens, seed=seed, prompts=prompts,
            per_category=per_category, target=target, draft=draft, dtype=dtype,
            max_context=max_context, out=out,
        )  # fmt: skip
        say = (lambda line: err.print(f"[dim]{line}[/dim]")) if progress else (lambda line: None)
        results = run_soak(config, say)
    except UnderstudyError as error:
        err.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]: a soak run is judged whole; nothing was kept")
        raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
    console = Console(highlight=False, width=160)
    for table in rich_tables(results):
        console.print(table)
    verdict = "every invariant held" if results["ok"] else "[red]an invariant failed[/red]"
    err.print(f"{verdict}; wrote {out / 'soak.json'}")
    if not results["ok"]:
        raise typer.Exit(SOAK_FAILED_EXIT_CODE)


def main() -> None:
    typer.run(bench)


if __name__ == "__main__":
    main()

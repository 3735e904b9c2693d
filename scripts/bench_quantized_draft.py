"""Quantized draft benchmark (issue 9): fp32 / bf16 / int8 / int4 drafts side by side.

    .venv/bin/python scripts/bench_quantized_draft.py steps    --rounds 15
    .venv/bin/python scripts/bench_quantized_draft.py profile  --steps 10 --threads 1
    .venv/bin/python scripts/bench_quantized_draft.py generate --reps 2 --max-tokens 64 -k 2
    .venv/bin/python scripts/bench_quantized_draft.py accept   --prompts 6 --max-tokens 96

Results and how to read them: docs/quantized-draft.md. Run alone on the machine.

One process builds the default engine with an unquantized draft
(`Engine.from_pretrained(method="draft", num_speculative_tokens=2, draft_quantization=None)`:
fp32 on a CPU without native bf16, so the target keeps its flat path), then makes the other
drafts from its fp32 draft (bf16: the cached bf16 conversion;
int8 / int4: `load_or_quantize` on a copy that shares the fp32 parameters, packed weights
cached next to the converted weights). Every measurement interleaves the variants (round
robin, the order rotated each round) and reports medians, because the machine is shared.
Results are printed and written as JSON (--out).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from understudy import Engine, SamplingParams
from understudy.drafters.draft_model import DraftModelProposer
from understudy.models.fetch import cache_dir
from understudy.models.loader import load_model
from understudy.models.quant import load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT, resolve_packaged
from understudy.models.runner import Runner

QUANT = ("int8", "int4", "int4-g32")


def load_avg() -> float:
    return os.getloadavg()[0]


def converted_dir(spec: str, dtype: str) -> Path:
    """The loader's cache directory of a packaged model (models/loader.py `_load_gguf`)."""
    return cache_dir() / "converted" / f"{resolve_packaged(spec).sha256[:24]}-{dtype}"


def build(variants: list[str]) -> tuple[Engine, dict[str, torch.nn.Module], dict]:
    info: dict = {}
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(
        method="draft", num_speculative_tokens=2, draft_quantization=None
    )
    info["engine_load_s"] = time.perf_counter() - t0
    info["target_dtype"] = str(engine.target.model.dtype)
    info["verify_rows"] = engine.runner.rows
    fp32 = engine.drafter.runner.model
    drafts: dict[str, torch.nn.Module] = {}
    for name in variants:
        if name == "fp32":
            drafts[name] = fp32
        elif name == "bf16":
            drafts[name] = load_model(DEFAULT_DRAFT, "bfloat16").model
        else:
            clone = copy.deepcopy(fp32, memo={id(p): p for p in fp32.parameters()})
            t0 = time.perf_counter()
            load_or_quantize(clone, converted_dir(DEFAULT_DRAFT, "float32"), name)
            q = clone.quantization
            info[f"{name}_load_s"] = time.perf_counter() - t0
            info[f"{name}_from_cache"] = q.from_cache
            info[f"{name}_linear_MB"] = [q.bytes_before / 1e6, q.bytes_after / 1e6]
            info[f"{name}_skipped"] = q.skipped
            drafts[name] = clone
    return engine, drafts, info


def rotated(items: list, i: int) -> list:
    i %= len(items)
    return items[i:] + items[:i]


def cmd_steps(args: argparse.Namespace) -> dict:
    engine, drafts, info = build(args.variants)
    context = torch.randint(
        1000, 30000, (args.context,), generator=torch.Generator().manual_seed(0)
    )
    runners = {name: Runner(model, 1024) for name, model in drafts.items()}
    target = Runner(engine.target.model, 1024, rows=engine.runner.rows)
    for r in (*runners.values(), target):
        r.prefill(context)
    times: dict[str, dict[int, list[float]]] = {n: {1: [], 2: [], 3: []} for n in runners}
    target_times: list[float] = []
    loads = [load_avg()]
    names = list(runners)
    for i in range(args.rounds):
        for name in rotated(names, i):
            for rows in (1, 2, 3):
                tokens = context[rows : 2 * rows]
                t0 = time.perf_counter()
                runners[name].extend(tokens, last_only=True)
                times[name][rows].append((time.perf_counter() - t0) * 1e3)
                runners[name].truncate(args.context)
        t0 = time.perf_counter()
        target.extend(context[:1])  # a target pass always holds verify_rows rows
        target_times.append((time.perf_counter() - t0) * 1e3)
        target.truncate(args.context)
        loads.append(load_avg())
    target_ms = statistics.median(target_times)
    result = {
        "info": info,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "load_avg": [min(loads), statistics.median(loads), max(loads)],
        "target_pass_ms": target_ms,
        "target_pass_ms_min": min(target_times),
        "draft_step_ms": {
            n: {r: statistics.median(v) for r, v in by_rows.items()} for n, by_rows in times.items()
        },
        "draft_step_ms_min": {
            n: {r: min(v) for r, v in by_rows.items()} for n, by_rows in times.items()
        },
    }
    print(
        f"target pass ({engine.runner.rows} rows): {target_ms:.1f} ms (min {min(target_times):.1f})"
    )
    print("| draft | 1 row | 2 rows | 3 rows | c = 1-row step / target pass |")
    print("|---|---|---|---|---|")
    for n, by_rows in result["draft_step_ms"].items():
        mins = result["draft_step_ms_min"][n]
        cells = " | ".join(f"{by_rows[r]:.1f} (min {mins[r]:.1f})" for r in (1, 2, 3))
        print(f"| {n} | {cells} | {by_rows[1] / target_ms:.2f} |")
    return result


MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
}


def cmd_profile(args: argparse.Namespace) -> dict:
    from torch.profiler import ProfilerActivity, profile

    _, drafts, info = build(args.variants)
    context = torch.randint(
        1000, 30000, (args.context,), generator=torch.Generator().manual_seed(0)
    )
    result: dict = {"info": info, "context": args.context, "split": {}}
    print(
        "| draft | step ms (no profiler) | matmul ms | attention (SDPA) ms | everything else ms |"
    )
    print("|---|---|---|---|---|")
    for name, model in drafts.items():
        runner = Runner(model, 1024)
        runner.prefill(context)
        token = context[:1]

        def step(runner: Runner = runner, token: torch.Tensor = token) -> None:
            runner.extend(token, last_only=True)
            runner.truncate(args.context)

        for _ in range(3):
            step()
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        events = prof.key_averages()
        matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
        attention = sum(
            e.cpu_time_total for e in events if e.key == "aten::scaled_dot_product_attention"
        )
        counts = {e.key: e.count // args.steps for e in events if e.key in MATMUL_OPS}
        ops_per_step = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
        wall = statistics.median(walls)
        mm_ms, attn_ms = matmul / 1e3 / args.steps, attention / 1e3 / args.steps
        result["split"][name] = {
            "step_ms": wall,
            "matmul_ms": mm_ms,
            "attention_ms": attn_ms,
            "rest_ms": wall - mm_ms - attn_ms,
            "matmul_calls": counts,
            "aten_ops_per_step": ops_per_step,
            "top": [
                (e.key, e.self_cpu_time_total / 1e3 / args.steps, e.count // args.steps)
                for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
            ],
        }
        print(
            f"| {name} | {wall:.1f} | {mm_ms:.1f} | {attn_ms:.1f} | {wall - mm_ms - attn_ms:.1f} |"
        )
    return result


def completion_prompts(n: int) -> list[tuple[str, str]]:
    from understudy.bench.prompts import shipped_path

    lines = shipped_path("completion").read_text().splitlines()[:n]
    return [(o["id"], o["prompt"]) for o in map(json.loads, lines)]


def cmd_generate(args: argparse.Namespace) -> dict:
    engine, drafts, info = build(args.variants)
    engines = {"none": engine.with_method("none")}
    for name, model in drafts.items():
        proposer = DraftModelProposer(Runner(model, engine.max_context))
        engines[name] = Engine(
            engine.target, proposer, "draft", args.k, engine.max_context, engine.runner.rows
        )
    prompts = completion_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runs: list[dict] = []
    names = list(engines)
    loads = [load_avg()]
    for rep in range(args.reps):
        for pi, (pid, prompt) in enumerate(prompts):
            for name in rotated(names, rep * len(prompts) + pi):
                cpu0 = time.process_time()
                out = engines[name].generate(prompt, params)
                cpu_s = time.process_time() - cpu0
                s = out.stats
                runs.append(
                    {
                        "cpu_s": cpu_s,
                        "rep": rep,
                        "prompt": pid,
                        "variant": name,
                        "token_ids": out.token_ids,
                        "tokens": s.tokens,
                        "wall_s": s.wall_s,
                        "decode_s": s.decode_s,
                        "draft_s": s.draft_s,
                        "verify_s": s.verify_s,
                        "rounds": s.rounds,
                        "drafted": s.drafted,
                        "accepted": s.accepted,
                    }
                )
                loads.append(load_avg())
                if args.out:  # partial results survive an interrupted run
                    with args.out.with_suffix(".runs.jsonl").open("a") as f:
                        f.write(json.dumps(runs[-1]) + "\n")
                print(
                    f"rep {rep} {pid} {name:9s} {s.tokens} tok {s.wall_s:6.2f} s "
                    f"acc {s.accepted}/{s.drafted} load {loads[-1]:.1f}",
                    flush=True,
                )
    return {
        "info": info,
        "load_avg": [min(loads), statistics.median(loads), max(loads)],
        "k": args.k,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "summary": summarize(runs, names, [p for p, _ in prompts]),
    }


def summarize(runs: list[dict], names: list[str], prompt_ids: list[str]) -> dict:
    """Per variant: tokens/s = sum of tokens / sum over prompts of the median wall time;
    acceptance over all runs; identical = every run's tokens equal the plain run's."""
    plain = {(r["rep"], r["prompt"]): r["token_ids"] for r in runs if r["variant"] == "none"}
    table = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        wall = sum(
            statistics.median(r["wall_s"] for r in mine if r["prompt"] == p) for p in prompt_ids
        )
        tokens = sum(next(r["tokens"] for r in mine if r["prompt"] == p) for p in prompt_ids)
        drafted, accepted, rounds = (
            sum(r[k] for r in mine) for k in ("drafted", "accepted", "rounds")
        )
        draft_s = sum(r["draft_s"] for r in mine)
        cpu = sum(
            statistics.median(r["cpu_s"] for r in mine if r["prompt"] == p) for p in prompt_ids
        )
        table[name] = {
            "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + rounds) / rounds if rounds else 1.0,
            "draft_ms_per_round": 1e3 * draft_s / rounds if rounds else 0.0,
            "verify_ms_per_pass": 1e3 * sum(r["verify_s"] for r in mine) / max(rounds, 1),
            "identical_to_plain": all(
                r["token_ids"] == plain[(r["rep"], r["prompt"])] for r in mine
            ),
        }
    base = table["none"]["tokens_per_s"]
    cpu_base = table["none"]["tokens_per_cpu_s"]
    print(
        "| draft | tok/s | speedup | tok per CPU-s | CPU speedup | acceptance "
        "| mean accepted length | draft ms/round | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in table.items():
        row["speedup"] = row["tokens_per_s"] / base
        row["cpu_speedup"] = row["tokens_per_cpu_s"] / cpu_base
        acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.3f}"
        print(
            f"| {name} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
            f"{row['tokens_per_cpu_s']:.2f} | {row['cpu_speedup']:.2f}x | {acc} | "
            f"{row['mean_accepted_length']:.2f} | {row['draft_ms_per_round']:.0f} | "
            f"{row['identical_to_plain']} |"
        )
    return table


def chain_acceptance(agree: list[bool], k: int) -> tuple[int, int, int]:
    """Greedy chain drafting replayed on a teacher-forced agreement vector: agree[i] says the
    draft's argmax after the target's first i output tokens is the target's token i. A round
    at position j keeps guesses while they agree (a kept guess IS the target's token, so the
    next guess sees the same prefix as in teacher forcing) and the target adds one token.
    Position 0 comes from the prefill. Returns (rounds, drafted, accepted)."""
    rounds = drafted = accepted = 0
    j, n = 1, len(agree)
    while j < n:
        kk = min(k, n - 1 - j)  # the engine drafts at most remaining - 1
        a = 0
        while a < kk and agree[j + a]:
            a += 1
        rounds, drafted, accepted = rounds + 1, drafted + kk, accepted + a
        j += a + 1
    return rounds, drafted, accepted


def cmd_accept(args: argparse.Namespace) -> dict:
    """Teacher-forced agreement of each draft with the target's greedy output, on more
    prompts than `generate` can afford; chain acceptance for K = 1..4 replayed from it."""
    from understudy.bench.prompts import shipped_path

    engine, drafts, info = build(args.variants)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    per_variant: dict[str, dict[str, list[bool]]] = {n: {} for n in drafts}
    for category in args.categories:
        lines = shipped_path(category).read_text().splitlines()[: args.prompts]
        for obj in map(json.loads, lines):
            prompt = obj.get("prompt", obj.get("messages"))
            out = engine.generate(prompt, params)  # == the target's own greedy output
            seq = torch.tensor(out.prompt_token_ids + out.token_ids)
            start = len(out.prompt_token_ids) - 1  # row predicting output token 0
            for name, model in drafts.items():
                runner = Runner(model, 2048)
                logits = runner.extend(seq[:-1])  # [n - 1, V], one pass
                guess = logits[start:].argmax(-1).tolist()
                per_variant[name][obj["id"]] = [
                    g == t for g, t in zip(guess, out.token_ids, strict=True)
                ]
            print(obj["id"], len(out.token_ids), flush=True)
    summary: dict = {}
    for name, agree_by_prompt in per_variant.items():
        row: dict = {}
        for category in args.categories:
            vecs = [v for pid, v in agree_by_prompt.items() if pid.startswith(category)]
            flat = [a for v in vecs for a in v[1:]]
            row[category] = {"agreement": sum(flat) / len(flat)}
            for k in (1, 2, 3, 4):
                r, d, a = (
                    sum(x) for x in zip(*(chain_acceptance(v, k) for v in vecs), strict=True)
                )
                row[category][f"k{k}"] = {
                    "acceptance": a / d,
                    "mean_accepted_length": (a + r) / r,
                }
        summary[name] = row
    print(
        "| draft | "
        + " | ".join(f"{c} agreement | {c} K=2 acceptance" for c in args.categories)
        + " |"
    )
    print("|---|" + "---|---|" * len(args.categories))
    for name, row in summary.items():
        cells = " | ".join(
            f"{row[c]['agreement']:.3f} | {row[c]['k2']['acceptance']:.3f}" for c in args.categories
        )
        print(f"| {name} | {cells} |")
    return {"info": info, "summary": summary, "agree": per_variant}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("steps", "profile", "generate", "accept"))
    parser.add_argument("--variants", nargs="+", default=["fp32", "bf16", *QUANT])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--categories", nargs="+", default=["completion", "editing"])
    parser.add_argument("-k", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    command = {
        "steps": cmd_steps,
        "profile": cmd_profile,
        "generate": cmd_generate,
        "accept": cmd_accept,
    }
    result = command[args.command](args)
    result["argv"] = vars(args) | {"out": str(args.out)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()

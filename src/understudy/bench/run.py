"""`understudy bench`: every method on the same prompts, interleaved, one target in memory.

Order of work: load the target (and draft) once; build one engine per method around them
(plus, with compare="hf", transformers' generate() on the same weight tensors); warm every
engine up on a few tokens; then for each repeat, for each prompt, run every method, the
order rotating from prompt to prompt, so slow drift of a shared machine (other jobs, heat)
falls on all methods alike. results.json is rewritten after every run, and on Ctrl-C the
results so far are summarised, tabled and plotted.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from understudy.bench.against_llama_cpp import against_llama_cpp, against_markdown, interleaved_tg
from understudy.bench.config import SCHEMA, BenchConfig, environment, loadavg, write_json
from understudy.bench.engines import BASELINE, ModelPool, assemble_engine, parse_methods
from understudy.bench.hf_peer import HF_ASSISTED, HF_METHODS, HFPeer
from understudy.bench.llama_cpp import (
    IDENTITY_REFERENCE,
    LLAMA_PLAIN,
    LlamaCppPeer,
    find_programs,
    gguf_file,
    is_llama_cpp,
    llama_cpp_labels,
)
from understudy.bench.llama_cpp_output import llama_bench_markdown
from understudy.bench.prompts import (
    DEFAULT_PER_CATEGORY,
    SHIPPED_SETS,
    BenchPrompt,
    categories,
    load_prompts,
)
from understudy.bench.report import NOTES, markdown_table, rich_table
from understudy.bench.summary import identity_flags, summarize
from understudy.config import SamplingParams, UnderstudyError, parse_num_speculative_tokens
from understudy.engine.draft_setup import resolve_draft_quantization
from understudy.models.registry import DEFAULT_TARGET

WARMUP_TOKENS = 4
COMPARE_CHOICES = ("hf", "hf-plain", "hf-assisted", "hf-lookup")  # hf = all three peers
# and llama.cpp's peers (bench/llama_cpp.py): llama.cpp, llama.cpp-plain, llama.cpp-draft[:k=N]


class Bench:
    """One benchmark run; `run()` returns the results dict (also written to out/results.json)."""

    def __init__(self, config: BenchConfig, console: Any | None = None, progress: bool = True):
        from rich.console import Console

        self.cfg = config
        self.console = console or Console(stderr=True)
        self.progress = progress
        self.results: dict[str, Any] = {}

    # -- set-up ------------------------------------------------------------------------------

    def _validate(self) -> None:
        cfg = self.cfg
        if cfg.repeats < 1:
            raise UnderstudyError(f"repeats must be >= 1, got {cfg.repeats}")
        entries = [] if cfg.compare is None else cfg.compare.split(",")
        peers = [p for p in entries if not is_llama_cpp(p)]
        if cfg.compare is not None and not all(p in COMPARE_CHOICES for p in peers):
            raise UnderstudyError(
                f"--compare takes hf, llama.cpp or a comma list of hf-plain, hf-assisted, "
                f"hf-lookup, llama.cpp-plain, llama.cpp-draft[:k=N] (vllm: serving mode, with "
                f"--concurrency); got {cfg.compare!r}"
            )
        self.peer_methods = HF_METHODS if "hf" in peers else tuple(peers)
        self.llama_methods = llama_cpp_labels([p for p in entries if is_llama_cpp(p)])
        if self.llama_methods:
            if cfg.temperature != 0:
                raise UnderstudyError("--compare llama.cpp runs greedy only: --temperature 0")
            self.llama_programs = find_programs(cfg.llama_cpp_bin)
        self.params = SamplingParams(
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            seed=None if cfg.temperature == 0 else cfg.seed,
        )
        self.prompts = load_prompts(cfg.prompts, cfg.per_category)
        self.categories = categories(self.prompts)
        self.specs = parse_methods(cfg.methods, parse_num_speculative_tokens(cfg.k))

    def _build(self) -> None:
        cfg = self.cfg
        with self.console.status("loading models..."):
            self.pool = ModelPool(cfg.target, cfg.draft, cfg.dtype)
        self.target_model = self.pool.target
        self.engines = {}
        for spec in self.specs:
            with self.console.status(f"building engine {spec.label}..."), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.engines[spec.label] = assemble_engine(spec, self.pool, cfg.max_context)
        self.peer = None
        if self.peer_methods:
            # transformers' assistant is the dense draft (its generate() runs plain nn.Linear)
            wants_draft = self.pool.draft_spec is not None and HF_ASSISTED in self.peer_methods
            assistant = self.pool.draft(None) if wants_draft else None
            with self.console.status("wrapping the same weights for transformers.generate..."):
                self.peer = HFPeer(self.target_model, assistant, self.peer_methods)
        self.llama = None
        if self.llama_methods:
            draft = self.pool.draft_spec
            self.llama = LlamaCppPeer(
                self.llama_programs,
                gguf_file(cfg.target or DEFAULT_TARGET, "--target"),
                gguf_file(draft, "--draft") if draft is not None else None,
                self.llama_methods,
                threads=torch.get_num_threads(),
                max_context=cfg.max_context,
            )
        self.labels = [s.label for s in self.specs] + (self.peer.methods if self.peer else [])
        self.labels += self.llama.methods if self.llama else []
        baseline = self.engines[BASELINE]
        self.prompt_ids = {p.id: baseline.encode(p.prompt) for p in self.prompts}

    def _describe(self) -> dict[str, Any]:
        engines = {
            label: {
                "method": e.method,
                "k": e.k,
                "verify_rows": e.runner.rows,
                "exact": e.exact,
                "cost_ratio": e.costs.draft_step if e.drafter is not None else None,
                "options": spec.options,
                # what was applied to the loaded draft (none to one run from GGUF blocks)
                "draft_quantization": resolve_draft_quantization(
                    spec.draft_quantization, self.pool.draft(spec.draft_quantization), True
                )
                if spec.needs_draft_model
                else None,
            }
            for spec in self.specs
            for label, e in [(spec.label, self.engines[spec.label])]
        }
        if self.peer is not None:
            engines.update(self.peer.describe())
        if self.llama is not None:
            engines.update(self.llama.describe())
        return engines

    # -- running -----------------------------------------------------------------------------

    def _one(self, label: str, p: BenchPrompt, ids: list[int], params: SamplingParams):
        if label in self.engines:
            out = self.engines[label].generate(ids, params)
            return out.token_ids, out.text, out.stats.to_dict()
        if self.llama is not None and label in self.llama.methods:
            run = self.llama.generate(label, self._prompt_text(ids), len(ids), params)
            return None, run.text, run.stats()  # text only: llama.cpp prints no token ids
        assert self.peer is not None
        result = self.peer.generate(label, ids, params)
        tok = self.target_model.tokenizer
        text = tok.decode(result.token_ids, skip_special_tokens=True) if tok is not None else ""
        return result.token_ids, text, result.stats(label)

    def _prompt_text(self, ids: list[int]) -> str:
        """The text llama.cpp is given: our prompt's tokens, special tokens kept."""
        tok = self.target_model.tokenizer
        if tok is None:
            raise UnderstudyError("--compare llama.cpp needs a target with a tokenizer")
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _warmup(self) -> None:
        ids = self.prompt_ids[self.prompts[0].id][:8]
        params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
        with self.console.status("warming up every method..."):
            for label in self.labels:
                self._one(label, self.prompts[0], ids, params)

    def _finalize(self, interrupted: bool, started: float) -> dict[str, Any]:
        res = self.results
        runs = res["runs"]
        llama = self.llama.methods if self.llama is not None else []
        identity_flags(runs, BASELINE, self.params.greedy, dict.fromkeys(llama, IDENTITY_REFERENCE))
        res["summary"] = summarize(runs, self.labels, self.categories, BASELINE)
        res["interrupted"] = interrupted
        res["complete"] = not interrupted and len(runs) == res["planned_runs"]
        res["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        res["elapsed_s"] = time.perf_counter() - started
        res["loadavg_end"] = loadavg()
        return res

    def _title(self) -> str:
        cfg = self.cfg
        env = self.results.get("environment", {})
        return (
            f"understudy bench: {self.target_model.name}, {env.get('dtype', '')}, "
            f"{cfg.max_tokens} tokens, T={cfg.temperature:g}, {len(self.prompts)} prompts"
            + (f", {cfg.repeats} repeats" if cfg.repeats > 1 else "")
            + (" (INTERRUPTED)" if self.results.get("interrupted") else "")
        )

    def _outputs(self) -> None:
        out = Path(self.cfg.out)
        res = self.results
        summary = res["summary"]
        res["plots"] = []
        try:
            from understudy.bench.plots import write_plots

            paths = write_plots(summary, self.labels, self.categories, BASELINE, out, self._title())
            res["plots"] = [p.name for p in paths]
        except ImportError:
            self.console.print("[yellow]matplotlib is not installed: no plots[/yellow]")
        md = markdown_table(summary, self.labels, self.categories)
        env = res["environment"]
        machine = (
            f"{env['cpu']}, {env['cpu_count']} cores, torch {env['torch']}, "
            f"transformers {env['transformers']}; load average {res['loadavg_start']:.1f} at "
            f"start, {res['loadavg_end']:.1f} at the end"
            if res.get("loadavg_start") is not None and res.get("loadavg_end") is not None
            else f"{env['cpu']}, {env['cpu_count']} cores"
        )
        if res.get("llama_bench"):
            md += "\n\n" + llama_bench_markdown(res["llama_bench"])
        if self.llama is not None:
            tg = interleaved_tg(res["llama_bench_interleaved"])
            plain = LLAMA_PLAIN if LLAMA_PLAIN in self.llama.methods else None
            speculative = [m for m in self.llama.methods if m != LLAMA_PLAIN]
            ours = [s.label for s in self.specs]
            res["against_llama_cpp"] = against_llama_cpp(summary, ours, plain, speculative, tg)
            if res["against_llama_cpp"] is not None:
                md += "\n\n" + against_markdown(res["against_llama_cpp"], tg)
        write_json(out / "results.json", res)
        (out / "results.md").write_text(
            f"{self._title()}\n\n`{res['command']}`\n\n{md}\n\n{NOTES}\n\nMachine: {machine}.\n",
            encoding="utf-8",
        )

    def run(self) -> dict[str, Any]:
        """Build every engine, then run every repeat of every prompt with every method;
        on Ctrl-C the runs so far are kept. Writes out/results.json (after every run), the
        table and the plots."""
        from tqdm import tqdm

        cfg = self.cfg
        self._validate()
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        self._build()
        res = self.results = self._fresh_results()
        done = self._resume(out / "results.json") if cfg.resume else set()
        started = time.perf_counter()
        interrupted = False
        bar = tqdm(total=res["planned_runs"], unit="run", disable=not self.progress)
        bar.update(len(res["runs"]))
        try:
            if cfg.warmup:
                self._warmup()
            for rep in range(cfg.repeats):
                for i, p in enumerate(self.prompts):
                    if (rep, p.id) not in done:
                        self._run_prompt(rep, i, p, bar, out / "results.json")
            if self.llama is not None:
                with self.console.status("llama-bench on the GGUF files..."):
                    rows = self.llama.llama_bench(tg=cfg.max_tokens)
                res["llama_bench"] = [row.to_dict() for row in rows]
        except KeyboardInterrupt:
            interrupted = True
            self.console.print("[yellow]interrupted: keeping the runs so far[/yellow]")
        finally:
            bar.close()
            self._finalize(interrupted, started)
            self._outputs()
        return res

    def _fresh_results(self) -> dict[str, Any]:
        """The results before any run: the command, the machine, the engines, the prompts."""
        cfg = self.cfg
        prompts = [
            {"id": p.id, "category": p.category, "source": p.source,
             "prompt_tokens": len(self.prompt_ids[p.id])}
            for p in self.prompts
        ]  # fmt: skip
        return {
            "schema": SCHEMA,
            "command": cfg.command(),
            "config": {**asdict(cfg), "out": str(cfg.out)},
            "environment": environment(self.target_model),
            "baseline": BASELINE,
            "labels": self.labels,
            "categories": self.categories,
            "engines": self._describe(),
            "prompts": prompts,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "loadavg_start": loadavg(),
            "planned_runs": cfg.repeats * len(self.prompts) * len(self.labels),
            "runs": [],
            "llama_bench_interleaved": [],
        }

    def _run_prompt(self, rep: int, i: int, p: BenchPrompt, bar: Any, path: Path) -> None:
        """Every method on the i-th prompt in repeat `rep`, the first one rotating from
        prompt to prompt (a machine's slow drift falls on all alike); then llama-bench's tg
        beside them. `path` (results.json) is rewritten after each run."""
        res = self.results
        shift = (i + rep) % len(self.labels)
        order = self.labels[shift:] + self.labels[:shift]
        for slot, label in enumerate(order):
            bar.set_description(f"r{rep} {p.id} {label}")
            token_ids, text, stats = self._one(label, p, self.prompt_ids[p.id], self.params)
            res["runs"].append(
                {
                    "label": label,
                    "prompt_id": p.id,
                    "category": p.category,
                    "repeat": rep,
                    "slot": slot,
                    "loadavg": loadavg(),
                    "token_ids": token_ids,
                    "text": text,
                    "stats": stats,
                }
            )
            bar.update(1)
            write_json(path, res)
        if self.llama is not None:
            bar.set_description(f"r{rep} {p.id} llama-bench tg")
            row = self.llama.llama_bench_tg(self.cfg.max_tokens)
            res["llama_bench_interleaved"].append(
                {"prompt_id": p.id, "repeat": rep, "tokens_per_s": row.tokens_per_s}
            )
            write_json(path, res)

    def _resume(self, path: Path) -> set[tuple[int, str]]:
        """Take over the runs of every (repeat, prompt) that an earlier, interrupted run of the
        same configuration finished for every method; those are not run again."""
        if not path.exists():
            return set()
        try:
            old = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return set()
        old_config = {k: v for k, v in old.get("config", {}).items() if k in self.cfg.comparable()}
        if old_config != self.cfg.comparable() or old.get("labels") != self.labels:
            self.console.print(
                f"[yellow]{path} has another configuration: starting afresh[/yellow]"
            )
            return set()
        groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for run in old.get("runs", []):
            groups.setdefault((run["repeat"], run["prompt_id"]), []).append(run)
        prompt_ids = {p.id for p in self.prompts}
        done = {
            key
            for key, runs in groups.items()
            if key[1] in prompt_ids and {r["label"] for r in runs} == set(self.labels)
        }
        self.results["runs"] = [r for key in sorted(done) for r in groups[key]]
        self.results["llama_bench_interleaved"] = [
            s
            for s in old.get("llama_bench_interleaved", [])
            if (s["repeat"], s["prompt_id"]) in done
        ]
        self.results["resumed_runs"] = len(self.results["runs"])
        self.console.print(f"resuming: {len(done)} finished prompt(s) kept from {path}")
        return done

    def table(self) -> Any:
        return rich_table(self.results["summary"], self.labels, self.categories, self._title())


def run_bench(config: BenchConfig, console: Any | None = None, progress: bool = True) -> Bench:
    """Run the benchmark described by `config`; the returned Bench holds `.results`."""
    bench = Bench(config, console, progress)
    bench.run()
    return bench


__all__ = ["SHIPPED_SETS", "BenchConfig", "Bench", "run_bench", "DEFAULT_PER_CATEGORY"]

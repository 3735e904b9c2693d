"""Replay greedy outputs through round policies, without the target: fast what-if studies.

Under greedy decoding the target's output is fixed, so how many guesses a round keeps depends
only on the guesses. Given the plain outputs of an `understudy bench` run (its results.json,
method none), this script replays:

- `free`: the free drafters (ngram, suffix with several max_spec_factor values) exactly, as
  the engine runs them, under automatic K;
- `k`: the default draft model's rounds, exactly. From every position t of each output the
  draft's own greedy continuation of 15 guesses (and its probability of each) is computed
  once; a round starting at t drafts a prefix of it, whatever its length rule, and keeps
  guesses while they match the output. So fixed K, automatic K and the stop rules (raw or
  calibrated) replay exactly what the engine would draft and keep; only time is modelled.

Cost of a round, in plain target passes (measured on the 1.5B target and its int4 0.5B draft
on the 2-core CPU, 2026-11-30, docs/bench/k-and-trees: a 1-row pass 0.247 s; verifying K
guesses 0.285 / 0.308 / 0.325 s for K = 4 / 8 / 12; a drafted token 0.031-0.047 s):
  K = 0: 1;  K > 0: VERIFY_BASE + K * (VERIFY_ROW + DRAFT_TOKEN).
Speedup = tokens / cost (prefill excluded), averaged over prompts per category.

    python scripts/replay_rounds.py free docs/bench/free/results.json
    python scripts/replay_rounds.py k docs/bench/free/results.json --cache conts.pt
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from understudy.bench.prompts import load_prompts
from understudy.config import SamplingParams
from understudy.drafters.calibration import AcceptanceCalibration
from understudy.drafters.draft_model import AUTO_PATH_CONFIDENCE
from understudy.drafters.ngram import NgramProposer
from understudy.drafters.suffix import SuffixProposer
from understudy.engine.builder import resolve_draft_quantization
from understudy.models.loader import LoadedModel, load_model
from understudy.models.quant import load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT
from understudy.models.runner import Runner
from understudy.policy.adaptive_k import AdaptiveK

VERIFY_BASE, VERIFY_ROW, DRAFT_TOKEN = 1.07, 0.021, 0.15
ENGINE_C, ENGINE_V = 0.12, 0.035  # what automatic K is told at engine build (measured there)
K_MAX = 15  # the row budget minus one


def plain_outputs(results: Path, tokenizer) -> list[tuple[str, str, list[int], list[int]]]:
    """(prompt id, category, prompt ids, greedy output ids) for each plain run of a bench
    (the draft's tokenizer is the target's: same family, checked by factory.check_compatible)."""
    runs = json.loads(results.read_text())["runs"]
    prompts = {p.id: p for p in load_prompts()}
    seen, out = set(), []
    for run in runs:
        if run["label"] != "none" or run["prompt_id"] in seen:
            continue
        seen.add(run["prompt_id"])
        prompt = prompts[run["prompt_id"]].prompt
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out.append((run["prompt_id"], run["category"], list(ids), run["token_ids"]))
    return out


def round_cost(k: int) -> float:
    return VERIFY_BASE + k * (VERIFY_ROW + DRAFT_TOKEN) if k else 1.0


def by_category(rows: list[tuple[str, float]]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for category, value in rows:
        sums.setdefault(category, []).append(value)
    return {c: sum(v) / len(v) for c, v in sums.items()}


def print_table(results: dict[str, dict[str, float]]) -> None:
    cats = sorted(next(iter(results.values())))
    print("policy".ljust(24) + "".join(c[:11].rjust(12) for c in cats))
    for name, r in results.items():
        print(name.ljust(24) + "".join(f"{r[c]:12.3f}" for c in cats))


# -- free drafters ------------------------------------------------------------------------------


def replay_free(make: Callable[[], object], prompt: list[int], output: list[int]) -> float:
    """Modelled speedup of a free drafter under automatic K (c = 0) on one output."""
    drafter = make()
    drafter.begin(prompt)
    policy = AdaptiveK(K_MAX, 0.0, ENGINE_V)
    tokens, pos, cost = [*prompt, output[0]], 1, 0.0
    while pos < len(output):
        k = min(policy.choose(), len(output) - pos - 1)
        guesses = drafter.propose(tokens, k, SamplingParams(), None).draft_ids.tolist() if k else []
        kept = 0
        while kept < len(guesses) and guesses[kept] == output[pos + kept]:
            kept += 1
        policy.observe(len(guesses), kept)
        tokens += output[pos : pos + kept + 1]
        pos += kept + 1
        cost += VERIFY_BASE + len(guesses) * VERIFY_ROW if guesses else 1.0
        drafter.commit(tokens)
    return (len(output) - 1) / cost


def study_free(draft: LoadedModel, outputs: list) -> None:
    makers: dict[str, Callable[[], object]] = {"ngram": NgramProposer}
    for factor in (1.0, 2.0, 4.0, 8.0):
        makers[f"suffix factor {factor:g}"] = lambda f=factor: SuffixProposer(max_spec_factor=f)
    print_table(
        {
            name: by_category([(cat, replay_free(make, p, o)) for _, cat, p, o in outputs])
            for name, make in makers.items()
        }
    )


# -- the draft model's rounds -------------------------------------------------------------------


@torch.inference_mode()
def draft_continuations(draft: LoadedModel, outputs: list, cache: Path | None) -> list[dict]:
    """Per output: from every position t, the draft's own greedy continuation of K_MAX
    guesses after the true prefix, with its probability of each (what a round starting at t
    drafts, whatever its length rule). Saved to / loaded from `cache` (a few minutes each)."""
    if cache is not None and cache.exists():
        return torch.load(cache)
    scheme = resolve_draft_quantization("auto", draft)
    if scheme is not None:
        load_or_quantize(draft.model, None, scheme)
    traces = []
    for prompt_id, category, prompt, output in tqdm(outputs, desc="draft continuations"):
        runner = Runner(draft.model, len(prompt) + len(output) + K_MAX + 8)
        logits = runner.prefill(torch.tensor([*prompt, output[0]]))[None]  # [1, V]
        continuations = []
        for pos in range(1, len(output)):
            length, step, guesses, probs = runner.length, logits, [], []
            for i in range(K_MAX):
                top = step.float().softmax(-1).max(-1)
                guesses.append(int(top.indices))
                probs.append(float(top.values))
                if i < K_MAX - 1:
                    step = runner.extend(top.indices.view(1))
            runner.truncate(length)
            continuations.append((guesses, probs))
            logits = runner.extend(torch.tensor([output[pos]]))
        traces.append(
            {"id": prompt_id, "category": category, "output": output, "next": continuations}
        )
    if cache is not None:
        torch.save(traces, cache)
    return traces


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def length(self, probs: list[float], budget: int) -> tuple[int, int]:
        """(guesses drafted, draft passes spent) for a round with this many rows free."""
        k = min(self.k, budget)
        return k, k

    def observe(self, probs: list[float], drafted: int, kept: int) -> None:
        pass


class AutomaticK:
    """The engine's automatic K (engine.py): AdaptiveK decides whether to draft; then the
    round runs to the row budget unless the draft's doubt stops it (drafters/draft_model.py),
    on its own probabilities (doubt), their raw product (path, calibrate=False) or their
    calibrated product (drafters/calibration.py)."""

    def __init__(self, doubt: float = 0.0, path: float = 0.0, calibrate: bool = True) -> None:
        self.policy = AdaptiveK(K_MAX, ENGINE_C, ENGINE_V)
        self.doubt, self.path = doubt, path
        self.calibration = AcceptanceCalibration() if calibrate else None

    def length(self, probs: list[float], budget: int) -> tuple[int, int]:
        k = self.policy.choose()
        if not k:
            return 0, 0
        k = min(K_MAX if self.doubt or self.path else k, budget)
        product = 1.0
        for i in range(k):
            p = probs[i]
            product *= self.calibration.estimate(p) if self.calibration else p
            if i > 0 and (p < self.doubt or product < self.path):
                return i, i + 1  # the doubted guess's draft step was spent
        return k, k

    def observe(self, probs: list[float], drafted: int, kept: int) -> None:
        self.policy.observe(drafted, kept)
        if self.calibration is not None and drafted:
            self.calibration.observe_round(probs[:drafted], kept)


def replay_k(trace: dict, policy: FixedK | AutomaticK) -> float:
    """Modelled decode speedup of one output (round_cost, plus the draft steps a stopped
    round spent on the guess it dropped)."""
    output, pos, cost = trace["output"], 1, 0.0
    while pos < len(output):
        guesses, probs = trace["next"][pos - 1]
        drafted, passes = policy.length(probs, min(K_MAX, len(output) - pos))
        kept = 0
        while kept < drafted and guesses[kept] == output[pos + kept]:
            kept += 1
        policy.observe(probs, drafted, kept)
        cost += round_cost(drafted) + (passes - drafted) * DRAFT_TOKEN
        pos += kept + 1
    return (len(output) - 1) / cost


def study_k(draft: LoadedModel, outputs: list, cache: Path | None) -> None:
    traces = draft_continuations(draft, outputs, cache)
    policies: dict[str, Callable[[], FixedK | AutomaticK]] = {
        f"K = {k}": (lambda k=k: FixedK(k)) for k in (2, 3, 4, 6, 8, 10, 12, 15)
    }
    policies["auto, no stop rule"] = AutomaticK
    policies["auto, per-token 0.5"] = lambda: AutomaticK(doubt=0.5)
    for path in (0.2, 0.3):
        policies[f"auto, raw path {path}"] = lambda q=path: AutomaticK(path=q, calibrate=False)
    for path in (0.15, 0.2, 0.25, 0.3):
        name = f"auto, calibrated {path}" + (" *" if path == AUTO_PATH_CONFIDENCE else "")
        policies[name] = lambda q=path: AutomaticK(path=q)
    results = {
        name: by_category([(t["category"], replay_k(t, make())) for t in traces])
        for name, make in policies.items()
    }
    print_table(results)
    fixed = [name for name in results if name.startswith("K = ")]
    best = {c: max(results[name][c] for name in fixed) for c in results[fixed[0]]}
    print("\nagainst the best fixed K of each category (* the default):")
    print_table({name: {c: r[c] / best[c] for c in r} for name, r in results.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=["free", "k"])
    parser.add_argument(
        "results", type=Path, nargs="+", help="`understudy bench` results.json files"
    )
    parser.add_argument("--cache", type=Path, help="k: save / reuse the draft continuations")
    args = parser.parse_args()
    draft = load_model(DEFAULT_DRAFT, "float32")
    outputs, seen = [], set()
    for results in args.results:  # the first run of each prompt
        for item in plain_outputs(results, draft.tokenizer):
            if item[0] not in seen:
                seen.add(item[0])
                outputs.append(item)
    if args.study == "free":
        study_free(draft, outputs)
    else:
        study_k(draft, outputs, args.cache)


if __name__ == "__main__":
    main()

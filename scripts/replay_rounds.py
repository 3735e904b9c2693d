"""Replay greedy outputs through round policies, without the target: fast what-if studies.

Under greedy decoding the target's output is fixed, so how many guesses a round keeps depends
only on the guesses. Given the plain outputs of an `understudy bench` run (its results.json,
method none), this script replays:

- `free`: the free drafters (ngram, suffix with several max_spec_factor values) exactly, as
  the engine runs them, under automatic K;
- `k`: the default draft model's rounds. One teacher-forced pass of the draft over each output
  gives agree[t] (the draft's argmax after the true prefix equals the output's token t) and
  its probability of that argmax. A round that starts at t keeps guesses while agree holds,
  whatever K is (its context is the true prefix until the first miss), so fixed K, automatic K
  and the draft_confidence stop can all be replayed from the same trace. (A stop after a
  miss is judged on the true prefix's probabilities: it only moves the cost of wasted rows.)

Cost of a round, in plain target passes (measured on the 1.5B target and its int4 0.5B draft
on the 2-core CPU, 2026-11-30, docs/bench/k-and-trees: a 1-row pass 0.247 s; verifying K
guesses 0.285 / 0.308 / 0.325 s for K = 4 / 8 / 12; a drafted token 0.031-0.047 s):
  K = 0: 1;  K > 0: VERIFY_BASE + K * (VERIFY_ROW + DRAFT_TOKEN).
Speedup = tokens / cost (prefill excluded), averaged over prompts per category.

    python scripts/replay_rounds.py free docs/bench/free/results.json
    python scripts/replay_rounds.py k docs/bench/free/results.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from understudy.adaptive import AdaptiveK
from understudy.bench.prompts import load_prompts
from understudy.config import SamplingParams
from understudy.drafters.ngram import NgramProposer
from understudy.drafters.suffix import SuffixProposer
from understudy.factory import resolve_draft_quantization
from understudy.models.loader import LoadedModel, load_model
from understudy.models.quant import load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT
from understudy.models.runner import Runner

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
def draft_traces(draft: LoadedModel, outputs: list) -> list[tuple[str, list[bool], list[float]]]:
    """(category, agree [N-1], the draft's probability of its argmax [N-1]) per output."""
    scheme = resolve_draft_quantization("auto", draft)
    if scheme is not None:
        load_or_quantize(draft.model, None, scheme)
    traces = []
    for _, category, prompt, output in outputs:
        runner = Runner(draft.model, len(prompt) + len(output) + 8)
        first = runner.prefill(torch.tensor([*prompt, output[0]]))[None]  # [1, V]
        rest = runner.extend(torch.tensor(output[1:-1])) if len(output) > 2 else first[:0]
        probs = torch.cat([first, rest]).float().softmax(-1)  # [N-1, V]: row t guesses t+1
        top = probs.max(-1)
        agree = (top.indices == torch.tensor(output[1:])).tolist()
        traces.append((category, agree, top.values.tolist()))
    return traces


def replay_k(
    agree: list[bool], prob: list[float], policy: AdaptiveK | int, doubt: float, path: float
) -> float:
    """Modelled speedup of one output: K from `policy` (an int: fixed), capped at K_MAX, each
    round stopped before the first later guess whose probability is under `doubt` or at which
    the product of the round's probabilities falls under `path` (drafters/draft_model.py);
    with a stop rule an adaptive policy's K only decides whether to draft at all (engine.py)."""
    pos, cost, n = 0, 0.0, len(agree)
    while pos < n:
        if isinstance(policy, int):
            k = policy
        else:
            k = policy.choose()
            k = K_MAX if k and (doubt or path) else k
        k = min(k, n - pos)
        drafted, product = k, prob[pos] if k else 1.0
        for i in range(1, k):
            product *= prob[pos + i]
            if prob[pos + i] < doubt or product < path:
                drafted = i
                break
        kept = 0
        while kept < drafted and agree[pos + kept]:
            kept += 1
        if not isinstance(policy, int):
            policy.observe(drafted, kept)
        cost += round_cost(drafted)
        pos += kept + 1
    return (n + 1) / (cost + 1)


def study_k(draft: LoadedModel, outputs: list) -> None:
    traces = draft_traces(draft, outputs)

    def automatic() -> AdaptiveK:
        return AdaptiveK(K_MAX, ENGINE_C, ENGINE_V)

    policies: dict[str, tuple[Callable[[], AdaptiveK | int], float, float]] = {
        f"K = {k}": (lambda k=k: k, 0.0, 0.0) for k in (2, 4, 6, 8, 10, 12, 15)
    }
    policies["auto"] = (automatic, 0.0, 0.0)
    for doubt in (0.3, 0.5, 0.7):
        policies[f"auto, per-token {doubt}"] = (automatic, doubt, 0.0)
    for path in (0.1, 0.2, 0.3, 0.4, 0.5):
        policies[f"auto, path {path}"] = (automatic, 0.0, path)
    print_table(
        {
            name: by_category([(c, replay_k(a, p, make(), d, q)) for c, a, p in traces])
            for name, (make, d, q) in policies.items()
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=["free", "k"])
    parser.add_argument("results", type=Path, help="an `understudy bench` results.json")
    args = parser.parse_args()
    draft = load_model(DEFAULT_DRAFT, "float32")
    outputs = plain_outputs(args.results, draft.tokenizer)
    (study_free if args.study == "free" else study_k)(draft, outputs)


if __name__ == "__main__":
    main()

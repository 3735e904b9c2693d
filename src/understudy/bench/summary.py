"""From individual runs to per-method, per-category figures (the vocabulary of engine/stats.py).

A run is one (repeat, prompt, method) generation: a dict with "label", "prompt_id",
"category", "repeat", "token_ids" and "stats" (GenerationStats.to_dict(), or the peer's
subset of it). Figures per (label, category), "all" being every category together:

- tokens_per_s: sum(tokens) / sum(wall_s) over the category's prompts, per repeat; reported
  as median, min and max over repeats (decode_tokens_per_s likewise, prefill excluded).
- speedup: that ratio divided by the baseline's ("none") over the same prompts in the same
  repeat; methods run interleaved prompt by prompt, so slow drift of the machine cancels.
- tokens_per_pass, acceptance_rate, mean_accepted_length, per_position_acceptance: from the
  summed counts of every run (these are the same in every repeat for greedy decoding).
- identical: runs whose token_ids equal the baseline's first repeat of the same prompt
  (greedy only; None when sampling). For the baseline itself: repeats agree.
  llama.cpp's runs are checked against llama.cpp-plain instead, text to text.
- c (measured): (draft_s / drafted) / (verify_s / rounds), i.e. one drafted token's cost over
  one verify pass's, both as timed inside the engine (the draft's catch-up pass included).
- alpha_implied: the per-token acceptance α that gives the measured mean accepted length at
  the mean K drafted per round under Leviathan's eq. 1; theory_speedup: what Thm 3.8
  predicts for that α, K and c.
"""

from __future__ import annotations

import statistics
from typing import Any

from understudy.policy.theory import expected_speedup, expected_tokens_per_round

ALL = "all"


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "values": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def implied_alpha(mean_accepted_length: float, k: int) -> float:
    """The α with E[tokens per round](α, K) = mean_accepted_length (bisection; E rises in α)."""
    target = min(max(mean_accepted_length, 1.0), k + 1.0)
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens_per_round(mid, k) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _rate(runs: list[dict[str, Any]], key_time: str, decode: bool = False) -> float | None:
    tokens = sum(r["stats"]["tokens"] - (1 if decode else 0) for r in runs)
    seconds = sum(r["stats"][key_time] for r in runs)
    return tokens / seconds if seconds > 0 else None


def identity_flags(
    runs: list[dict[str, Any]],
    baseline: str,
    greedy: bool,
    references: dict[str, str] | None = None,
) -> None:
    """Set run["identical"]: its output equals that of the earliest repeat of the same prompt
    under its reference label, the baseline unless `references` maps its label to another.
    Outputs are token_ids; a run without them (a peer that prints only text, such as
    llama.cpp, checked against its own plain decoding) must begin with the reference's text."""
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for r in sorted(runs, key=lambda r: r["repeat"]):
        first.setdefault((r["label"], r["prompt_id"]), r)
    for r in runs:
        ref = first.get(((references or {}).get(r["label"], baseline), r["prompt_id"]))
        if not greedy or ref is None:
            r["identical"] = None
        elif r["token_ids"] is not None:
            r["identical"] = r["token_ids"] == ref["token_ids"]
        else:  # llama.cpp's speculative run may make up to K tokens more than asked
            r["identical"] = r["text"].startswith(ref["text"])


def _counts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    s = [r["stats"] for r in runs]
    if not s or "rounds" not in s[0]:  # a peer: no round statistics
        passes = sum(x.get("target_passes", 0) for x in s)
        tokens = sum(x["tokens"] for x in s)
        drafted = sum(x.get("drafted", 0) for x in s)
        accepted = sum(x.get("accepted", 0) for x in s)
        return {
            "tokens_per_pass": tokens / passes if passes else None,
            "acceptance_rate": accepted / drafted if drafted else None,
        }
    tokens = sum(x["tokens"] for x in s)
    passes = sum(x["target_passes"] for x in s)
    rounds = sum(x["rounds"] for x in s)
    drafted = sum(x["drafted"] for x in s)
    accepted = sum(x["accepted"] for x in s)
    draft_s = sum(x["draft_s"] for x in s)
    verify_s = sum(x["verify_s"] for x in s)
    width = max((len(x["per_position_acceptance"]) for x in s), default=0)
    hits = [0.0] * width
    for x in s:
        for i, share in enumerate(x["per_position_acceptance"]):
            hits[i] += share * x["rounds"]
    out: dict[str, Any] = {
        "tokens_per_pass": tokens / passes if passes else None,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
        "per_position_acceptance": [h / rounds for h in hits] if rounds else [],
        "mean_k": drafted / rounds if rounds else 0.0,
        "target_pass_ms": 1000 * verify_s / rounds if rounds else None,
        "draft_ms_per_token": 1000 * draft_s / drafted if drafted else None,
        "exact": all(x.get("exact", True) for x in s),
    }
    out["c"] = (
        out["draft_ms_per_token"] / out["target_pass_ms"]
        if out["draft_ms_per_token"] is not None and out["target_pass_ms"]
        else None
    )
    k_mean = round(out["mean_k"])
    if drafted and k_mean >= 1 and out["c"] is not None:
        alpha = implied_alpha(out["mean_accepted_length"], k_mean)
        out["alpha_implied"] = alpha
        out["theory_k"] = k_mean
        out["theory_speedup"] = expected_speedup(alpha, k_mean, out["c"])
    else:
        out["alpha_implied"] = out["theory_k"] = out["theory_speedup"] = None
    return out


def summarize(
    runs: list[dict[str, Any]], labels: list[str], categories: list[str], baseline: str
) -> dict[str, dict[str, Any]]:
    """summary[label][category] -> figures (see module docstring)."""
    by_key: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for r in runs:
        for cat in (r["category"], ALL):
            by_key.setdefault((r["label"], cat, r["repeat"]), {})[r["prompt_id"]] = r
    repeats = sorted({r["repeat"] for r in runs})
    summary: dict[str, dict[str, Any]] = {}
    for label in labels:
        summary[label] = {}
        for cat in [*categories, ALL]:
            mine_all = [r for r in runs if r["label"] == label and cat in (r["category"], ALL)]
            if not mine_all:
                continue
            tps, dtps, speed, dspeed = [], [], [], []
            for rep in repeats:
                mine = by_key.get((label, cat, rep), {})
                base = by_key.get((baseline, cat, rep), {})
                common = [pid for pid in mine if pid in base]
                if not mine:
                    continue
                rate = _rate(list(mine.values()), "wall_s")
                drate = _rate(list(mine.values()), "decode_s", decode=True)
                tps.append(rate)
                dtps.append(drate)
                if common:
                    a = _rate([mine[p] for p in common], "wall_s")
                    b = _rate([base[p] for p in common], "wall_s")
                    da = _rate([mine[p] for p in common], "decode_s", decode=True)
                    db = _rate([base[p] for p in common], "decode_s", decode=True)
                    if a and b:
                        speed.append(a / b)
                    if da and db:
                        dspeed.append(da / db)
            flags = [r.get("identical") for r in mine_all]
            checked = [f for f in flags if f is not None]
            summary[label][cat] = {
                "method": mine_all[0]["stats"].get("method", label),
                "k": mine_all[0]["stats"].get("k"),
                "prompts": len({r["prompt_id"] for r in mine_all}),
                "runs": len(mine_all),
                "tokens": sum(r["stats"]["tokens"] for r in mine_all),
                "tokens_per_s": spread([v for v in tps if v is not None]),
                "decode_tokens_per_s": spread([v for v in dtps if v is not None]),
                "speedup": spread(speed),
                "decode_speedup": spread(dspeed),
                "identical": {"count": sum(checked), "of": len(checked)} if checked else None,
                "all_identical": all(checked) if checked else None,
                **_counts(mine_all),
            }
    return summary

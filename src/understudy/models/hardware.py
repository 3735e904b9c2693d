"""What this machine's CPU does natively, where a choice of dtype or kernel depends on it."""

from __future__ import annotations


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Without it torch
    emulates bf16 matmuls: one row is as fast as fp32, but the cost grows with every row."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags

"""A kernel that cannot take part of a model says why, once, in one line.

The part then runs on the exact portable path (torch attention, rowgemm, the module path):
slower, never a crash and never another answer, since that path is row-invariant as well.
quantization="gguf" refuses such a model with the same reason instead (models/loader.py).
"""

from __future__ import annotations

import logging
from functools import cache

log = logging.getLogger("understudy.kernels")


@cache
def log_refusal(reason: str) -> None:
    """Log `reason` (what a kernel cannot take, and why) the first time it is given."""
    log.warning("%s; that part runs on the exact portable path instead", reason)

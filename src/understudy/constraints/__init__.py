"""Logits processors for the target's logits: penalties, logit bias, min_tokens and
structured output. base.py states the protocol the engine follows and why speculation stays
lossless under it."""

from understudy.constraints.base import Composite, LogitsProcessor
from understudy.constraints.build import build_processor

__all__ = ["Composite", "LogitsProcessor", "build_processor"]

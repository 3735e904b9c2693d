"""Drafters, one file per method; importing this package registers them all."""

from understudy.drafters import (
    draft_model,  # noqa: F401  (registers "draft")
    eagle,  # noqa: F401  (registers "eagle")
    hybrid,  # noqa: F401  (registers "hybrid")
    ngram,  # noqa: F401  (registers "ngram")
    suffix,  # noqa: F401  (registers "suffix")
)
from understudy.drafters.base import DRAFTERS, Drafter, Proposal

__all__ = ["DRAFTERS", "Drafter", "Proposal"]

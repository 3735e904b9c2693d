"""Drafters, one file per method; importing this package registers them all."""

from understudy.drafters import draft_model  # noqa: F401  (registers "draft")
from understudy.drafters.base import DRAFTERS, Proposal, Proposer

__all__ = ["DRAFTERS", "Proposal", "Proposer"]

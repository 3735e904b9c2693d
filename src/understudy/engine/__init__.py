"""The engine: the round loop, its emission and stats, and the builder that assembles it."""

from understudy.engine.engine import Engine, GenerationOutput, RoundEvent, TokenEvent, TokenStream

__all__ = ["Engine", "GenerationOutput", "RoundEvent", "TokenEvent", "TokenStream"]

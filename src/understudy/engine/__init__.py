"""The engine: the round loop, its emission and stats, and the builder that assembles it."""

from understudy.engine.emitter import TokenEvent
from understudy.engine.engine import Engine
from understudy.engine.outputs import GenerationOutput, RoundEvent, TokenStream

__all__ = ["Engine", "GenerationOutput", "RoundEvent", "TokenEvent", "TokenStream"]

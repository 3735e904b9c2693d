"""understudy: lossless speculative decoding for Hugging Face causal language models.

    from understudy import Engine, SamplingParams
    engine = Engine.from_pretrained()            # the packaged default pair
    out = engine.generate("def fib(n):", SamplingParams(max_tokens=64, temperature=0.0))

Names are loaded lazily so that light commands (`understudy simulate`) never import torch.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationOutput", "SamplingParams", "TokenEvent", "UnderstudyError"]

if TYPE_CHECKING:
    from understudy.config import SamplingParams, UnderstudyError
    from understudy.engine import Engine, GenerationOutput, TokenEvent


def __getattr__(name: str) -> Any:
    if name in ("SamplingParams", "UnderstudyError"):
        from understudy import config

        return getattr(config, name)
    if name in ("Engine", "GenerationOutput", "TokenEvent"):
        from understudy import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'understudy' has no attribute {name!r}")

"""Structured output: a grammar's mask on the target's logits, through xgrammar.

`StructuredSpec` (a JSON schema, any JSON, a regex, an EBNF grammar or a choice of strings)
compiles to an xgrammar CompiledGrammar for the model's tokenizer; a GrammarMatcher then
follows the committed tokens. For a round, the matcher advances along the drafted tokens
one at a time, filling row i's bitmask from the state after drafted[:i], and finally rolls
back all it accepted, so the committed state is unchanged (base.py). A drafted token the
grammar refuses gets -inf at its row, so the verifier rejects it; the rows after it cannot be
reached and keep the logits they came with.

JSON schemas generate JSON with fixed separators (", " and ": ") and no other optional
whitespace (small models otherwise tend to loop on it). Once the grammar is complete, only
the stop tokens (EOS, stop_token_ids) are allowed. When the processors before this one leave nothing the grammar allows (min_tokens
asking for more tokens than a finished grammar holds), the grammar wins: its allowed tokens
become equally likely, so a row is never without a token. A grammar that allows no token at
all (stop_token_ids that take every token it could continue with) is the request's error,
raised at the first row where it shows.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import torch

from understudy.config import StructuredSpec, UnderstudyError
from understudy.constraints.base import GeneratedTokens


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:  # an optional extra: structured output needs it, nothing else does
        raise UnderstudyError(
            "structured output needs xgrammar: pip install 'understudy[structured]'"
        ) from None
    return xgrammar


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer: Any, vocab_size: int) -> Any:
    """The grammar compiler for a tokenizer, memoised: reading a 150k-token vocabulary into
    xgrammar's tokenizer info takes seconds, and its compile cache is per compiler."""
    xgr = _xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=2)


def _choice_regex(choices: tuple[str, ...]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def compile_spec(spec: StructuredSpec, tokenizer: Any, vocab_size: int) -> Any:
    """The CompiledGrammar of `spec`, or UnderstudyError naming what does not compile."""
    if tokenizer is None:
        raise UnderstudyError("structured output needs the model's tokenizer; this model has none")
    compiler = _compiler(tokenizer, vocab_size)
    try:
        if spec.json_schema is not None:
            schema = spec.json_schema
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if spec.json_object:
            return compiler.compile_builtin_json_grammar()
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex(_choice_regex(spec.choice))
        return compiler.compile_grammar(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:
        kind = next(
            name
            for name in ("json_schema", "json_object", "regex", "choice", "grammar")
            if getattr(spec, name) not in (None, False)
        )
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnderstudyError(f"structured output: the {kind} does not compile: {reason}") from None


class GrammarProcessor(GeneratedTokens):
    """-inf wherever the grammar refuses the token at that position."""

    def __init__(self, compiled: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        super().__init__()
        xgr = _xgrammar()
        self._xgr = xgr
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.matcher = self._new_matcher()
        self.matched = 0  # generated tokens the matcher has accepted

    @classmethod
    def build(
        cls, spec: StructuredSpec, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]
    ) -> GrammarProcessor:
        if not stop_ids:
            raise UnderstudyError(
                "structured output needs a token that ends generation (EOS or stop_token_ids); "
                "this model has none"
            )
        return cls(compile_spec(spec, tokenizer, vocab_size), vocab_size, stop_ids)

    def _new_matcher(self) -> Any:
        return self._xgr.GrammarMatcher(self.compiled, override_stop_tokens=list(self.stop_ids))

    def begin(self, prompt_ids: list[int]) -> None:
        super().begin(prompt_ids)
        self.matcher = self._new_matcher()
        self.matched = 0

    def commit(self, tokens: list[int]) -> None:
        """Advance the matcher over the newly committed tokens. Every committed token was
        chosen from masked logits, so the grammar accepts it; one it refuses means the
        engine used logits this processor never saw, and is an error."""
        super().commit(tokens)
        for token in self.generated[self.matched :]:
            if self.matcher.is_terminated():
                break  # tokens after the final stop token are never emitted
            if not self.matcher.accept_token(token):
                raise RuntimeError(
                    f"token {token} was committed although the grammar refuses it there"
                )
        self.matched = len(self.generated)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        rows = logits.shape[0]
        out = logits.clone()  # [R, V]
        bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)  # [R, ceil(V/32)]
        masked = 0  # rows [0, masked) get the grammar's mask
        advanced = 0  # drafted tokens the matcher accepted tentatively
        for i in range(rows):
            if self.matcher.is_terminated():
                break  # after a drafted stop token: nothing here can be emitted
            self.matcher.fill_next_token_bitmask(bitmask, i)
            masked = i + 1
            if i == rows - 1 or i >= len(drafted):
                break
            if not self.matcher.accept_token(drafted[i]):
                break  # drafted[i] is refused (-inf at row i): the rows after are unreachable
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)
        if masked:
            head = out[:masked]
            before = head.clone()
            self._xgr.apply_token_bitmask_inplace(
                head, bitmask[:masked], vocab_size=self.vocab_size
            )
            empty = ~torch.isfinite(head).any(-1)  # [masked]
            for i in empty.nonzero().flatten().tolist():
                head[i] = self._uniform_over_allowed(before[i], bitmask[i : i + 1])
        return out

    def _uniform_over_allowed(self, row: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """row: [V]; bits: [1, ceil(V/32)] -> 0 where the grammar allows, -inf elsewhere."""
        flat = torch.zeros(1, self.vocab_size)
        self._xgr.apply_token_bitmask_inplace(flat, bits, vocab_size=self.vocab_size)
        if not torch.isfinite(flat).any():
            raise UnderstudyError(
                "structured output: the grammar allows no token here, as stop_token_ids take "
                "every token that could continue it"
            )
        return flat[0].to(row.dtype)

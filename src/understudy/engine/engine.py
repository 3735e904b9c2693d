"""The engine: a target, a drafter and the loop that makes them lossless.

Invariant of the decode loop: a request's `tokens` are prompt + generated; the target's KV
cache (its seat's region) holds valid entries for tokens[:-1] (the newest token has not been
scored yet). A chain round feeds [tokens[-1], x_1..x_K] to the target in one pass, keeps
x_1..x_a and the verifier's own token, and truncates the target's cache back to the tokens it
has now seen. A tree round (draft and eagle, tree="on" | "auto") scores a token tree in one
pass, each node over its path's keys in chain order, picks the kept path and compacts its
KV to the chain's slots (engine/verdict.py), leaving the same invariant. Requests with a
logits processor (penalties, a grammar: understudy.constraints) draft chains only; the
processor is applied to every verified row as plain decoding would apply it there.

Greedy output is the target's own argmax sequence bit for bit, because a row's logits do not
depend on the other rows of its pass (models/runner.py, models/shared_pass.py); sampled
output has the target's distribution (verify/chain.py, verify/tree.py). Both hold for a
batch of any size: solo decoding is a batch of one (engine/scheduler.py, engine/round.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Literal, overload

import torch

from understudy.config import (
    DType,
    Method,
    Quantization,
    SamplingParams,
    TreeMode,
    UnderstudyError,
    parse_num_speculative_tokens,
)
from understudy.drafters.base import Drafter
from understudy.engine.emitter import TokenEvent
from understudy.engine.outputs import GenerationOutput, RoundEvent, TokenStream
from understudy.engine.prompts import Prompt, encode_prompt, is_batch
from understudy.engine.request import Seat
from understudy.engine.scheduler import LoopSetup, Scheduler
from understudy.engine.seats import make_seats
from understudy.kernels.openmp import release_thread_team
from understudy.models.runner import Runner
from understudy.policy.costs import Costs
from understudy.policy.planner import PlanRules
from understudy.policy.tree_choice import TreeOrChain

if TYPE_CHECKING:
    from understudy.engine.builder import EngineParts


class Engine:
    """A target model, an optional drafter, and the loop that makes them lossless."""

    def __init__(self, parts: EngineParts) -> None:
        p = parts
        self.target = p.target
        self.tokenizer = p.target.tokenizer
        self.method = p.method
        self.max_context = p.max_context
        self.exact = p.exact
        seats = p.seats or [Seat(p.runner, p.drafter)]
        drafter = seats[0].drafter
        rules = PlanRules(
            p.num_speculative_tokens,
            p.runner.rows or 1,
            "off" if drafter is None else drafter.tree,
            p.costs,
            drafter is not None and drafter.traits.plans_length,
            drafter is not None and drafter.stops_by_confidence,
        )
        # tree="auto": which shape pays, learnt over this engine's requests (tree_choice.py)
        shapes = TreeOrChain(p.costs) if rules.tree_mode == "auto" else None
        setup = LoopSetup(p.target, p.method, p.max_context, p.exact, rules, shapes,
                          p.batch_costs)  # fmt: skip
        self.scheduler = Scheduler(setup, seats)

    @property
    def k(self) -> int | Literal["auto"]:
        """num_speculative_tokens: a fixed K or "auto". Settable between requests: the
        requests admitted after the change plan with it (stats.k says which they had)."""
        return self.scheduler.setup.rules.k

    @k.setter
    def k(self, value: int | str) -> None:
        self.scheduler.retune(k=parse_num_speculative_tokens(value))

    @property
    def costs(self) -> Costs:
        """The costs measured when the engine was built, which every round plan weighs.
        Settable between requests, like `k` (the drafter's settled thresholds stay)."""
        return self.scheduler.setup.rules.costs

    @costs.setter
    def costs(self, value: Costs) -> None:
        self.scheduler.retune(costs=value)

    @property
    def seat(self) -> Seat:
        """Seat 0: the engine's own runner and drafter (a solo engine's only seat)."""
        return self.scheduler.seats[0]

    @property
    def runner(self) -> Runner:
        return self.seat.runner

    @property
    def drafter(self) -> Drafter | None:
        return self.seat.drafter

    @property
    def tree_mode(self) -> TreeMode:
        """The drafter's tree option: "off", "on", or "auto" (trees where they pay)."""
        return self.scheduler.setup.rules.tree_mode

    @property
    def tree(self) -> bool:
        """Whether rounds may draft trees (tree="on", or "auto" where they pay)."""
        return self.tree_mode in ("on", "auto")

    @property
    def pad(self) -> bool:
        """Whether every target pass is padded to the runner's row budget (else the target's
        kernels are row-invariant and a pass holds only its real rows)."""
        return self.runner.pad

    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        draft: str | None = None,
        method: Method = "auto",
        num_speculative_tokens: int | str = "auto",
        dtype: DType | torch.dtype = "auto",
        max_context: int = 4096,
        verify_rows: int | None = None,
        device: str | None = None,
        draft_quantization: str | None = "auto",
        quantization: Quantization = "auto",
        max_num_seqs: int | Literal["auto"] = 1,
        **drafter_options: object,
    ) -> Engine:
        """Load the models and build a ready engine (engine/builder.py). `drafter_options`
        go to the drafter's `from_models` (e.g. prompt_lookup_max for method="ngram").
        `draft_quantization`: "auto", None, a scheme of models/quant.py, "q4_0" for a GGUF
        draft, or "q8_0" / "q4_0" for eagle's head in GGUF blocks (engine/draft_setup.py);
        none of them can change the output.
        `quantization`: "auto" (a GGUF runs from its own blocks on a CPU), "gguf" or "none"
        (dense, in `dtype`). `max_num_seqs`: sequences decoded together (seats), or "auto".
        `method`: "auto" (the default) is the target's own head where one is found for it,
        else the draft model (engine/method_choice.py); `engine.method` says which.
        The calling thread's OpenMP team ends with the build, so an engine built on one
        thread and run on another (the server's worker) has the process's only team."""
        from understudy.engine.builder import EngineSpec, assemble, load_models
        from understudy.engine.method_choice import resolve_method

        spec = EngineSpec(
            method=resolve_method(method, target, draft)[0],
            k=parse_num_speculative_tokens(num_speculative_tokens),
            max_context=max_context,
            verify_rows=verify_rows,
            draft_quantization=draft_quantization,
            drafter_options=dict(drafter_options),
            max_num_seqs=max_num_seqs,
        )
        models = load_models(target, draft, spec, dtype, device, quantization)
        engine = cls(assemble(models, spec, draft))
        release_thread_team()  # the thread that runs it holds the only team (kernels/openmp.py)
        return engine

    @classmethod
    def from_parts(cls, parts: EngineParts) -> Engine:
        """An engine from what engine/builder.py assembled."""
        return cls(parts)

    def with_method(self, method: Method) -> Engine:
        """The same target (shared weights and cache) with no drafter: the plain baseline."""
        from understudy.engine.builder import EngineParts

        if method != "none":
            raise UnderstudyError("with_method builds only the plain baseline; use from_pretrained")
        runner = Runner(
            self.target.model, self.max_context, rows=self.runner.rows, pad=self.runner.pad
        )  # its own: the drafting engine's runner keeps hidden states, this one does not
        seats = make_seats(runner, None, len(self.scheduler.seats))  # the same regions, in turn
        return Engine(EngineParts(self.target, runner, None, "none", 0, self.max_context,
                                  self.exact, Costs(), seats))  # fmt: skip

    def encode(self, prompt: Prompt) -> list[int]:
        """A string, a list of token ids, or a chat message list -> prompt token ids."""
        return encode_prompt(prompt, self.tokenizer, self.runner.vocab_size, self.max_context)

    # -- generation: facades over the scheduler's step() ----------------------------------

    @overload
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> GenerationOutput: ...

    @overload
    def generate(
        self,
        prompt: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_token: None = None,
    ) -> list[GenerationOutput]: ...

    def generate(
        self,
        prompt: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Generate a completion; `on_token` (optional) sees every token as it is emitted.
        A list of prompts (with one SamplingParams for all, or one each) runs as a batch on
        the engine's seats (max_num_seqs) and returns the outputs in order, each exactly
        what its prompt gives alone."""
        if is_batch(prompt):
            if on_token is not None:
                raise UnderstudyError("on_token streams one prompt; a batch returns outputs")
            outputs: list[GenerationOutput | None] = [None] * len(prompt)
            for i, item in self.stream_batch(prompt, params):
                if isinstance(item, GenerationOutput):
                    outputs[i] = item
            done = [output for output in outputs if output is not None]
            assert len(done) == len(outputs)  # stream_batch ends every sequence with its output
            return done
        if isinstance(params, list):
            raise UnderstudyError("a list of SamplingParams goes with a list of prompts, one each")
        stream = self.stream(prompt, params or SamplingParams())
        for event in stream:
            if on_token is not None:
                on_token(event)
        assert stream.output is not None
        return stream.output

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        on_round: Callable[[RoundEvent], None] | None = None,
    ) -> TokenStream:
        """An iterator of TokenEvents; its `.output` is the GenerationOutput once exhausted.
        `on_round` (optional) sees each round (its drafted tokens, rejected ones included)
        before the round's tokens are emitted."""
        prompt_ids = self.encode(prompt)
        events = self._events([prompt_ids], [params or SamplingParams()], on_round)
        return TokenStream((item for _, item in events), prompt_ids)

    def stream_batch(
        self,
        prompts: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, TokenEvent | GenerationOutput]]:
        """(i, TokenEvent) for prompt i as its tokens come, then (i, its GenerationOutput)."""
        encoded = [self.encode(p) for p in prompts]
        return self._events(encoded, params_each(encoded, params))

    def _events(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_round: Callable[[RoundEvent], None] | None = None,
    ) -> Iterator[tuple[int, TokenEvent | GenerationOutput]]:
        """Submit every prompt and step the loop on this thread, yielding (i, event) for
        prompt i as its tokens are emitted and (i, its output) when it ends; a sequence's
        error is raised once the loop is idle. A consumer that stops early cancels what is
        left of its sequences."""
        scheduler = self.scheduler
        events: list[tuple[int, TokenEvent | GenerationOutput]] = []
        sequences = [
            scheduler.submit(
                ids,
                p,
                on_token=partial(_keep, events, i),
                on_done=partial(_keep, events, i),
                on_round=on_round,
            )  # fmt: skip
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        try:
            while not all(s.finished.is_set() for s in sequences):
                scheduler.step()
                yield from events
                events.clear()
            for sequence in sequences:
                if sequence.error is not None:
                    raise sequence.error
        finally:
            for sequence in sequences:
                sequence.cancel()
            while not all(s.finished.is_set() for s in sequences):
                scheduler.step()


def _keep(
    events: list[tuple[int, TokenEvent | GenerationOutput]],
    i: int,
    item: TokenEvent | GenerationOutput,
) -> None:
    events.append((i, item))


def params_each(
    prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None
) -> list[SamplingParams]:
    """One SamplingParams per prompt: the one given for all, or the list (its length checked)."""
    if not prompts:
        raise UnderstudyError("a batch needs at least one prompt")
    each = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    if len(each) != len(prompts):
        raise UnderstudyError(
            f"{len(prompts)} prompts but {len(each)} SamplingParams: give one, or one each"
        )
    return each

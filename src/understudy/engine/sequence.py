"""A request in the engine: submitted (a `Sequence`), then running in a seat (`Running`).

A Sequence is what a caller holds: its prompt, parameters and callbacks, a way to cancel it
(thread-safe: it leaves at the next round boundary) and, once over, its output or error.
Running is the engine's side of it while it holds a seat: the request, its round planner and
its stats. The callbacks run on the engine's thread, in order: on_token for every emitted
token, on_round for every round (before that round's tokens), then on_done or on_error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from understudy.config import SamplingParams
from understudy.engine.emitter import TokenEvent, token_logprobs
from understudy.engine.outputs import GenerationOutput, RoundEvent
from understudy.engine.request import Request, Verified
from understudy.engine.stats import StatsRecorder
from understudy.policy.planner import RoundPlanner

OnToken = Callable[[TokenEvent], None]
OnRound = Callable[[RoundEvent], None]
OnDone = Callable[[GenerationOutput], None]
OnError = Callable[[Exception], None]


def _ignore(_: object) -> None:
    pass


@dataclass(eq=False)
class Sequence:
    """One request, from submission to its output."""

    prompt_ids: list[int]
    params: SamplingParams
    on_token: OnToken = _ignore
    on_done: OnDone = _ignore
    on_error: OnError = _ignore
    on_round: OnRound | None = None
    cancelled: bool = False
    output: GenerationOutput | None = None
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this sequence at the next round boundary (thread-safe); its seat is freed."""
        self.cancelled = True


@dataclass(eq=False)
class Running:
    """A sequence holding a seat: its request, planner and stats, and its rounds so far."""

    sequence: Sequence
    request: Request
    planner: RoundPlanner
    recorder: StatsRecorder
    rounds: int = 0
    error: Exception | None = None  # its own failure in a round: it alone ends

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def draft_lag(self) -> int:
        """Tokens the sequence's draft model has not been fed yet (0 without one)."""
        drafter = self.request.seat.drafter
        runner = None if drafter is None else drafter.draft_runner()
        return 0 if runner is None else max(len(self.request.tokens) - runner.length, 0)

    def observe(self, verified: Verified, draft_s: float, verify_s: float) -> None:
        """A verified round: the planner learns from it (unless its guesses were free ones,
        not the drafter's: Proposal.free), the stats count it."""
        proposal = verified.proposal
        kept = len(verified.kept)
        if not proposal.free:
            self.planner.observe(proposal.parents is not None, proposal.size, kept, verified.depth)
        self.recorder.round(proposal.size, kept, draft_s, verify_s)
        self.rounds += 1

    def on_round(self, event: RoundEvent) -> None:
        if self.sequence.on_round is not None:
            self.sequence.on_round(event)

    def emit_round(self, verified: Verified, origin: str) -> None:
        """The round's tokens leave the engine: the kept guesses, then the target's own."""
        kept, last = verified.kept, verified.next_token
        logprobs = token_logprobs(verified.raw_logits, [*kept, last], self.params.logprobs)
        emitter, on_token = self.request.emitter, self.sequence.on_token
        for event in emitter.emit(kept, "accepted", self.rounds, logprobs and logprobs[:-1]):
            on_token(event)
        for event in emitter.emit([last], origin, self.rounds, logprobs and logprobs[-1:]):
            on_token(event)

    def output(self) -> GenerationOutput:
        """What the request gives back, now that it is over."""
        emitter = self.request.emitter
        reason = emitter.finish_reason or "cancelled"
        stats = self.recorder.finish(len(emitter.token_ids), reason)
        return GenerationOutput(emitter.text, emitter.token_ids, stats, self.sequence.prompt_ids)

"""Many sequences in one engine loop: continuous batching, each answer bitwise its solo answer.

The engine has `max_num_seqs` seats (engine/builder.py). A seat is a region of the target's
KV cache with its runner, and a drafter with its own state (for a draft model, its own
region of the draft's cache). A submitted sequence waits for a free seat; between rounds,
waiting sequences are admitted (their prompt prefilled in their seat, alone) and finished or
cancelled ones leave, freeing their seat at once. One round of the batch:

    lengths = the batch plan (policy/batch_plan.py)         each sequence's K, from costs
    drafts  = Drafter.propose_batch(...)                     draft steps shared by sequences
    raw     = extend_together(every sequence's rows)         ONE target pass
    for each sequence: verify, keep, emit                    exactly as a solo round does

Exactness: each sequence's rows attend to its own region as in a pass of its own, and the
target's kernels are row-invariant (shared passes need them: builder.py refuses seats
otherwise), so every row's logits are bitwise the solo pass's; verification is the solo
engine's own code. A greedy sequence's output is therefore its solo output bit for bit, and
a seeded sampled one draws the same random numbers in the same order as alone (its round
lengths are its own planner's, its draft steps its own passes). Rounds here draft chains
only; a tree engine's sequences run chains in a batch (the same output).

Memory: every seat's KV regions are allocated when the engine is built, so the batch never
allocates as sequences come and go; `kv_bytes_per_seat` says what one seat holds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from understudy.config import SamplingParams, UnderstudyError
from understudy.drafters.base import EMPTY, ChainRequest, Drafter, Proposal
from understudy.engine.emitter import TokenEvent
from understudy.engine.outputs import GenerationOutput
from understudy.engine.request import Request, Seat
from understudy.engine.stats import StatsRecorder
from understudy.models.shared_pass import extend_together, shares_passes
from understudy.policy.batch_plan import BatchCosts, Wish, choose_cap
from understudy.policy.planner import RoundPlanner

if TYPE_CHECKING:
    from understudy.engine.engine import Engine

OnToken = Callable[[TokenEvent], None]
OnDone = Callable[[GenerationOutput], None]
OnError = Callable[[Exception], None]


def _ignore(_: object) -> None:
    pass


@dataclass(eq=False)
class Sequence:
    """One request in the batch, from submission to its output."""

    prompt_ids: list[int]
    params: SamplingParams
    on_token: OnToken = _ignore
    on_done: OnDone = _ignore
    on_error: OnError = _ignore
    request: Request | None = None  # from admission on
    planner: RoundPlanner | None = None
    recorder: StatsRecorder | None = None
    rounds: int = 0
    cancelled: bool = False
    output: GenerationOutput | None = None
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop this sequence at the next round boundary (thread-safe); its seat is freed."""
        self.cancelled = True


class BatchLoop:
    """The seats, the waiting line and the rounds. `step()` runs on one thread (the owner of
    the engine); `submit` and `Sequence.cancel` may be called from any thread."""

    def __init__(self, engine: Engine, seats: list[Seat], costs: BatchCosts | None) -> None:
        self.engine = engine
        self.seats = seats
        self.costs = costs
        self.free: list[Seat] = list(reversed(seats))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lock = threading.Lock()
        self.rows_last_pass = 0  # the target pass of the latest round, all sequences together
        self.shared = all(shares_passes(seat.runner) for seat in seats)
        self.drafter_class: type[Drafter] | None = (
            None if engine.drafter is None else type(engine.drafter)
        )

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: OnToken = _ignore,
        on_done: OnDone = _ignore,
        on_error: OnError = _ignore,
    ) -> Sequence:
        sequence = Sequence(list(prompt_ids), params, on_token, on_done, on_error)
        with self.lock:
            self.waiting.append(sequence)
        return sequence

    def step(self) -> None:
        """Retire the cancelled, admit what fits, run one round of every running sequence,
        retire the finished."""
        self._retire()
        self._admit()
        self._retire()  # a sequence may end at its first token
        if self.running:
            self._round()
            self._retire()

    def run_until_done(self) -> None:
        while self.busy:
            self.step()

    # -- admission and retirement ------------------------------------------------------------

    def _admit(self) -> None:
        while self.free:
            with self.lock:
                if not self.waiting:
                    return
                sequence = self.waiting.popleft()
            if sequence.cancelled:
                self._finish(sequence, None)
                continue
            seat = self.free.pop()
            try:
                self._start(sequence, seat)
            except Exception as error:  # this request's alone (a grammar, a budget, a fault)
                self.free.append(seat)  # the seat goes back, whatever failed
                self._fail(sequence, error)
                continue
            self.running.append(sequence)

    def _start(self, sequence: Sequence, seat: Seat) -> None:
        engine = self.engine
        recorder = StatsRecorder(engine.method, engine.k, engine.exact)
        t0 = time.perf_counter()
        request, (first, logprobs) = engine._prefill(sequence.prompt_ids, sequence.params, seat)
        recorder.prefill(time.perf_counter() - t0, len(sequence.prompt_ids))
        sequence.request, sequence.recorder = request, recorder
        sequence.planner = engine._planner(request, trees=False)
        for event in request.emitter.emit([first], "target", 0, logprobs):
            sequence.on_token(event)

    def _retire(self) -> None:
        keep = []
        for sequence in self.running:
            request = sequence.request
            assert request is not None
            if sequence.error is not None:
                self.free.append(request.seat)
                self._fail(sequence, sequence.error)
            elif sequence.cancelled or request.emitter.done:
                self.free.append(request.seat)
                self._finish(sequence, request)
            else:
                keep.append(sequence)
        self.running = keep

    def _finish(self, sequence: Sequence, request: Request | None) -> None:
        if request is not None:
            if request.seat.drafter is not None:
                request.seat.drafter.end(request.tokens)
            emitter, recorder = request.emitter, sequence.recorder
            assert recorder is not None
            reason = emitter.finish_reason or "cancelled"
            stats = recorder.finish(len(emitter.token_ids), reason)
            sequence.output = GenerationOutput(
                emitter.text, emitter.token_ids, stats, sequence.prompt_ids
            )
            if not sequence.cancelled:
                sequence.on_done(sequence.output)
        sequence.finished.set()

    def _fail(self, sequence: Sequence, error: Exception) -> None:
        sequence.error = error
        sequence.on_error(error)
        sequence.finished.set()

    # -- one round -------------------------------------------------------------------------

    def _round(self) -> None:
        running = self.running
        lengths = self._lengths(running)
        t_draft = time.perf_counter()
        proposals = self._propose(running, lengths)
        t_verify = time.perf_counter()
        fed = [
            self.engine.chain_rows(s.request, p)
            for s, p in zip(running, proposals, strict=True)
            if s.request is not None
        ]
        runners = [s.request.seat.runner for s in running if s.request is not None]
        if self.shared:
            raws = extend_together(runners, fed)
        else:  # padded passes cannot share: each sequence its own pass, one after another
            raws = [runner.extend(rows) for runner, rows in zip(runners, fed, strict=True)]
        self.rows_last_pass = sum(rows.shape[0] for rows in fed)
        t_done = time.perf_counter()
        for sequence, proposal, raw in zip(running, proposals, raws, strict=True):
            try:
                draft_s, verify_s = t_verify - t_draft, t_done - t_verify
                self._finish_round(sequence, proposal, raw.cpu(), draft_s, verify_s)
            except Exception as error:  # this request's own (its grammar): it alone ends
                sequence.error = error

    def _finish_round(
        self, sequence: Sequence, proposal: Proposal, raw, draft_s: float, verify_s: float
    ) -> None:
        request, planner, recorder = sequence.request, sequence.planner, sequence.recorder
        assert request is not None and planner is not None and recorder is not None
        engine = self.engine
        verified = engine.judge_chain(request, proposal, raw)
        planner.observe(False, proposal.size, len(verified.kept), verified.depth)
        recorder.round(proposal.size, len(verified.kept), draft_s, verify_s)
        sequence.rounds += 1
        for event in engine._emit(request, verified, sequence.rounds, None):
            sequence.on_token(event)

    def _lengths(self, running: list[Sequence]) -> list[int]:
        """Each sequence's chain length this round: its own planner's, greedy ones capped by
        the batch plan when the engine chooses K itself."""
        wants = []
        for sequence in running:
            assert sequence.request is not None and sequence.planner is not None
            wants.append(sequence.planner.plan(sequence.request.emitter.remaining).k)
        if self.costs is None or self.engine.k != "auto" or len(running) < 2:
            return wants
        wishes = [
            Wish(
                want,
                s.params.greedy,
                s.planner.expected_tokens_upto(want).__getitem__,  # k <= want: one sweep
                _lag(s.request),
                s.request.emitter.remaining,
            )  # fmt: skip
            for want, s in zip(wants, running, strict=True)
            if s.planner is not None and s.request is not None
        ]
        cap = choose_cap(wishes, self.costs)
        return [min(w.want, cap) if w.capped else w.want for w in wishes]

    def _propose(self, running: list[Sequence], lengths: list[int]) -> list[Proposal]:
        if self.drafter_class is None:
            return [EMPTY] * len(running)
        chains = []
        for sequence, k in zip(running, lengths, strict=True):
            request = sequence.request
            assert request is not None and request.seat.drafter is not None
            chains.append(
                ChainRequest(request.seat.drafter, request.tokens, k, request.params,
                             request.generator)
            )  # fmt: skip
        return self.drafter_class.propose_batch(chains)


def _lag(request: Request) -> int:
    """Tokens the sequence's draft model has not been fed yet (0 without a draft model)."""
    drafter = request.seat.drafter
    runner = None if drafter is None else drafter.draft_runner()
    return 0 if runner is None else max(len(request.tokens) - runner.length, 0)


def stream_batch(
    loop: BatchLoop,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams] | None,
) -> Iterator[tuple[int, TokenEvent | GenerationOutput]]:
    """Run every prompt (token ids) through the loop on this thread, yielding (i, event) for
    prompt i as its tokens are emitted, and (i, its GenerationOutput) when it ends."""
    each = params_each(prompts, params)
    events: list[tuple[int, TokenEvent | GenerationOutput]] = []
    sequences = []
    for i, (prompt, p) in enumerate(zip(prompts, each, strict=True)):
        sequences.append(
            loop.submit(
                prompt,
                p,
                on_token=lambda event, i=i: events.append((i, event)),
                on_done=lambda output, i=i: events.append((i, output)),
            )
        )
    try:
        while loop.busy:
            loop.step()
            yield from events
            events.clear()
        for sequence in sequences:
            if sequence.error is not None:
                raise sequence.error
    finally:  # a consumer that stops early cancels what is left
        for sequence in sequences:
            sequence.cancel()
        while loop.busy:
            loop.step()


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


def generate_batch(
    loop: BatchLoop,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams] | None,
) -> list[GenerationOutput]:
    """Run every prompt (token ids) through the loop to its end, on this thread; the outputs
    in order. `params`: one SamplingParams for all, or one each."""
    each = params_each(prompts, params)
    sequences = [loop.submit(p, q) for p, q in zip(prompts, each, strict=True)]
    loop.run_until_done()
    outputs = []
    for sequence in sequences:
        if sequence.error is not None:
            raise sequence.error
        assert sequence.output is not None
        outputs.append(sequence.output)
    return outputs

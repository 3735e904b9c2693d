"""The engine's one loop: seats, admission, rounds. `step()` is the whole of it.

    step():  retire the cancelled -> admit what fits -> run_round(running) -> retire the done

The engine has `max_num_seqs` seats (engine/seats.py). A submitted sequence waits for a free
seat; between rounds, waiting sequences are admitted (their prompt prefilled in their seat,
alone: engine/start.py) and finished or cancelled ones leave, freeing their seat at once. A
solo request is a batch of one: `Engine.generate` and `Engine.stream` submit it and step
until it ends. Memory: every seat's KV regions are allocated when the engine is built, so
the loop never allocates as sequences come and go.

Threads: `step()` runs on one thread (the owner of the engine); `submit` and
`Sequence.cancel` may be called from any thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from understudy.config import Method, SamplingParams
from understudy.engine.request import Seat
from understudy.engine.round import ProposeBatch, run_round
from understudy.engine.sequence import OnDone, OnError, OnRound, OnToken, Running, Sequence
from understudy.engine.start import start_request
from understudy.engine.stats import StatsRecorder
from understudy.models.loader import LoadedModel
from understudy.policy.batch_plan import BatchCosts
from understudy.policy.costs import Costs
from understudy.policy.planner import PlanRules, RoundPlanner
from understudy.policy.tree_choice import TreeOrChain


def _ignore(_: object) -> None:
    pass


@dataclass(frozen=True)
class LoopSetup:
    """What the loop needs of its engine, fixed when the engine is built."""

    target: LoadedModel
    method: Method
    max_context: int
    exact: bool  # every output is plain decoding's (stats.exact)
    rules: PlanRules
    shapes: TreeOrChain | None = None  # tree="auto": learnt across requests
    batch_costs: BatchCosts | None = None  # several seats: caps greedy chains per round


class Scheduler:
    """The seats, the waiting line and the rounds."""

    def __init__(self, setup: LoopSetup, seats: list[Seat]) -> None:
        self.setup = setup
        self.seats = seats
        self.free: list[Seat] = list(reversed(seats))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Running] = []
        self.lock = threading.Lock()
        self.rows_last_pass = 0  # the target pass of the latest round, all sequences together
        drafter = seats[0].drafter
        self.propose_batch: ProposeBatch | None = (
            None if drafter is None else type(drafter).propose_batch
        )

    def retune(self, k: int | Literal["auto"] | None = None, costs: Costs | None = None) -> None:
        """Plan the requests admitted from now on with this K and these costs."""
        rules = self.setup.rules
        rules = replace(rules, k=rules.k if k is None else k, costs=costs or rules.costs)
        self.setup = replace(self.setup, rules=rules)

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
        on_round: OnRound | None = None,
    ) -> Sequence:
        sequence = Sequence(list(prompt_ids), params, on_token, on_done, on_error, on_round)
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
            self.rows_last_pass = run_round(
                self.running, self.propose_batch, self.setup.batch_costs
            )
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
                sequence.finished.set()
                continue
            seat = self.free.pop()
            try:
                running = self._start(sequence, seat)
            except Exception as error:  # this request's alone (a grammar, a budget, a fault)
                self.free.append(seat)  # the seat goes back, whatever failed
                self._fail(sequence, error)
                continue
            self.running.append(running)

    def _start(self, sequence: Sequence, seat: Seat) -> Running:
        setup = self.setup
        recorder = StatsRecorder(setup.method, setup.rules.k, setup.exact)
        t0 = time.perf_counter()
        request, first, logprobs = start_request(
            setup.target, setup.max_context, sequence.prompt_ids, sequence.params, seat
        )
        recorder.prefill(time.perf_counter() - t0, len(sequence.prompt_ids))
        rules = setup.rules if request.processor is None else setup.rules.chains_only()
        running = Running(sequence, request, RoundPlanner(rules, setup.shapes), recorder)
        for event in request.emitter.emit([first], "target", 0, logprobs):
            sequence.on_token(event)
        return running

    def _retire(self) -> None:
        keep = []
        for running in self.running:
            sequence, request = running.sequence, running.request
            if running.error is not None:
                self.free.append(request.seat)
                self._fail(sequence, running.error)
            elif sequence.cancelled or request.emitter.done:
                if request.seat.drafter is not None:
                    request.seat.drafter.end(request.tokens)
                self.free.append(request.seat)
                sequence.output = running.output()
                if not sequence.cancelled:
                    sequence.on_done(sequence.output)
                sequence.finished.set()
            else:
                keep.append(running)
        self.running = keep

    def _fail(self, sequence: Sequence, error: Exception) -> None:
        sequence.error = error
        sequence.on_error(error)
        sequence.finished.set()

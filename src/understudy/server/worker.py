"""One engine, one thread: the worker owns the engine and batches the requests it serves.

The engine is not thread-safe, so every call into it happens on the worker thread. A request
handler (on the asyncio loop) submits a `Job`; the worker starts it, and the job emits events
back to the loop through `job.emit` (thread-safe). Two kinds of job:

- a batched job (`batched=True`: the /v1 generations of an engine with several seats):
  `job.work(job)` encodes the prompt and submits its choices to the engine's batch loop
  (`job.sequences`) without waiting; the sequences' callbacks emit the events as rounds run.
- an exclusive job (the Lab's runs, every job of a one-seat engine): `job.work(job)` has the
  engine to itself until it returns, and checks `job.cancelled` between tokens.

The thread loops: take the newly submitted jobs; start, in order of arrival, each one that
fits (a batched job when the seats free now hold its choices, or the batch is empty; an
exclusive job once the batch has drained, since it runs on the seats the batch uses); then,
while the batch has sequences, step it one round. A job never overtakes an earlier one, so
an exclusive job cannot wait for ever behind a stream of batched ones, and a job that waits
for seats never touches the running batch: it joins between rounds.

A handler that sees its client disconnect calls `job.cancel()`: a job still queued leaves the
queue at once (it stops counting against the bound, and never starts); a running batched
job's sequences leave at the next round boundary, freeing their seats.

Admission is bounded in sequences (a job with n choices counts n): at most `capacity`
(the engine's seats) run and `max_queue` wait; one more is refused with `QueueFull` (HTTP
429), so a burst never grows memory or latency without bound. A job larger than the bound is
still taken when nothing else is in flight, so no request is refused for ever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from understudy.engine.scheduler import Scheduler
from understudy.engine.sequence import Sequence

log = logging.getLogger("understudy.server")

TERMINAL = frozenset({"done", "error", "cancelled"})


class QueueFull(Exception):
    pass


class Job:
    """A unit of engine work plus the channel its events travel back on.

    Events are (kind, payload) pairs; the last one is "done", "error" or "cancelled".
    `size` is the number of sequences the job runs (its choices); `batched` says whether
    `work` only submits sequences to the batch loop (setting `sequences`) or runs to its end."""

    def __init__(
        self,
        work: Callable[[Job], None],
        loop: asyncio.AbstractEventLoop,
        size: int = 1,
        batched: bool = False,
    ) -> None:
        self.work = work
        self.loop = loop
        self.size = size
        self.batched = batched
        self.sequences: list[Sequence] = []
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.ended = False  # a terminal event has been emitted
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.on_cancel: Callable[[Job], None] | None = None  # set by the Worker that queues it

    def emit(self, kind: str, payload: Any = None) -> None:
        """Called on the worker thread. Nothing is sent after the terminal event."""
        if self.ended:
            return
        self.ended = kind in TERMINAL
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    @property
    def over(self) -> bool:
        """A started batched job whose sequences have all ended (in any way)."""
        return all(s.finished.is_set() for s in self.sequences)

    async def stream(
        self, is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.25
    ) -> AsyncGenerator[tuple[str, Any]]:
        """The job's events, up to and including the terminal one. Checks the client between
        events (and every `poll_s` while waiting) and cancels the job when it has gone; the
        iteration then simply ends."""
        try:
            while True:
                try:
                    item = self.events.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        item = await asyncio.wait_for(self.events.get(), timeout=poll_s)
                    except asyncio.TimeoutError:
                        if await is_disconnected():
                            return
                        continue
                if item[0] not in TERMINAL and await is_disconnected():
                    return
                yield item
                if item[0] in TERMINAL:
                    return
        finally:
            self.cancel()  # no-op once the work has finished


class Worker:
    """The single thread that owns the engine (and `batch`, its batch loop, if it has one
    with several seats)."""

    def __init__(self, max_queue: int, batch: Scheduler | None = None) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self.batch = batch
        self.capacity = 1 if batch is None else len(batch.seats)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0  # sequences running + waiting (withdrawn jobs are not counted)
        self._queued: set[Job] = set()  # admitted, not started, not withdrawn
        self._pending: deque[Job] = deque()  # taken by the thread, not started (in order)
        self._active: list[Job] = []  # batched jobs started, not over
        self._exclusive = 0  # 1 while an exclusive job runs
        self._stopping = False
        self.requests_running = 0
        self.rows_last_pass = 0  # rows of the batch's latest shared target pass
        self.on_pass: Callable[[int], None] | None = None  # sees each batch pass's rows
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> int:
        """Sequences generating now."""
        if self.batch is None:
            return self._exclusive
        return self._exclusive + len(self.batch.running)

    @property
    def waiting(self) -> int:
        """Sequences admitted and not generating yet (queued, or waiting for a seat)."""
        return max(0, self._in_flight - self.running)

    @property
    def requests_waiting(self) -> int:
        with self._lock:
            return len(self._queued)

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="understudy-engine", daemon=True
                )
                self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when the sequences in flight would pass
        capacity + max_queue."""
        self.start()
        with self._lock:
            if self._in_flight and self._in_flight + job.size > self.capacity + self.max_queue:
                raise QueueFull
            job.on_cancel = self._withdraw
            self._in_flight += job.size
            self._queued.add(job)
        self._jobs.put(job)

    def _withdraw(self, job: Job) -> None:
        """A job was cancelled: a queued one frees its place now (the thread skips it later);
        a running batched one's sequences leave at the next round boundary."""
        with self._lock:
            if job in self._queued:
                self._queued.discard(job)
                self._in_flight -= job.size
                return
        for sequence in job.sequences:
            sequence.cancel()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the jobs already queued (cancelled ones are skipped), then end the thread."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            idle = not self._pending and not self._active
            if idle and self._stopping:
                return
            self._take(block=idle and not (self.batch is not None and self.batch.busy))
            self._start_what_fits()
            if self.batch is not None and self.batch.busy:
                self._step()

    def _take(self, block: bool) -> None:
        """Move the submitted jobs into `_pending`; wait for one when there is nothing to do."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self._stopping = True
            else:
                self._pending.append(job)

    def _start_what_fits(self) -> None:
        while self._pending:
            job = self._pending[0]
            with self._lock:
                withdrawn = job not in self._queued
            if withdrawn:  # cancelled while it waited: already uncounted
                self._pending.popleft()
                job.emit("cancelled")
                continue
            if not self._fits(job):
                return
            self._pending.popleft()
            with self._lock:
                self._queued.discard(job)
                self.requests_running += 1
            job.started_at = time.perf_counter()
            if job.batched:
                self._start_batched(job)
            else:
                self._run_exclusive(job)

    def _fits(self, job: Job) -> bool:
        batch = self.batch
        if batch is None or not batch.busy:
            return True
        if not job.batched:
            return False  # an exclusive job waits for the batch to drain
        return len(batch.running) + len(batch.waiting) + job.size <= self.capacity

    def _run_exclusive(self, job: Job) -> None:
        self._exclusive = 1
        try:
            job.work(job)
        except Exception as error:  # the server must outlive any one request
            log.exception("request failed")
            job.emit("error", error)
        finally:
            self._exclusive = 0
            self._end(job)

    def _start_batched(self, job: Job) -> None:
        try:
            job.work(job)  # submits job.sequences (none if the request failed first)
        except Exception as error:
            log.exception("request failed")
            job.emit("error", error)
            for sequence in job.sequences:
                sequence.cancel()
        if job.cancelled.is_set():  # cancelled while it was starting
            for sequence in job.sequences:
                sequence.cancel()
        self._active.append(job)
        self._reap()

    def _step(self) -> None:
        batch = self.batch
        assert batch is not None
        try:
            batch.step()
        except Exception as error:  # a fault of the engine, not of one request
            log.exception("a batch round failed")
            for job in self._active:
                job.emit("error", error)
                for sequence in job.sequences:
                    sequence.cancel()
            batch.step()  # every sequence is cancelled: this only retires them
        else:
            self.rows_last_pass = batch.rows_last_pass
            if self.on_pass is not None and batch.rows_last_pass:
                self.on_pass(batch.rows_last_pass)
        self._reap()

    def _reap(self) -> None:
        """End the batched jobs whose sequences have all ended."""
        keep = []
        for job in self._active:
            if job.over:
                if not job.ended:  # cancelled: no sequence reported done
                    job.emit("cancelled")
                self._end(job)
            else:
                keep.append(job)
        self._active = keep

    def _end(self, job: Job) -> None:
        with self._lock:
            self.requests_running -= 1
            self._in_flight -= job.size

"""One engine, one thread: requests queue up and run one at a time (batching is later work).

The engine is not thread-safe, so every call into it happens on the worker thread. A request
handler (on the asyncio loop) submits a `Job`; the worker runs `job.work(job)`, which emits
events back to the loop through `job.emit` (thread-safe). A handler that sees its client
disconnect calls `job.cancel()`; the work function checks `job.cancelled` between tokens and
stops. A job cancelled while still queued leaves the queue at once: it stops counting
against `max_queue` (and in `waiting`) the moment its client goes, and never starts.

Admission is bounded: at most `max_queue` jobs wait while one runs; one more is refused
with `QueueFull` (HTTP 429), so a burst never grows memory or latency without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger("understudy.server")

TERMINAL = frozenset({"done", "error", "cancelled"})


class QueueFull(Exception):
    pass


class Job:
    """A unit of engine work plus the channel its events travel back on.

    Events are (kind, payload) pairs; the last one is "done", "error" or "cancelled"."""

    def __init__(self, work: Callable[[Job], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.on_cancel: Callable[[Job], None] | None = None  # set by the Worker that queues it

    def emit(self, kind: str, payload: Any = None) -> None:
        """Called on the worker thread."""
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

    async def stream(
        self, is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.25
    ) -> AsyncIterator[tuple[str, Any]]:
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
    """The single thread that owns the engine."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._in_flight = 0  # running + waiting (withdrawn jobs are not counted)
        self._queued: set[Job] = set()  # admitted, not started, not withdrawn
        self.running = 0
        self._thread: threading.Thread | None = None

    @property
    def waiting(self) -> int:
        return self._in_flight - self.running

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="understudy-engine", daemon=True
                )
                self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when max_queue jobs already wait behind one."""
        self.start()
        with self._lock:
            if self._in_flight >= self.max_queue + 1:
                raise QueueFull
            job.on_cancel = self._withdraw
            self._in_flight += 1
            self._queued.add(job)
        self._jobs.put(job)

    def _withdraw(self, job: Job) -> None:
        """A queued job was cancelled: free its place now (the thread skips it later)."""
        with self._lock:
            if job in self._queued:
                self._queued.discard(job)
                self._in_flight -= 1

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the jobs already queued (cancelled ones are skipped), then end the thread."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job not in self._queued:  # withdrawn while it waited: already uncounted
                    job.emit("cancelled")
                    continue
                self._queued.discard(job)
                self.running = 1
            try:
                job.started_at = time.perf_counter()
                job.work(job)
            except Exception as error:  # the server must outlive any one request
                log.exception("request failed")
                job.emit("error", error)
            finally:
                with self._lock:
                    self.running = 0
                    self._in_flight -= 1

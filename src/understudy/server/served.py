"""The engine as the HTTP routes share it: its worker thread, its metrics and the name
clients ask for it by. Every route that generates submits its work here, so admission (the
bounded queue, HTTP 429) and the model check are the same for /v1 and the Lab."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from understudy.engine.seats import kv_bytes_per_seat
from understudy.server.logprobs import TokenStrings
from understudy.server.metrics import Metrics
from understudy.server.protocol import APIError
from understudy.server.worker import Job, QueueFull, Worker


class ServedModel:
    """`engine` served as `name`: one worker thread (worker.py) owns the engine; /v1 requests
    run together on its seats when it has several (`batched`, engine/scheduler.py), else one at a
    time. At most `max_queue` sequences wait; one more is refused with HTTP 429."""

    def __init__(self, engine: Any, name: str, max_queue: int) -> None:
        self.engine = engine
        self.name = name
        self.seats = engine.scheduler.seats
        self.batched = len(self.seats) > 1
        self.worker = Worker(max_queue, engine.scheduler if self.batched else None)
        self.metrics = Metrics(name, str(engine.method))
        self.worker.on_pass = self.metrics.batch_pass
        self.kv_per_seq = kv_bytes_per_seat(self.seats)
        self.created = int(time.time())
        self.strings = TokenStrings(engine.tokenizer)  # token ids -> strings and bytes

    def submit(self, work: Any, size: int = 1, in_batch: bool = False) -> Job:
        """Queue `work` (`size` sequences) on the worker; HTTP 429 when the queue is full.
        Call it on the event loop: the job's events come back to this loop."""
        job = Job(work, asyncio.get_running_loop(), size, in_batch)
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: {self.worker.max_queue} sequences are already waiting; "
                "retry later",
                kind="rate_limit_error",
                code="queue_full",
            ) from None
        return job

    def check_model(self, requested: str, param: str = "model") -> None:
        """HTTP 404 unless `requested` is the name this server serves."""
        if requested != self.name:
            raise APIError(
                404,
                f"the model {requested!r} does not exist: this server serves {self.name!r}",
                param,
                kind="not_found_error",
                code="model_not_found",
            )

    def model_card(self) -> dict[str, Any]:
        """The model as /v1/models lists it."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "understudy",
            "max_model_len": self.engine.max_context,
        }

"""The seats of a batched engine: one region of each model's KV cache per sequence.

Seat 0 is the engine's own runner and drafter (region 0); seat i's runner starts at slot
i * region of the same target model, and its drafter is `drafter.for_seat(i)` (a draft
model's runner likewise in region i of the draft's cache). All regions are allocated here,
at build, so admitting and retiring sequences never allocates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from understudy.config import UnderstudyError
from understudy.drafters.base import Drafter
from understudy.engine.request import Seat
from understudy.models.runner import Runner
from understudy.models.shared_pass import shares_passes
from understudy.models.transformer import Transformer

if TYPE_CHECKING:
    from understudy.models.hf_fallback import FallbackLM

# max_num_seqs="auto": this many seats where sequences can share a pass (a wider pass costs
# rows' arithmetic, which a CPU's memory-bound pass hides up to about this many), else one.
AUTO_SEATS = 8


def can_batch(runner: Runner, drafter: Drafter | None) -> bool:
    """Whether sequences on `runner` can share target passes with this drafter."""
    return shares_passes(runner) and (drafter is None or drafter.traits.batches)


def make_seats(runner: Runner, drafter: Drafter | None, count: int | Literal["auto"]) -> list[Seat]:
    """`count` seats over the target of `runner` (seat 0 is `runner` and `drafter`);
    "auto": AUTO_SEATS where `can_batch`, else 1."""
    if count == "auto":
        count = AUTO_SEATS if can_batch(runner, drafter) else 1
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UnderstudyError(f"max_num_seqs must be an integer >= 1 or 'auto', got {count!r}")
    seats = [Seat(runner, drafter)]
    if count == 1:
        return seats
    if not shares_passes(runner):
        raise UnderstudyError(
            "max_num_seqs > 1 needs the target's row-invariant kernels (float32 or a GGUF "
            "model's own blocks on a CPU) on a fast-path architecture: this target pads every "
            "pass to a fixed row budget or runs on transformers' own code, which cannot hold "
            "other sequences' rows"
        )
    for index in range(1, count):
        seat_runner = Runner(
            runner.model, runner.max_context, runner.rows, runner.pad, index * runner.slots
        )
        seat_runner.keep_hidden = runner.keep_hidden
        seats.append(Seat(seat_runner, None if drafter is None else drafter.for_seat(index)))
    return seats


def kv_bytes(model: Transformer | FallbackLM, slots: int) -> int:
    """Bytes of keys and values `slots` slots of `model`'s cache hold (every layer; the
    cache is in the model's dtype)."""
    cfg = model.cfg
    element = model.dtype.itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * element * slots


def kv_bytes_per_seat(seats: list[Seat]) -> int:
    """What one sequence's seat holds in KV memory: the target's region, plus the draft
    model's where the drafter has one."""
    seat = seats[0]
    total = kv_bytes(seat.runner.model, seat.runner.slots)
    draft = None if seat.drafter is None else seat.drafter.draft_runner()
    if draft is not None:
        total += kv_bytes(draft.model, draft.slots)
    return total

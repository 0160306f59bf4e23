"""A whole batch (a Task): fetched by torch's fetcher (or sample by sample
with seed_per_sample), collated straight into its slot where it has one,
and delivered: published on the ring, or outside it (no slot, a batch that
outgrew its slot, one that cannot be laid out) in a one-off segment of its
own (see _one_off.py) or pickled by torch through the result pipe.

A whole batch carries the worker's state after it (see _state.py),
in its slot's metadata or its pipe message, unless nothing in it can differ
(seed_per_sample over a map-style dataset).
"""

from __future__ import annotations

from torch.utils.data import _DatasetKind

from .._shm import _layout
from . import _one_off
from ._arena import slot_bytes_needed
from ._protocol import MEASURE, NO_RING, NO_SLOT, RING_FULL, SPILL, Batch, ErrorReply, Segment, Stop
from ._state import STATE_BYTES, worker_snapshot
from ._tasks import TaskContext


def batch(ctx: TaskContext, fetcher, task):
    """Fetch and deliver one batch (a Task).  Returns the pipe reply, or
    None."""
    task_id, slot = task.task_id, task.slot
    ctx.counters.start()
    arena = None
    if slot >= 0:
        assert ctx.mapped is not None  # (a slot of the ring: the ring has come)
        try:
            arena = ctx.mapped.arena(slot, STATE_BYTES if ctx.snapshots else 0)
        except OSError as e:  # memory ran out since the ring was made
            ctx.give_back(slot)
            return ErrorReply.wire(task_id, ctx.shm_full(e), None)
    if ctx.slot_collate is not None:
        ctx.slot_collate.arena = arena
    try:
        if ctx.cfg.seed_per_sample:
            data = ctx.samples.batch(task.index, task.epoch, task.position)
        else:
            data = fetcher.fetch(task.index)
    except Exception as e:
        ctx.give_back(slot)
        if isinstance(e, StopIteration) and ctx.cfg.dataset_kind == _DatasetKind.Iterable:
            # (It was False: stale tasks never get here.)  Every later
            # task of this epoch is stale.
            ctx.iteration_end = True
            # With the worker's RNG states: the draws of a partial batch
            # that drop_last discarded are part of where the next epoch
            # starts (the dataset's own state is not: it starts afresh).
            return Stop.wire(task_id, worker_snapshot(None) if ctx.snapshots else None)
        # With the worker's state: the draws made before the error are
        # part of where a resume starts (an error is a yielded item).
        return ErrorReply.wire(task_id, ctx.batch_error(e), ctx.snapshot())
    samples = ctx.collate_fn.samples
    state = ctx.snapshot()
    if (
        arena is not None
        and (ctx.slot_collate is None or ctx.slot_collate.arena is not None)
        and _publish(ctx, arena, slot, task_id, data, samples, state)
    ):
        return None
    return _unslotted(ctx, arena, slot, task_id, data, samples, state)


def _publish(ctx: TaskContext, arena, slot, task_id, data, samples, state) -> bool:
    """Write the batch's metadata into its slot (its tensors are there
    already, or go there now) and publish it.  False where it does not
    fit, or cannot be pickled: the pipe's path decides then."""
    try:
        meta_off, meta_len = arena.write_meta(
            _layout.dumps(data, arena.place_all, samples, state, arena.owns)
        )
    except Exception:
        return False  # SlotFull, or something unpicklable
    assert ctx.mapped is not None  # the arena is one of its slots
    ctx.counters.add(ctx.mapped, samples, 1, arena.used)
    ctx.mapped.ring.publish(slot, task_id, meta_off, meta_len)
    return True


def _unslotted(ctx: TaskContext, arena, slot, task_id, data, samples, state):
    """Deliver a batch outside the ring: in a one-off segment where it can
    be measured, else pickled for the pipe.  Returns the pipe reply, or
    None once sent."""
    reason = {NO_SLOT: RING_FULL, MEASURE: NO_RING}.get(slot, SPILL)
    # What it takes in a slot: the size of its one-off segment, and of
    # the ring to make (or to make when the next epoch starts: this one
    # outgrew it).
    measured = slot == MEASURE or (slot >= 0 and ctx.cfg.measures_spills)
    owns = arena.owns if arena is not None else None  # (the slot's views are copied out)
    needed = _slot_bytes_needed(data, state, owns)
    if needed:
        try:
            # (A little room beyond the measure: the metadata's pickle
            # may differ from the measured one by a few bytes.)
            segment = _one_off.write(
                task_id,
                data,
                samples,
                state,
                needed + 4096,
                STATE_BYTES if ctx.snapshots else 0,
                owns,
            )
        except OSError as e:  # no memory for it
            ctx.give_back(slot)
            return ErrorReply.wire(task_id, ctx.shm_full(e), None)
        except Exception:
            pass  # SlotFull, or something unpicklable: torch's path decides below
        else:
            ctx.give_back(slot)
            ctx.counters.add(ctx.mapped, samples, 1, needed)
            _one_off.send(
                ctx.cfg.results,
                Segment.wire(task_id, reason, needed if measured else 0, samples),
                segment,
            )
            return None
    needed = needed if measured else 0
    reply: bytes | tuple  # Batch pickled, or ErrorReply
    try:
        # Pickled here, not by the pipe, so that a batch that cannot be
        # pickled becomes this task's error instead of killing the worker;
        # tensors stacked into the slot are copied out, since the slot is
        # given back below and may be refilled at once.
        reply, shared_bytes = _layout.dumps_detached(
            Batch.wire(task_id, reason, data, needed, samples, state), owns
        )
    except Exception as e:
        reply, shared_bytes = ErrorReply.wire(task_id, ctx.batch_error(e), None), 0
    ctx.give_back(slot)
    ctx.counters.add(
        ctx.mapped, samples, 1, len(reply) + shared_bytes if isinstance(reply, bytes) else 0
    )
    return reply


def _slot_bytes_needed(data, state, owns) -> int:
    """The bytes `data` and the worker's state would take in a slot, or 0
    where the batch cannot be measured (torch's pickling decides on it)."""
    try:
        needed = slot_bytes_needed(data, owns)
    except Exception:
        return 0
    if state is not None:  # a state beyond the room kept for it
        needed += max(0, len(state) - STATE_BYTES)
    return needed

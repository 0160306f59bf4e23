"""fetch="sample" in a worker (see _sample_layout.py): every worker gets
every batch's task and fills its share of the rows, each sample written
straight into its row; whoever writes the last row publishes the slot.
Which rows are whose: "interleaved", the sample at epoch position j is
worker j % num_workers's; "dynamic", each worker claims the next unwritten
row (a CAS in the slot's descriptor) until none is left.

The loader's first batch comes before there is a ring (a Probe): each
worker fetches its interleaved share and keeps it for its rows, and the one
with row 0 describes the layout its sample fixes, from which the main
process makes the ring.
"""

from __future__ import annotations

from typing import Any

from torch._utils import ExceptionWrapper

from ._channels import send
from ._protocol import Described, ErrorReply, RowErrorReply
from ._sample_layout import SampleLayout
from ._tasks import TaskContext


class _Reraised(Exception):
    """A worker_init_fn error, answered for every row."""

    def __init__(self, wrapper):
        self.wrapper = wrapper


def probe(ctx: TaskContext, probe, error):
    """The loader's first batch, before there is a ring: fetch this
    worker's interleaved share of its samples and keep them for their
    rows.  The worker with row 0 describes the layout its sample fixes as
    soon as it has it, so the main process makes the ring while everyone
    goes on fetching.  Returns None: the layout (or row 0's error) is sent
    from inside the loop."""
    cfg = ctx.cfg
    task_id, index, epoch, position = probe.task_id, probe.index, probe.epoch, probe.position
    fetched: dict[int, Any] = {}  # row -> sample, or the ExceptionWrapper of its failure
    ctx.probed = (task_id, fetched)
    for row in range((cfg.worker_id - position) % cfg.num_workers, len(index), cfg.num_workers):
        ctx.counters.start()
        sample = error
        if error is None:
            try:
                sample = ctx.samples.get(index[row], epoch, position + row)
            except Exception:
                sample = ExceptionWrapper(where=ctx.where)
        fetched[row] = sample
        ctx.counters.add(ctx.mapped, 1, 0, 0)
        if row == 0:
            send(cfg.results, _describe(ctx, task_id, sample, probe.capacity))
    return None


def _describe(ctx: TaskContext, task_id, sample, capacity):
    if isinstance(sample, ExceptionWrapper):
        return ErrorReply.wire(task_id, sample, None)
    try:
        return Described.wire(task_id, SampleLayout(sample, capacity))
    except Exception:
        return ErrorReply.wire(task_id, ExceptionWrapper(where=ctx.where), None)


def _my_rows(ctx: TaskContext, task_id, slot, nrows, position, first_row, fetched):
    """This worker's rows of a task, in order: those it fetched before the
    ring existed, then its share of the rest."""
    cfg = ctx.cfg
    yield from sorted(fetched)
    if cfg.assignment == "dynamic":
        assert ctx.mapped is not None  # (a Rows task comes with a slot of the ring)
        while (row := ctx.mapped.ring.row_claim(slot, task_id)) is not None:
            yield row
    else:
        start = (cfg.worker_id - position) % cfg.num_workers
        for row in range(start, nrows, cfg.num_workers):
            if row >= first_row:
                yield row


def rows(ctx: TaskContext, task, stale, error):
    """Write this worker's rows of a batch (a Rows task); rows of a stale
    task are counted done unwritten, so that the slot still completes and
    goes back.  Returns None: errors go out as they happen."""
    task_id, slot = task.task_id, task.slot
    mapped, layout = ctx.mapped, ctx.layout
    assert mapped is not None and layout is not None  # both come before any Rows task
    memory = storage = None
    if not stale:
        try:
            memory, storage = mapped.slot(slot)
        except OSError as e:  # every row of mine fails with it
            error = error or ctx.shm_full(e)
    fetched = ctx.probed[1] if ctx.probed is not None and ctx.probed[0] == task_id else {}
    ctx.probed = None
    for row in _my_rows(
        ctx, task_id, slot, len(task.index), task.position, task.first_row, fetched
    ):
        failed = False
        if not stale:
            ctx.counters.start()
            failed = _write_row(ctx, layout, task, row, fetched, (memory, storage), error)
            ctx.counters.add(
                mapped,
                0 if row in fetched else 1,
                0,
                0 if failed else layout.sample_bytes,
            )
        mapped.ring.row_done(slot, failed)
    return None


def _write_row(ctx: TaskContext, layout, task, row, fetched, slot_memory, error) -> bool:
    """Fetch (unless the probe did) and write one row of a task; True where
    it failed, its RowErrorReply sent."""
    index = task.index
    collating = False
    try:
        if error is not None:
            raise _Reraised(error)
        sample = (
            fetched[row]
            if row in fetched
            else ctx.samples.get(index[row], task.epoch, task.position + row)
        )
        if isinstance(sample, ExceptionWrapper):
            raise _Reraised(sample)
        collating = True
        memory, storage = slot_memory
        layout.write_row(memory, storage, row, sample, index[row])
    except _Reraised as e:
        send(ctx.cfg.results, RowErrorReply.wire(task.task_id, row, e.wrapper, False))
        return True
    except Exception:
        send(
            ctx.cfg.results,
            RowErrorReply.wire(task.task_id, row, ExceptionWrapper(where=ctx.where), collating),
        )
        return True
    return False

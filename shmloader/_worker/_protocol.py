"""The messages between the main process and its workers, as typed records.

Main -> worker, over the worker's task pipe: Configure (first, under spawn
and forkserver), RingFds, UseLayout, Task, Rows, Probe, ResumeWorker, and
EXIT, LEAVE or FINISH (the fds of Configure and RingFds follow over the
result socket).  Worker -> main, over the worker's result socket: Segment,
Batch, ErrorReply, RowErrorReply, Described, Stop, Resumed, FINISHED.  A batch written into a ring slot sends no message at all: the
slot is published on the ring (see _ring.pyx), and the main process takes
it as a SlotLease.  The records are replies, not exceptions: an error
travels inside ErrorReply or RowErrorReply, wrapped as torch wraps it.

On the wire every message is a plain tuple whose first item is its kind,
built by its record's wire() and read back into the record by from_main()
(in the worker) or from_worker() (in the main process); code on either side
reads fields by name, never by position.  Plain tuples, not the records
themselves: pickle has a fast path for exact tuples only, and a record costs
~2.5 us more to pickle and ~2 us more to unpickle (by class reference), where
a task goes out per batch and main-process CPU per batch is a headline
figure; wire() plus _make() on reading cost ~0.4 us.  Kinds are unique within
each direction ("layout" goes both ways: UseLayout and Described).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from torch._utils import ExceptionWrapper

    from .._shm._ring import SlotLease
    from ._sample_layout import SampleLayout

# A Task's slot when it has no slot of the ring (slot numbers are >= 0):
NO_SLOT = -1  # every slot is held: a one-off segment (see _one_off.py)
MEASURE = -2  # no ring yet: a one-off segment, and report the size needed

# Why a batch came outside the ring (Segment.reason, Batch.reason).
NO_RING = "no_ring"  # sent before the ring was made (MEASURE)
RING_FULL = "ring_full"  # every slot was held (NO_SLOT)
SPILL = "spill"  # it did not fit its slot

# Main -> worker: exit (the iterator shuts down, or the worker's
# IterableDataset ran out); LEAVE: exit where nobody waits for it, in the
# cores' idle time (_exit.step_aside); FINISH: exit once the tasks sent
# before it are answered, saying FINISHED first (a non-persistent iterator's
# sampler ran out: see NOTE [pool: finished workers] in _main/_pool.py).
# EXIT supersedes the tasks queued before it (they are given up), FINISH
# does not.  Sent as they are, not as tuples.
EXIT = None
LEAVE = False
FINISH = True

# A worker's exit status when the ring's fds did not reach it or could not be
# mapped (no room for more open files), or when its address space had no room
# for the ring: the main process names the cause (see _pool._exit_description).
NO_RING_FDS_EXIT = 75
NO_RING_MAPPING_EXIT = 76


# ---- main -> worker ---------------------------------------------------------


class Configure(NamedTuple):
    """Main -> a worker started before its iterator's config was known (spawn
    and forkserver: see NOTE [pool: configured after start]), its first
    message: the WorkerConfig fields but its connections and shared objects;
    the shared objects' nfds fds follow over the result socket (SCM_RIGHTS)."""

    kind: str
    fields: dict[str, Any]
    nfds: int

    @staticmethod
    def wire(fields, nfds) -> tuple:
        return ("configure", fields, nfds)


class RingFds(NamedTuple):
    """Main -> every worker, when a ring is made: the ring's segment fd and
    eventfd follow over the worker's result socket (SCM_RIGHTS)."""

    kind: str

    @staticmethod
    def wire() -> tuple:
        return ("ring",)


class UseLayout(NamedTuple):
    """Main -> every worker, fetch="sample", with each ring: the rows' layout."""

    kind: str
    layout: SampleLayout

    @staticmethod
    def wire(layout) -> tuple:
        return ("layout", layout)


class Task(NamedTuple):
    """Main -> one worker, per batch: fetch this batch whole and deliver it."""

    kind: str
    task_id: int  # unique over the iterator's life
    index: Any  # the sampler's indices (or the batch_sampler's batch)
    slot: int  # the ring slot claimed for it (>= 0), NO_SLOT or MEASURE
    epoch: int
    position: int  # epoch position of its first sample

    @staticmethod
    def wire(task_id, index, slot, epoch, position) -> tuple:
        return ("task", task_id, index, slot, epoch, position)


class Rows(NamedTuple):
    """Main -> every worker, per batch of fetch="sample": write your rows of it."""

    kind: str
    task_id: int
    slot: int  # >= 0: the slot's row count is set before any worker hears of it
    index: Any
    epoch: int
    position: int  # epoch position of its first sample (row 0)
    first_row: int  # rows below it were fetched by their probe

    @staticmethod
    def wire(task_id, slot, index, epoch, position, first_row) -> tuple:
        return ("rows", task_id, slot, index, epoch, position, first_row)


class Probe(NamedTuple):
    """Main -> every worker, fetch="sample"'s first batch, before there is a
    ring: fetch your rows of it and keep them; the worker with row 0 answers
    Described (or ErrorReply)."""

    kind: str
    task_id: int
    index: Any
    epoch: int
    position: int
    capacity: int  # rows a slot holds: the loader's batch size

    @staticmethod
    def wire(task_id, index, epoch, position, capacity) -> tuple:
        return ("probe", task_id, index, epoch, position, capacity)


class ResumeWorker(NamedTuple):
    """Main -> every worker, as a new epoch of persistent workers starts;
    answered with Resumed once the old epoch's tasks are done.  (Not
    _resume.Resume, a loaded state_dict().)"""

    kind: str
    shared_seed: int | None  # re-seeds an IterDataPipe's shared RNG
    # the number of an epoch whose prefetched tasks were dropped (go back to
    # the RNG state from before them), or None
    rewind: int | None

    @staticmethod
    def wire(shared_seed, rewind) -> tuple:
        return ("resume", shared_seed, rewind)


# ---- worker -> main ---------------------------------------------------------


class Segment(NamedTuple):
    """Worker -> main, for a Task whose batch went in a one-off segment of its
    own (see _one_off.py): the segment's fds follow in the pipe's stream."""

    kind: str
    task_id: int
    reason: str  # NO_RING, SPILL or RING_FULL
    # what it takes in a slot where measured (NO_RING; SPILL with slot_bytes=None), else 0
    slot_bytes_needed: int
    samples: int
    # None on the wire: the main process puts the segment's SlotLease here
    # as it receives the fds.
    lease: SlotLease | None

    @staticmethod
    def wire(task_id, reason, slot_bytes_needed, samples) -> tuple:
        return ("segment", task_id, reason, slot_bytes_needed, samples, None)


class Batch(NamedTuple):
    """Worker -> main, for a Task whose batch could not be laid out in shared
    memory: the batch itself, pickled by torch (pre-pickled by the worker)."""

    kind: str
    task_id: int
    reason: str  # NO_RING, SPILL or RING_FULL
    data: Any
    # what it takes in a slot where measured (NO_RING; SPILL with slot_bytes=None), else 0
    slot_bytes_needed: int
    samples: int
    state: bytes | None  # the worker's state after it (see _state.py), or None

    @staticmethod
    def wire(task_id, reason, data, slot_bytes_needed, samples, state) -> tuple:
        return ("batch", task_id, reason, data, slot_bytes_needed, samples, state)


class ErrorReply(NamedTuple):
    """Worker -> main, for a Task or Probe that failed: its result is the error
    (a record on the wire; the exception is in its wrapper)."""

    kind: str
    task_id: int
    wrapper: ExceptionWrapper
    # the worker's state after it (an error is a yielded item: see
    # _state.py), or None
    state: bytes | None

    @staticmethod
    def wire(task_id, wrapper, state) -> tuple:
        return ("error", task_id, wrapper, state)


class RowErrorReply(NamedTuple):
    """Worker -> main, fetch="sample": one row of a Rows task failed; sent
    before the row is counted done, so it has arrived when its slot has."""

    kind: str
    task_id: int
    row: int
    wrapper: ExceptionWrapper
    collating: bool  # it failed writing the row (the layout), not fetching the sample

    @staticmethod
    def wire(task_id, row, wrapper, collating) -> tuple:
        return ("row_error", task_id, row, wrapper, collating)


class Described(NamedTuple):
    """Worker -> main, from the worker with a Probe's row 0: the layout its
    first sample fixes."""

    kind: str
    task_id: int
    layout: SampleLayout

    @staticmethod
    def wire(task_id, layout) -> tuple:
        return ("layout", task_id, layout)


class Stop(NamedTuple):
    """Worker -> main, for a Task: the worker's IterableDataset ran out."""

    kind: str
    task_id: int
    state: bytes | None  # the worker's RNG states after it, or None

    @staticmethod
    def wire(task_id, state) -> tuple:
        return ("stop", task_id, state)


class Finished(NamedTuple):
    """Worker -> main, answering FINISH: this worker's last message; it exits."""

    kind: str

    @staticmethod
    def wire() -> tuple:
        return ("finished",)


FINISHED = Finished.wire()


class Resumed(NamedTuple):
    """Worker -> main, answering ResumeWorker: where the worker's new epoch begins."""

    kind: str
    worker_id: int
    rng_state: bytes | None  # the RNG states the old epoch's tasks left, or None

    @staticmethod
    def wire(worker_id, rng_state) -> tuple:
        return ("resumed", worker_id, rng_state)


# Each direction's records by kind (every message's first item).
_FROM_MAIN = {
    "configure": Configure._make,
    "ring": RingFds._make,
    "layout": UseLayout._make,
    "task": Task._make,
    "rows": Rows._make,
    "probe": Probe._make,
    "resume": ResumeWorker._make,
}
_FROM_WORKER = {
    "segment": Segment._make,
    "batch": Batch._make,
    "error": ErrorReply._make,
    "row_error": RowErrorReply._make,
    "layout": Described._make,
    "stop": Stop._make,
    "resumed": Resumed._make,
    "finished": Finished._make,
}


def from_main(msg):
    """The record of a message the worker read from its task pipe (EXIT,
    LEAVE and FINISH as they are)."""
    return msg if msg is EXIT or msg is LEAVE or msg is FINISH else _FROM_MAIN[msg[0]](msg)


def from_worker(msg):
    """The record of a message the main process read from a worker's pipe."""
    return _FROM_WORKER[msg[0]](msg)

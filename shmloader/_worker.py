"""The worker process: torch's worker loop, with batches written into slots.

Seeding, WorkerInfo, worker_init_fn, fetchers and exception wrapping are
torch's own (torch/utils/data/_utils/worker.py), so datasets see exactly what
they see under torch's DataLoader.  What differs is the transport: a task that
comes with a slot is collated into it and published on the ring; everything
else (no slot, a batch that outgrew its slot, errors, end of an iterable) goes
to the main process through this worker's result pipe: a batch in a one-off
memfd segment of its own (see _one_off.py), anything else pickled by torch.

fetch="sample" (see _sample_layout.py): every worker gets every batch's task and
fills its share of the rows, each sample written straight into its row;
whoever writes the last row publishes the slot.  Which rows are whose:
"interleaved", the sample at epoch position j is worker j % num_workers's;
"dynamic", each worker claims the next unwritten row (a CAS in the slot's
descriptor) until none is left.

The messages both ways, and what each field holds: see _protocol.py.

A whole batch carries the worker's state after it (see _worker_state.py), in its
slot's metadata or its pipe message, unless nothing in it can differ
(seed_per_sample over a map-style dataset).

Per-worker counters in the ring (busy ns, samples, batches, bytes written)
are added once the ring exists; until then they are kept here.
"""

from __future__ import annotations

import collections
import copy
import errno
import os
import random
import select
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler, recvfds
from typing import Any, Callable

import numpy as np
import numpy.random  # noqa: F401  here, once: else every forked worker imports it (~9 ms) to seed
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, _DatasetKind
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.graph_settings import apply_random_seed

from . import _layout, _one_off
from ._arena import Arena, SlotCollate, slot_bytes_needed
from ._errors import SharedMemoryError
from ._malloc import keep_freed_memory
from ._protocol import (
    EXIT,
    MEASURE,
    NO_RING,
    NO_RING_FDS_EXIT,
    NO_RING_MAPPING_EXIT,
    NO_SLOT,
    RING_FULL,
    SPILL,
    Batch,
    Described,
    Error,
    Resume,
    Resumed,
    RingFds,
    RowError,
    Segment,
    Stop,
    from_main,
)
from ._ring import Ring, SlotMemory
from ._sample_layout import SampleLayout
from ._seeding import Samples
from ._segment import shm_full_message, transport_shm_full_message
from ._user_objects import attribute
from ._worker_exit import exit_now, orphaned, set_exit_handlers
from ._worker_state import (
    STATE_BYTES,
    carries_state,
    plain_worker_state,
    restore_worker_rng,
    worker_snapshot,
)

# Without pidfds: how often a waiting worker checks that its main process lives.
WATCHDOG_INTERVAL = 1.0


@dataclass(frozen=True)
class WorkerConfig:
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable | None  # the loader's, called as torch calls it (None too)
    slot_collate: bool  # SlotCollate in its place (it is default_collate)
    drop_last: bool
    base_seed: int
    init_fn: Callable | None
    worker_id: int
    num_workers: int
    shared_seed: int | None
    seed_per_sample: bool  # seed random/torch/numpy before each sample
    assignment: str  # fetch="sample": "interleaved" or "dynamic"
    measures_spills: bool  # slot_bytes=None: the slots grow to fit a spilled batch
    resume_state: dict | None  # plain worker state to start from (load_state_dict)
    manager_pid: int  # the main process: workers exit when it is gone
    tasks: Any  # Connection (a socket: it also carries the ring's fds)
    results: Any  # Connection


class _Inbox:
    """Messages from the main process, read ahead so that tasks made stale by
    a later exit are skipped instead of computed.  (Tasks made stale by a
    new epoch of persistent workers are computed and dropped, as torch's
    workers do: what they draw from the RNGs is part of the next epoch's
    augmentations.)

    Waiting also watches the main process itself: a pidfd (readable once it
    has exited) where the kernel has them, else a check every
    WATCHDOG_INTERVAL.  Its pid comes from the main process, not getppid()
    here, which would already name a reaper if the main process died before
    this worker got this far."""

    def __init__(self, conn, manager_pid):
        self._conn = conn
        self._pending = collections.deque()
        self._manager_pid = manager_pid
        self.manager_gone = False
        self._manager_fd = None
        try:
            self._manager_fd = os.pidfd_open(manager_pid)
        except ProcessLookupError:
            self.manager_gone = True
        except (AttributeError, OSError):
            pass  # no pidfds: poll liveness instead
        self.ring_fds = None

    def _manager_alive(self) -> bool:
        try:
            os.kill(self._manager_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _read_available(self, timeout):
        while self._conn.poll(timeout):
            msg = from_main(self._conn.recv())
            if msg is not EXIT and msg.kind == "ring":
                # The fds follow the message in the stream: take them now.
                try:
                    with socket.fromfd(
                        self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM
                    ) as s:
                        self.ring_fds = recvfds(s, 2)
                except (RuntimeError, AssertionError, OSError) as e:
                    # No fd left for the socket's dup, or the kernel dropped the fds.
                    if isinstance(e, OSError) and e.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    raise _NoRingFds(str(e)) from e
            else:
                self._pending.append(msg)
            timeout = 0

    def _sleep(self) -> None:
        """Until a message comes or the main process is gone."""
        if self._manager_fd is not None:
            fired = wait([self._conn, self._manager_fd])
            self.manager_gone = fired == [self._manager_fd]
        elif not wait([self._conn], WATCHDOG_INTERVAL):
            self.manager_gone = not self._manager_alive()

    def next(self):
        """The next message, or None when told to exit or the main process is
        gone.  Sleeps in the kernel until one of those happens."""
        while not self._pending and self.ring_fds is None:
            if self.manager_gone:
                return None
            self._sleep()
            self._read_available(0)
        self._read_available(0)
        if self.ring_fds is not None:
            return _RING_FDS
        return self._pending.popleft()

    def superseded(self) -> bool:
        """True when an exit is already queued behind the current task."""
        return any(m is EXIT for m in self._pending)


_RING_FDS = RingFds._make(RingFds.wire())


def _seed(cfg: WorkerConfig) -> int:
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(cfg.base_seed, cfg.worker_id))
    return seed


class _Slots:
    """This worker's view of the ring: one torch storage per slot, made once."""

    def __init__(self, fds: tuple[int, int]) -> None:
        try:
            self.ring = Ring.attach(*fds)  # keeps its own copies of the fds
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise _NoRingFds(str(e)) from e
            if e.errno == errno.ENOMEM:
                raise _NoRingMapping(str(e)) from e
            raise
        for fd in fds:
            os.close(fd)
        self._storages: dict[int, tuple[SlotMemory, torch.UntypedStorage]] = {}

    def slot(self, slot: int) -> tuple[SlotMemory, torch.UntypedStorage]:
        """(SlotMemory, uint8 storage) of `slot`; its first use reserves its
        pages (OSError when memory has run out since the ring was made)."""
        if slot not in self._storages:
            self.ring.reserve(slot)
            memory = self.ring.memory(slot)
            storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
            self._storages[slot] = (memory, storage)
        return self._storages[slot]

    def arena(self, slot: int, reserve: int) -> Arena:
        return Arena(*self.slot(slot), reserve=reserve)


class _Busy:
    """This worker's counters: busy ns, samples, batches, bytes written.
    Added to the ring's copy when there is one, kept until then."""

    def __init__(self, worker_id):
        self._worker_id = worker_id
        self._pending = [0, 0, 0, 0]
        self.started = 0

    def start(self):
        self.started = time.perf_counter_ns()

    def add(self, slots, samples, batches, nbytes):
        pending = self._pending
        pending[0] += time.perf_counter_ns() - self.started
        pending[1] += samples
        pending[2] += batches
        pending[3] += nbytes
        if slots is not None:
            slots.ring.worker_add(self._worker_id, *pending)
            self._pending = [0, 0, 0, 0]


class _NoRingFds(Exception):
    """The ring's fds did not all arrive with their message, or could not be
    duplicated to map it."""


class _NoRingMapping(Exception):
    """The ring could not be mapped: no address space left for it."""


def worker_loop(cfg: WorkerConfig) -> None:
    try:
        _run(cfg)
    except KeyboardInterrupt:
        pass  # the main process raises KeyboardInterrupt itself
    except (BrokenPipeError, ConnectionError, EOFError):
        orphaned()
    except _NoRingFds as e:
        os.write(
            2,
            f"shmloader worker {cfg.worker_id}: the ring's file descriptors did not "
            f"arrive ({e}): too many open files.\n".encode(),
        )
        exit_now(NO_RING_FDS_EXIT)
    except _NoRingMapping as e:
        os.write(2, f"shmloader worker {cfg.worker_id}: could not map the ring ({e}).\n".encode())
        exit_now(NO_RING_MAPPING_EXIT)


def _watch_manager(manager_pid: int) -> None:
    """A backstop beside _Inbox's own watch: a thread that ends this worker as
    soon as the main process is gone, wherever the worker's main thread may
    be blocked then (a message half sent by a dying main process, a full
    pipe, a lock)."""

    def watch():
        try:
            fd = os.pidfd_open(manager_pid)
        except ProcessLookupError:
            orphaned()
        except (AttributeError, OSError):
            fd = None
        while True:
            if fd is not None:
                # poll, not select: the fd may be above select's limit of 1024
                # (a training process with many files open forks this worker).
                gone = select.poll()
                gone.register(fd, select.POLLIN)
                gone.poll()
                orphaned()
            time.sleep(WATCHDOG_INTERVAL)
            try:
                os.kill(manager_pid, 0)
            except ProcessLookupError:
                orphaned()
            except PermissionError:
                pass

    threading.Thread(target=watch, name="shmloader-watchdog", daemon=True).start()


def _run(cfg: WorkerConfig) -> None:
    seed = _set_up_process(cfg)
    dataset = _reseeded(cfg.dataset, cfg.shared_seed)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=dataset
    )
    work = _Work(cfg, dataset)
    work.start()
    inbox = _Inbox(cfg.tasks, cfg.manager_pid)
    while True:
        msg = inbox.next()
        if msg is EXIT:
            if inbox.manager_gone:
                orphaned()
            break
        kind = msg.kind
        if kind == "ring":
            work.slots = _Slots(inbox.ring_fds)
            inbox.ring_fds = None
        elif kind == "layout":
            work.layout = msg.layout
        elif kind == "resume":
            cfg.results.send(work.resume(msg))
        else:
            work.answer(msg, stale=work.iteration_end or inbox.superseded())


def _set_up_process(cfg: WorkerConfig) -> int:
    """This process set up as torch's workers set theirs up; returns the
    worker's seed."""
    set_exit_handlers()  # first: the watchdog may leave at once, knowing whose temp dir is whose
    _watch_manager(cfg.manager_pid)
    torch.multiprocessing._set_thread_name("pt_data_worker")
    torch.set_num_threads(1)
    keep_freed_memory()
    return _seed(cfg)


def _reseeded(dataset, shared_seed: int | None):
    """An IterDataPipe's random pipes seeded from the loader's shared seed (a
    new one each epoch of persistent workers), as torch's workers do."""
    if not isinstance(dataset, IterDataPipe):
        return dataset
    assert shared_seed is not None  # the loader draws one for every IterDataPipe
    shared_rng = torch.Generator()
    shared_rng.manual_seed(shared_seed)
    return apply_random_seed(dataset, shared_rng)


def send(results, reply: tuple) -> None:
    """results.send(reply), where an error in the reply whose exception class
    cannot be pickled (one made at run time, as boto3 makes its clients'
    errors) goes as a RuntimeError carrying that error's traceback: sending it
    as it is would kill the worker (torch's feeder thread drops it and the
    loader waits for its timeout)."""
    try:
        results.send(reply)  # pickled whole before a byte is written
    except Exception:
        if not any(isinstance(part, ExceptionWrapper) for part in reply):
            raise
        results.send(
            tuple(
                _picklable(part) if isinstance(part, ExceptionWrapper) else part for part in reply
            )
        )


def _picklable(wrapper: ExceptionWrapper) -> ExceptionWrapper:
    try:
        ForkingPickler.dumps(wrapper.exc_type)
        return wrapper
    except Exception as e:
        substitute = copy.copy(wrapper)
        substitute.exc_type = RuntimeError
        substitute.where = (
            f"{wrapper.where}, as a RuntimeError: its "
            f"{wrapper.exc_type.__qualname__} could not be pickled ({e})"
        )
        return substitute


class _Counted:
    """The collate function, remembering how many samples it was last given."""

    def __init__(self, fn):
        self.fn = fn
        self.samples = 0

    def __call__(self, data):
        self.samples = len(data) if isinstance(data, list) else 1
        return self.fn(data)


def _slot_bytes_needed(data, state) -> int:
    """The bytes `data` and the worker's state would take in a slot, or 0
    where the batch cannot be measured (torch's pickling decides on it)."""
    try:
        needed = slot_bytes_needed(data)
    except Exception:
        return 0
    if state is not None:  # a state beyond the room kept for it
        needed += max(0, len(state) - STATE_BYTES)
    return needed


class _Work:
    """What one worker does with a task: a whole batch, its rows of a batch
    (fetch="sample"), or a layout probe."""

    def __init__(self, cfg: WorkerConfig, dataset) -> None:
        self.cfg = cfg
        self.dataset = dataset
        self.where = f"in DataLoader worker process {cfg.worker_id}"
        self.slot_collate = SlotCollate() if cfg.slot_collate else None
        self.collate_fn = _Counted(self.slot_collate or cfg.collate_fn)
        self.samples = Samples(
            dataset,
            cfg.auto_collation,
            self.collate_fn,
            cfg.base_seed if cfg.seed_per_sample else None,
        )
        # An IterableDataset that can say where it is (state_dict) is resumed
        # from there; a map-style dataset is resumed by index.
        self.stateful = (
            dataset
            if cfg.dataset_kind == _DatasetKind.Iterable
            and callable(attribute(dataset, "state_dict"))
            else None
        )
        # Without a fetcher (worker_init_fn or an IterableDataset's __iter__
        # raised), every task answers with that error until a resume makes one;
        # the worker itself lives on.
        self.fetcher: Any = None  # torch's fetcher (Any: its classes are private)
        self.fetcher_error: ExceptionWrapper | None = None
        self.iteration_end = False  # an iterable ran out: the epoch's later tasks are stale
        self.busy = _Busy(cfg.worker_id)
        self.slots: _Slots | None = None  # once the ring has come
        self.layout: SampleLayout | None = None  # fetch="sample", once known
        # (task_id, {row: sample}) fetched before the ring existed
        self.probed: tuple[int, dict] | None = None
        self.epoch: int | None = None  # see enter_epoch
        self.epoch_rng: bytes | None = None
        self.snapshots = carries_state(cfg.dataset_kind, cfg.seed_per_sample)

    def _make_fetcher(self) -> Any:
        cfg = self.cfg
        return _DatasetKind.create_fetcher(
            cfg.dataset_kind, self.dataset, cfg.auto_collation, self.collate_fn, cfg.drop_last
        )

    def start(self) -> None:
        """Run worker_init_fn, load the dataset's state to resume from and
        make the first fetcher (an error in any: see fetcher_error), then set
        the RNG states to resume from."""
        cfg = self.cfg
        try:
            if cfg.init_fn is not None:
                cfg.init_fn(cfg.worker_id)
            resume = cfg.resume_state or {}
            if self.stateful is not None and resume.get("dataset") is not None:
                self.stateful.load_state_dict(resume["dataset"])
            self.fetcher = self._make_fetcher()
        except Exception:
            self.fetcher_error = ExceptionWrapper(where=self.where)
        if cfg.resume_state is not None and "random" in cfg.resume_state:
            restore_worker_rng(cfg.resume_state)

    def resume(self, msg: Resume) -> tuple:
        """A new epoch of persistent workers: a new fetcher, on the RNG states
        the old epoch's last tasks left.  Returns the Resumed reply."""
        self.iteration_end = False
        self.rewind(msg.rewind)
        self.dataset = _reseeded(self.dataset, msg.shared_seed)
        try:
            self.fetcher, self.fetcher_error = self._make_fetcher(), None
        except Exception:
            self.fetcher, self.fetcher_error = None, ExceptionWrapper(where=self.where)
        # With the RNG states the old epoch's last tasks left (a new
        # epoch's dataset state starts afresh): where this epoch begins.
        return Resumed.wire(self.cfg.worker_id, worker_snapshot(None) if self.snapshots else None)

    def answer(self, task, stale: bool) -> None:
        """Do a task (Task, Rows or Probe), or only let go of what a stale one
        holds, and send the reply, if there is one."""
        if not stale:
            self.enter_epoch(task.epoch)
        kind = task.kind
        if kind == "rows":
            reply = self.rows(task, stale=stale, error=self.fetcher_error)
        elif kind == "probe":
            reply = None if stale else self.probe(task, error=self.fetcher_error)
        elif stale:
            reply = self.give_back(task.slot)
        elif self.fetcher is None:
            self.give_back(task.slot)
            reply = Error.wire(task.task_id, self.fetcher_error, None)
        else:
            reply = self.batch(self.fetcher, task)
        if isinstance(reply, bytes):
            self.cfg.results.send_bytes(reply)
        elif reply is not None:
            send(self.cfg.results, reply)

    def enter_epoch(self, epoch: int) -> None:
        """Note the RNG state before this worker's first task of an epoch, so
        that dropping that epoch's prefetched tasks can undo their draws."""
        if epoch != self.epoch:
            self.epoch, self.epoch_rng = epoch, worker_snapshot(None)

    def rewind(self, epoch: int | None) -> None:
        if epoch is not None and epoch == self.epoch:
            rng = plain_worker_state(self.epoch_rng)
            assert rng is not None  # taken with self.epoch by enter_epoch
            restore_worker_rng(rng)
        self.epoch = self.epoch_rng = None

    def give_back(self, slot):
        if slot >= 0:
            self.slots.ring.abandon(slot)

    # ---- a whole batch ------------------------------------------------------

    def batch(self, fetcher, task):
        """Fetch and deliver one batch (a Task).  Returns the pipe reply, or
        None."""
        task_id, slot = task.task_id, task.slot
        self.busy.start()
        arena = None
        if slot >= 0:
            try:
                arena = self.slots.arena(slot, STATE_BYTES if self.snapshots else 0)
            except OSError as e:  # memory ran out since the ring was made
                self.give_back(slot)
                return Error.wire(task_id, self._shm_full(e), None)
        if self.slot_collate is not None:
            self.slot_collate.arena = arena
        try:
            if self.cfg.seed_per_sample:
                data = self.samples.batch(task.index, task.epoch, task.position)
            else:
                data = fetcher.fetch(task.index)
        except Exception as e:
            self.give_back(slot)
            if isinstance(e, StopIteration) and self.cfg.dataset_kind == _DatasetKind.Iterable:
                # (It was False: stale tasks never get here.)  Every later
                # task of this epoch is stale.
                self.iteration_end = True
                # With the worker's RNG states: the draws of a partial batch
                # that drop_last discarded are part of where the next epoch
                # starts (the dataset's own state is not: it starts afresh).
                return Stop.wire(task_id, worker_snapshot(None) if self.snapshots else None)
            # With the worker's state: the draws made before the error are
            # part of where a resume starts (an error is a yielded item).
            return Error.wire(task_id, self._batch_error(e), self._snapshot())
        samples = self.collate_fn.samples
        state = self._snapshot()
        if (
            arena is not None
            and (self.slot_collate is None or self.slot_collate.arena is not None)
            and self._publish(arena, slot, task_id, data, samples, state)
        ):
            return None
        return self._unslotted(arena, slot, task_id, data, samples, state)

    def _publish(self, arena, slot, task_id, data, samples, state) -> bool:
        """Write the batch's metadata into its slot (its tensors are there
        already, or go there now) and publish it.  False where it does not
        fit, or cannot be pickled: the pipe's path decides then."""
        try:
            meta_off, meta_len = arena.write_meta(
                _layout.dumps(data, arena.place_all, samples, state)
            )
        except Exception:
            return False  # SlotFull, or something unpicklable
        assert self.slots is not None  # the arena is one of its slots
        self.busy.add(self.slots, samples, 1, arena.used)
        self.slots.ring.publish(slot, task_id, meta_off, meta_len)
        return True

    def _unslotted(self, arena, slot, task_id, data, samples, state):
        """Deliver a batch outside the ring: in a one-off segment where it can
        be measured, else pickled for the pipe.  Returns the pipe reply, or
        None once sent."""
        reason = {NO_SLOT: RING_FULL, MEASURE: NO_RING}.get(slot, SPILL)
        # What it takes in a slot: the size of its one-off segment, and of
        # the ring to make (or to make when the next epoch starts: this one
        # outgrew it).
        measured = slot == MEASURE or (slot >= 0 and self.cfg.measures_spills)
        needed = _slot_bytes_needed(data, state)
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
                    STATE_BYTES if self.snapshots else 0,
                )
            except OSError as e:  # no memory for it
                self.give_back(slot)
                return Error.wire(task_id, self._shm_full(e), None)
            except Exception:
                pass  # SlotFull, or something unpicklable: torch's path decides below
            else:
                self.give_back(slot)
                self.busy.add(self.slots, samples, 1, needed)
                _one_off.send(
                    self.cfg.results,
                    Segment.wire(task_id, reason, needed if measured else 0, samples),
                    segment,
                )
                return None
        needed = needed if measured else 0
        try:
            # Pickled here, not by the pipe, so that a batch that cannot be
            # pickled becomes this task's error instead of killing the worker;
            # tensors stacked into the slot are copied out, since the slot is
            # given back below and may be refilled at once.
            reply, shared_bytes = _layout.dumps_detached(
                Batch.wire(task_id, reason, data, needed, samples, state),
                arena.owns if arena is not None else None,
            )
        except Exception as e:
            reply, shared_bytes = Error.wire(task_id, self._batch_error(e), None), 0
        self.give_back(slot)
        self.busy.add(
            self.slots, samples, 1, len(reply) + shared_bytes if isinstance(reply, bytes) else 0
        )
        return reply

    # ---- fetch="sample" -------------------------------------------------------

    def probe(self, probe, error):
        """The loader's first batch, before there is a ring: fetch this
        worker's interleaved share of its samples and keep them for their
        rows.  The worker with row 0 describes the layout its sample fixes as
        soon as it has it, so the main process makes the ring while everyone
        goes on fetching.  Returns None: the layout (or row 0's error) is sent
        from inside the loop."""
        cfg = self.cfg
        task_id, index, epoch, position = probe.task_id, probe.index, probe.epoch, probe.position
        fetched = {}  # row -> sample, or the ExceptionWrapper of its failure
        self.probed = (task_id, fetched)
        for row in range((cfg.worker_id - position) % cfg.num_workers, len(index), cfg.num_workers):
            self.busy.start()
            sample = error
            if error is None:
                try:
                    sample = self.samples.get(index[row], epoch, position + row)
                except Exception:
                    sample = ExceptionWrapper(where=self.where)
            fetched[row] = sample
            self.busy.add(self.slots, 1, 0, 0)
            if row == 0:
                send(cfg.results, self._describe(task_id, sample, probe.capacity))
        return None

    def _describe(self, task_id, sample, capacity):
        if isinstance(sample, ExceptionWrapper):
            return Error.wire(task_id, sample, None)
        try:
            return Described.wire(task_id, SampleLayout(sample, capacity))
        except Exception:
            return Error.wire(task_id, ExceptionWrapper(where=self.where), None)

    def _my_rows(self, task_id, slot, nrows, position, first_row, fetched):
        """This worker's rows of a task, in order: those it fetched before the
        ring existed, then its share of the rest."""
        cfg = self.cfg
        yield from sorted(fetched)
        if cfg.assignment == "dynamic":
            while (row := self.slots.ring.row_claim(slot, task_id)) is not None:
                yield row
        else:
            start = (cfg.worker_id - position) % cfg.num_workers
            for row in range(start, nrows, cfg.num_workers):
                if row >= first_row:
                    yield row

    def rows(self, task, stale, error):
        """Write this worker's rows of a batch (a Rows task); rows of a stale
        task are counted done unwritten, so that the slot still completes and
        goes back.  Returns None: errors go out as they happen."""
        task_id, slot, index = task.task_id, task.slot, task.index
        epoch, position = task.epoch, task.position
        ring = self.slots.ring
        memory = storage = None
        if not stale:
            try:
                memory, storage = self.slots.slot(slot)
            except OSError as e:  # every row of mine fails with it
                error = error or self._shm_full(e)
        fetched = self.probed[1] if self.probed is not None and self.probed[0] == task_id else {}
        self.probed = None
        for row in self._my_rows(task_id, slot, len(index), position, task.first_row, fetched):
            failed = collating = False
            if not stale:
                self.busy.start()
                try:
                    if error is not None:
                        raise _Reraised(error)
                    sample = (
                        fetched[row]
                        if row in fetched
                        else self.samples.get(index[row], epoch, position + row)
                    )
                    if isinstance(sample, ExceptionWrapper):
                        raise _Reraised(sample)
                    collating = True
                    self.layout.write_row(memory, storage, row, sample, index[row])
                except _Reraised as e:
                    failed = True
                    send(self.cfg.results, RowError.wire(task_id, row, e.wrapper, False))
                except Exception:
                    failed = True
                    send(
                        self.cfg.results,
                        RowError.wire(task_id, row, ExceptionWrapper(where=self.where), collating),
                    )
                self.busy.add(
                    self.slots,
                    0 if row in fetched else 1,
                    0,
                    0 if failed else self.layout.sample_bytes,
                )
            ring.row_done(slot, failed)
        return None

    def _snapshot(self):
        """worker_snapshot() where batches carry the worker's state, else None."""
        return worker_snapshot(self.stateful) if self.snapshots else None

    def _batch_error(self, error: Exception):
        """The ExceptionWrapper of a batch's error.  torch's failure to
        allocate shared memory (its collate's in a worker, or its transport's)
        in /dev/shm says what to change; it stays a RuntimeError, as torch's."""
        if not (
            isinstance(error, RuntimeError) and "unable to allocate shared memory" in str(error)
        ):
            return ExceptionWrapper(where=self.where)
        return self._shm_error(transport_shm_full_message(str(error)), error)

    def _shm_full(self, cause: OSError):
        """A slot's or one-off segment's pages could not be reserved: its
        batch's error (any other way would need the same memory, so there is
        no fallback)."""
        return self._shm_error(shm_full_message(str(cause)), cause)

    def _shm_error(self, message: str, cause: Exception):
        """The ExceptionWrapper of a SharedMemoryError raised from `cause`."""
        try:
            raise SharedMemoryError(message) from cause
        except SharedMemoryError:
            return ExceptionWrapper(where=self.where)


class _Reraised(Exception):
    """A worker_init_fn error, answered for every row."""

    def __init__(self, wrapper):
        self.wrapper = wrapper

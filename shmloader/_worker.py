"""The worker process: torch's worker loop, with batches written into slots.

Seeding, WorkerInfo, worker_init_fn, fetchers and exception wrapping are
torch's own (torch/utils/data/_utils/worker.py), so datasets see exactly what
they see under torch's DataLoader.  What differs is the transport: a task that
comes with a slot is collated into it and published on the ring; everything
else (no slot, a batch that outgrew its slot, errors, end of an iterable) goes
to the main process through this worker's result pipe, pickled by torch.

Protocol (main -> worker, over the worker's task socket):
    ("ring",)                        followed by the segment fd and eventfd
    ("task", task_id, index, slot)   slot >= 0, NO_SLOT or MEASURE
    ("resume", shared_seed)          a new epoch of persistent workers
    None                             exit
Worker -> main, over the worker's result pipe:
    ("batch", task_id, reason, data, slot_bytes_needed or 0)
    ("error", task_id, ExceptionWrapper)
    ("stop", task_id)                an IterableDataset ran out
    ("resumed",)
"""
from __future__ import annotations

import collections
import os
import random
import socket
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import recvfds
from typing import Any, Callable

import numpy as np
import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind, IterDataPipe
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.graph_settings import apply_random_seed

from . import _layout
from ._arena import Arena, SlotCollate, slot_bytes_needed
from ._ring import Ring

NO_SLOT = -1  # every slot is held: use torch's transport
MEASURE = -2  # no ring yet: use torch's transport and report the size needed

# Without pidfds: how often a waiting worker checks that its main process lives.
WATCHDOG_INTERVAL = 1.0


@dataclass(frozen=True)
class WorkerConfig:
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable | None  # None: SlotCollate (the loader uses default_collate)
    drop_last: bool
    base_seed: int
    init_fn: Callable | None
    worker_id: int
    num_workers: int
    shared_seed: int | None
    manager_pid: int  # the main process: workers exit when it is gone
    tasks: Any  # Connection (a socket: it also carries the ring's fds)
    results: Any  # Connection


class _Inbox:
    """Messages from the main process, read ahead so that tasks made stale by
    a later resume or exit are skipped instead of computed.

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
            msg = self._conn.recv()
            if msg is not None and msg[0] == "ring":
                # The fds follow the message in the stream: take them now.
                with socket.fromfd(self._conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    self.ring_fds = recvfds(s, 2)
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
            return ("ring",)
        return self._pending.popleft()

    def superseded(self) -> bool:
        """True when a resume or exit is already queued behind the current task."""
        return any(m is None or m[0] == "resume" for m in self._pending)


def _seed(cfg: WorkerConfig) -> int:
    seed = cfg.base_seed + cfg.worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(cfg.base_seed, cfg.worker_id))
    return seed


class _Slots:
    """This worker's view of the ring: one torch storage per slot, made once."""

    def __init__(self, fds):
        self.ring = Ring.attach(*fds)  # keeps its own copies of the fds
        for fd in fds:
            os.close(fd)
        self._storages = {}

    def arena(self, slot: int) -> Arena:
        if slot not in self._storages:
            memory = self.ring.memory(slot)
            storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
            self._storages[slot] = (memory, storage)
        return Arena(*self._storages[slot])


def worker_loop(cfg: WorkerConfig) -> None:
    try:
        _run(cfg)
    except KeyboardInterrupt:
        pass  # the main process raises KeyboardInterrupt itself
    except (BrokenPipeError, ConnectionError, EOFError):
        pass  # the main process is gone


def _run(cfg: WorkerConfig) -> None:
    signal_handling._set_worker_signal_handlers()
    torch.multiprocessing._set_thread_name("pt_data_worker")
    torch.set_num_threads(1)
    seed = _seed(cfg)
    dataset = cfg.dataset
    shared_rng = torch.Generator()
    if isinstance(dataset, IterDataPipe):
        shared_rng.manual_seed(cfg.shared_seed)
        dataset = apply_random_seed(dataset, shared_rng)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=dataset
    )
    slot_collate = SlotCollate() if cfg.collate_fn is None else None
    collate_fn = slot_collate or cfg.collate_fn
    where = f"in DataLoader worker process {cfg.worker_id}"

    def make_fetcher():
        return _DatasetKind.create_fetcher(
            cfg.dataset_kind, dataset, cfg.auto_collation, collate_fn, cfg.drop_last
        )

    # Without a fetcher (worker_init_fn or an IterableDataset's __iter__
    # raised), every task answers with that error until a resume makes one;
    # the worker itself lives on.
    fetcher = fetcher_error = None
    try:
        if cfg.init_fn is not None:
            cfg.init_fn(cfg.worker_id)
        fetcher = make_fetcher()
    except Exception:
        fetcher_error = ExceptionWrapper(where=where)

    inbox = _Inbox(cfg.tasks, cfg.manager_pid)
    slots = None
    iteration_end = False
    while True:
        msg = inbox.next()
        if msg is None:
            break
        kind = msg[0]
        if kind == "ring":
            slots = _Slots(inbox.ring_fds)
            inbox.ring_fds = None
            continue
        if kind == "resume":
            iteration_end = False
            if isinstance(dataset, IterDataPipe):
                shared_rng.manual_seed(msg[1])
                dataset = apply_random_seed(dataset, shared_rng)
            try:
                fetcher, fetcher_error = make_fetcher(), None
            except Exception:
                fetcher, fetcher_error = None, ExceptionWrapper(where=where)
            cfg.results.send(("resumed",))
            continue
        _, task_id, index, slot = msg
        if iteration_end or inbox.superseded():
            if slot >= 0:
                slots.ring.abandon(slot)
            continue
        if fetcher is None:
            _give_back(slots, slot)
            reply = ("error", task_id, fetcher_error)
        else:
            reply, iteration_end = _do_task(cfg, fetcher, slot_collate, slots, task_id, index,
                                            slot, where)
        if isinstance(reply, bytes):
            cfg.results.send_bytes(reply)
        elif reply is not None:
            cfg.results.send(reply)
        del reply


def _do_task(cfg, fetcher, slot_collate, slots, task_id, index, slot, where):
    """Fetch and deliver one batch.  Returns (pipe reply or None, iteration_end)."""
    arena = slots.arena(slot) if slot >= 0 else None
    if slot_collate is not None:
        slot_collate.arena = arena
    try:
        data = fetcher.fetch(index)
    except Exception as e:
        _give_back(slots, slot)
        if isinstance(e, StopIteration) and cfg.dataset_kind == _DatasetKind.Iterable:
            return ("stop", task_id), True
        return ("error", task_id, ExceptionWrapper(where=where)), False
    if arena is not None and (slot_collate is None or slot_collate.arena is not None):
        try:
            meta_off, meta_len = arena.write_meta(_layout.dumps(data, arena.place))
        except Exception:
            # SlotFull, or something unpicklable: torch's path decides below.
            pass
        else:
            slots.ring.publish(slot, task_id, meta_off, meta_len)
            return None, False
    reason = {NO_SLOT: "ring_full", MEASURE: "no_ring"}.get(slot, "spill")
    try:
        needed = slot_bytes_needed(data) if slot == MEASURE else 0
        # Pickled here, not by the pipe, so that a batch that cannot be
        # pickled becomes this task's error instead of killing the worker;
        # tensors stacked into the slot are copied out, since the slot is
        # given back below and may be refilled at once.
        reply = _layout.dumps_detached(("batch", task_id, reason, data, needed),
                                       arena.owns if arena is not None else None)
    except Exception:
        reply = ("error", task_id, ExceptionWrapper(where=where))
    _give_back(slots, slot)
    return reply, False


def _give_back(slots, slot):
    if slot >= 0:
        slots.ring.abandon(slot)

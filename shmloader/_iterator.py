"""The multi-process iterator: torch's dispatch and ordering, shmloader's transport.

Dispatch follows torch's _MultiProcessingDataLoaderIter step for step (same
sampler draws, round-robin from worker 0 each epoch, at most
prefetch_factor * num_workers tasks in flight, in_order=False rules, the same
handling of exhausted IterableDataset workers), so batches and their order are
torch's.  The difference: each task is sent with a ring slot claimed for it;
its batch comes back as a published slot whose tensors the main process views
in place.  Tasks carry ids unique over the iterator's life, so results of an
earlier epoch (persistent workers) are recognised and dropped.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import time
import warnings
from collections import deque
from multiprocessing.connection import wait as wait_fds

import torch
from torch.utils.data import _utils
from torch.utils.data.dataloader import (
    IterDataPipe,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
)

from . import _layout
from ._pool import WorkerDied, WorkerPool
from ._rings import create_ring
from ._worker import MEASURE, NO_SLOT

# Slots beyond the prefetch_factor * num_workers batches in flight: the batch
# being yielded, the one the loop still holds, and two a user may keep (the
# last batch of a previous loop, one kept for logging) before any batch has
# to travel by torch's transport.
SPARE_SLOTS = 4


# Warnings point at the user's line, past shmloader's and torch's loader frames.
_INTERNAL_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.utils.data.__file__))


def _warn(message: str) -> None:
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


class ShmLoaderIter(_BaseDataLoaderIter):
    def __init__(self, loader) -> None:
        super().__init__(loader)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._counters = loader._counters
        self._options = loader._shm_options
        self._shutdown = False
        self._owner_pid = os.getpid()
        self._ring = None
        self._epoch_base = 0  # task id of this epoch's first task
        self._send_idx = 0
        self._arrivals = deque()
        self._nslots = self._options.num_slots or self._prefetch_factor * self._num_workers + SPARE_SLOTS

        ctx = loader.multiprocessing_context or torch.multiprocessing
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            init_fn = functools.partial(
                _sharding_worker_init_fn, init_fn, self._world_size, self._rank
            )
        slot_collate = self._collate_fn is _utils.collate.default_collate
        self._pool = WorkerPool(ctx, [
            dict(
                dataset_kind=self._dataset_kind,
                dataset=self._dataset,
                auto_collation=self._auto_collation,
                collate_fn=None if slot_collate else self._collate_fn,
                drop_last=self._drop_last,
                base_seed=self._base_seed,
                init_fn=init_fn,
                worker_id=i,
                num_workers=self._num_workers,
                shared_seed=self._shared_seed,
                manager_pid=os.getpid(),
            )
            for i in range(self._num_workers)
        ])
        slot_bytes = self._options.slot_bytes or self._options.learned_slot_bytes
        if slot_bytes:
            self._start_ring(slot_bytes)
        self._reset(loader, first_iter=True)

    # ---- ring -------------------------------------------------------------

    def _start_ring(self, slot_bytes: int) -> None:
        self._ring = self._options.take_spare_ring(self._nslots, slot_bytes)
        if self._ring is None:
            self._ring = create_ring(self._nslots, slot_bytes)
        self._pool.send_ring(self._ring)
        self._counters.ring_slots = self._ring.nslots
        self._counters.slot_bytes = self._ring.slot_bytes

    def _claim_slot(self) -> int:
        if self._ring is None:
            return MEASURE
        slot = self._ring.claim()
        if slot is not None:
            return slot
        if not self._counters.warned_ring_full:
            self._counters.warned_ring_full = True
            _warn(
                f"shmloader: all {self._ring.nslots} ring slots are in use (batches still "
                "referenced by your code, plus those in flight); further batches travel by "
                "torch's transport until slots are released. Ring memory stays capped at "
                f"{self._ring.total_bytes} bytes; pass num_slots= to keep more batches in "
                "the ring."
            )
        return NO_SLOT

    # ---- epochs -----------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        super()._reset(loader, first_iter)
        self._epoch_base += self._send_idx  # task ids stay unique across epochs
        self._send_idx = 0  # epoch index of the next task to send
        self._rcvd_idx = 0  # epoch index of the next batch to yield
        self._task_info = {}  # epoch index -> (worker_id,) or (worker_id, data)
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        with self._failing_workers():
            if not first_iter:
                self._resume_workers()
            for _ in range(self._prefetch_factor * self._num_workers):
                self._try_put_index()

    def _resume_workers(self) -> None:
        """Start persistent workers on a new epoch, dropping the old one's
        results (a worker skips tasks a resume has made stale)."""
        for i in range(self._num_workers):
            self._pool.send(i, ("resume", self._shared_seed))
        pending = self._num_workers
        while pending:
            task_id, payload = self._next_arrival()
            if task_id is None:
                pending -= 1
            else:
                _discard(payload)
        # Every worker published or gave up its old tasks before it answered:
        # what is left arrived with the answers and is stale too.  Its slots
        # must be free before the new epoch claims any.
        while self._arrivals:
            _discard(self._arrivals.popleft()[1])

    @contextlib.contextmanager
    def _failing_workers(self):
        """A worker's death ends this iterator: the other workers are stopped
        at once, and the loader's next iter() starts afresh."""
        try:
            yield
        except WorkerDied:
            self._shutdown_workers(graceful=False)
            raise

    # ---- dispatch (torch's rules) -----------------------------------------

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        assert self._tasks_outstanding < max_tasks
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):  # find the next active worker, if any
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id]:
                if self._in_order:
                    break
                if self._workers_num_tasks[worker_id] < max_tasks // sum(self._workers_status):
                    break
        else:
            return
        task_id = self._epoch_base + self._send_idx
        self._pool.send(worker_id, ("task", task_id, index, self._claim_slot()))
        self._task_info[self._send_idx] = (worker_id,)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    # ---- receiving ----------------------------------------------------------

    def _next_arrival(self):
        """(task_id, payload) of the next result from any worker, or
        (None, ("resumed",)); sleeps until one comes, a worker dies, or the
        timeout passes."""
        while not self._arrivals:
            self._collect()
        return self._arrivals.popleft()

    def _collect(self) -> None:
        """Move every result that has arrived, by ring or by pipe, into
        _arrivals, sorted by task id.

        A worker answers its tasks in order, some in slots and some on its
        pipe; whatever it sent before a result we see is visible too (it
        wrote its pipe before publishing a later slot, and published before
        writing a later message).  So taking all of both channels at once and
        sorting by task id keeps every worker's results in its own order."""
        leases = self._acquire_all()
        if leases:
            # Only a look at the pipes (one poll()), no sleep.
            fired = self._ring.wait(0, self._pool.wait_fds) or []
        else:
            timeout = self._timeout if self._timeout > 0 else None
            started = time.perf_counter()
            if self._ring is not None:
                fired = self._ring.wait(timeout, self._pool.wait_fds)
            else:
                fired = wait_fds(self._pool.wait_fds, timeout) or None
            self._counters.wait_seconds += time.perf_counter() - started
            if fired is None:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
        messages = self._pool.receive(fired)
        arrivals = [(lease.seq, lease) for lease in leases]
        for worker_id, msg in messages:
            arrivals.append(self._accept(worker_id, msg))
        if messages:
            arrivals.extend((lease.seq, lease) for lease in self._acquire_all())
        arrivals.sort(key=lambda a: -1 if a[0] is None else a[0])
        self._arrivals.extend(arrivals)

    def _acquire_all(self):
        leases = []
        if self._ring is not None:
            while (lease := self._ring.acquire()) is not None:
                leases.append(lease)
        return leases

    def _accept(self, worker_id, msg):
        """The arrival (task_id or None, msg) for a worker's pipe message."""
        kind = msg[0]
        if kind == "resumed":
            return None, msg
        if kind == "batch" and msg[2] == "no_ring" and self._options.learned_slot_bytes is None:
            # The first batch sizes the ring, with headroom for batches that
            # vary a little; bigger ones spill.  The ring is made at the next
            # next() call, so that its prefaulting does not delay this batch.
            needed = msg[4]
            self._options.learned_slot_bytes = needed + needed // 16 + 65536
        return msg[1], msg

    def _get_data(self):
        """(epoch index, data) of the next result of this epoch."""
        while True:
            task_id, payload = self._next_arrival()
            if task_id is not None and task_id >= self._epoch_base:
                return task_id - self._epoch_base, payload
            _discard(payload)

    def _next_data(self):
        with self._failing_workers():
            return self._next_batch()

    def _next_batch(self):
        if self._ring is None and self._options.learned_slot_bytes is not None:
            self._start_ring(self._options.learned_slot_bytes)
        while True:
            # Skip tasks of workers that became inactive without an answer.
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    if len(info) == 2 or self._workers_status[info[0]]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                worker_id, data = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(data, worker_id)

            assert not self._shutdown and self._tasks_outstanding > 0
            idx, data = self._get_data()
            self._tasks_outstanding -= 1
            if _kind(data) == "stop":
                worker_id = self._task_info[idx][0]
                self._workers_status[worker_id] = False
                if not self._persistent_workers:
                    self._pool.stop(worker_id)
                self._try_put_index()
                continue
            if idx != self._rcvd_idx:
                if not self._in_order:
                    worker_id = self._task_info.pop(idx)[0]
                    return self._process_data(data, worker_id)
                self._task_info[idx] += (data,)
            else:
                worker_id = self._task_info.pop(idx)[0]
                self._rcvd_idx += 1
                return self._process_data(data, worker_id)

    def _process_data(self, data, worker_id):
        self._workers_num_tasks[worker_id] -= 1
        self._try_put_index()
        if _kind(data) == "error":
            data[2].reraise()
        batch = self._unpack(data)
        if self._pin_memory:
            batch = _utils.pin_memory.pin_memory(batch, self._pin_memory_device)
        return batch

    def _unpack(self, data):
        counters = self._counters
        counters.batches += 1
        if _kind(data) == "batch":
            reason = data[2]
            if reason == "no_ring":
                counters.unsized_batches += 1
            elif reason == "ring_full":
                counters.ring_full_batches += 1
            else:
                counters.spilled_batches += 1
                self._warn_spill()
            return data[3]
        lease = data  # a SlotLease
        batch, fallback_leaves = _layout.loads(lease.meta(), lease)
        counters.slot_batches += 1
        counters.fallback_leaves += fallback_leaves
        return batch

    def _warn_spill(self) -> None:
        if not self._counters.warned_spill:
            self._counters.warned_spill = True
            _warn(
                f"shmloader: a batch did not fit its {self._ring.slot_bytes}-byte slot and was "
                "delivered whole by torch's (slower) transport; later ones that do not fit "
                "will be too. Pass slot_bytes= to size slots for your largest batch."
            )

    # ---- shutdown -----------------------------------------------------------

    def _shutdown_workers(self, graceful: bool = True) -> None:
        if _utils is None or _utils.python_exit_status is not False:
            return  # interpreter exit: multiprocessing's atexit ends daemon workers
        if self._shutdown:
            return
        self._shutdown = True
        if os.getpid() != self._owner_pid:
            return  # a forked child collecting a copy: the workers are not its own
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(graceful)
        while self._arrivals:
            _discard(self._arrivals.popleft()[1])
        if self._ring is not None:
            # Every worker is gone: the ring goes back to the loader for its
            # next iterator (batches the user holds keep their slots).
            self._options.keep_spare_ring(self._ring)
            self._ring = None

    def __del__(self) -> None:
        if hasattr(self, "_arrivals"):
            self._shutdown_workers()


def _kind(payload) -> str:
    """A result is a worker's message tuple ("batch", "error", "stop", ...)
    or, for a batch in the ring, the SlotLease of its slot."""
    return payload[0] if type(payload) is tuple else "slot"


def _discard(payload) -> None:
    """Drop a result nobody will see; a slot goes straight back to the ring."""
    if _kind(payload) == "slot":
        payload.release()

"""The multi-process iterator: torch's dispatch and ordering, shmloader's transport.

ShmLoaderIter keeps torch's hook names (_reset, _next_index, _try_put_index,
_next_data, _process_data, _shutdown_workers) and orchestrates; its ring is
kept by _iter_ring.py, its epochs planned by _iter_epochs.py, its results
received and unpacked by _iter_receive.py (mixins sharing its state).

Dispatch follows torch's _MultiProcessingDataLoaderIter step for step (same
sampler draws, round-robin from worker 0 each epoch, at most
prefetch_factor * num_workers tasks in flight, in_order=False rules, the same
handling of exhausted IterableDataset workers), so batches and their order are
torch's.  The difference: each task is sent with a ring slot claimed for it;
its batch comes back as a published slot whose tensors the main process views
in place.  Tasks carry ids unique over the iterator's life, so results of an
earlier epoch (persistent workers) are recognised and dropped.

Beyond torch (all opt-in, see DataLoader): fetch="sample" sends each batch to
every worker, which fill its slot row by row (_worker.py, _sample_layout.py); the
first sample of the loader is fetched alone first (a "probe") to fix the
layout and size the ring.  prefetch_next_epoch keeps dispatching, when the
sampler runs out, the next epoch's batches; they are numbered on from this
epoch's (epoch index >= _next_epoch_at) and adopted by the next _reset if the
samplers still describe the epoch they were drawn for (_next_epoch.py).
"""

from __future__ import annotations

import functools
import multiprocessing.util
import os
import time
import weakref
from collections import deque

import torch
from torch.utils.data import _utils
from torch.utils.data.dataloader import (
    IterDataPipe,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
)

from . import _torch_api
from ._iter_epochs import EpochPlanning
from ._iter_receive import _REPLAYED, Receiving, _discard, _kind
from ._iter_ring import RingKeeping
from ._pool import WorkerDied, WorkerPool
from ._protocol import Rows, Task
from ._resume import Progress
from ._ring_memory import retire
from ._seeding import countable
from ._warn import WarnsBetweenBatches, init_as_torch


class ShmLoaderIter(
    RingKeeping, EpochPlanning, Receiving, WarnsBetweenBatches, _BaseDataLoaderIter
):
    def __init__(self, loader) -> None:
        resume = loader._resume
        rng_before = (
            torch.get_rng_state() if resume is not None and loader.generator is None else None
        )
        init_as_torch(super().__init__, loader)  # its warnings are torch's
        self._prefetch_factor = loader.prefetch_factor
        _torch_api.check_iterator(self)
        _torch_api.check_prefetch_factor(self._prefetch_factor)  # after the same draws
        loader._take_resume()  # this iterator resumes it
        # Its own record: state_dict() describes the loader's newest iterator.
        self._progress = loader._progress = Progress()
        self._resume = resume
        # Per worker, the numbers of its tasks to fetch again and drop (see _resume_epoch).
        self._replay = None
        self._died = None  # the message of the WorkerDied that ended this iterator
        self._interrupted = None  # the name of the KeyboardInterrupt (or such) that ended it
        self._deferred_warnings = []  # (error, flag): see WarnsBetweenBatches
        self._skip = set()  # epoch indices not to fetch again (in_order=False resume)
        self._pending_first_draw = None
        if resume is not None:
            self._base_seed = resume.settle_base_seed(
                loader, self._base_seed, self._persistent_workers, rng_before
            )
        self._in_order = loader.in_order
        self._counters = loader._counters
        self._handover = loader._ring_handover
        self._made_with = loader._options()  # see DataLoader.__iter__
        self._fetch = loader.fetch
        self._prefetch_next_epoch = loader.prefetch_next_epoch
        self._batch_size = loader.batch_size
        # prefetch_next_epoch (persistent workers, so the loader holds this
        # iterator): a weak reference, which leaves no cycle to keep dropped
        # loaders' workers alive until the garbage collector runs.
        self._loader_ref = weakref.ref(loader)
        self._shutdown = False
        self._owner_pid = os.getpid()
        self._ring = None
        # Batches a new ring delivers before the rest of it is reserved (see _unpack).
        self._reserve_rest_in = 0
        self._epoch_base = 0  # task id of this epoch's first task
        self._send_idx = 0
        self._arrivals = deque()
        self._row_errors = {}  # fetch="sample": task id -> {row: its RowError}
        self._init_ring(loader)
        self._start_workers(loader, resume)
        self._next_epoch_at = None  # epoch index of the next epoch's first task
        self._prefetched = None  # its PrefetchedEpoch
        self._attach_ring()
        self._reset(loader, first_iter=True)

    def _start_workers(self, loader, resume) -> None:
        """The worker processes, each given what torch gives its workers,
        plus shmloader's options and (resuming) its state."""
        ctx = loader.multiprocessing_context or torch.multiprocessing
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            init_fn = functools.partial(
                _sharding_worker_init_fn, init_fn, self._world_size, self._rank
            )
        # Only batches are collated into slots: with batch_size=None torch
        # calls a default_collate passed explicitly on each sample (and its
        # errors must be torch's).
        slot_collate = self._auto_collation and self._collate_fn is _utils.collate.default_collate
        # The device torch's iterator gives its pin-memory thread (shmloader
        # pins in this thread), looked up as the installed torch does, so
        # that a pin_memory_device with no such device fails as torch's does;
        # before the workers start, so that none is left behind then.
        self._pin_device_id = _torch_api.pin_thread_device(self) if self._pin_memory else None
        self._pool = WorkerPool(
            ctx,
            [
                dict(
                    dataset_kind=self._dataset_kind,
                    dataset=self._dataset,
                    auto_collation=self._auto_collation,
                    collate_fn=self._collate_fn,
                    slot_collate=slot_collate,
                    drop_last=self._drop_last,
                    base_seed=self._base_seed,
                    init_fn=init_fn,
                    worker_id=i,
                    num_workers=self._num_workers,
                    shared_seed=self._shared_seed,
                    seed_per_sample=loader.seed_per_sample,
                    assignment=loader.assignment,
                    measures_spills=self._slot_bytes is None,
                    resume_state=resume.worker_state(i) if resume is not None else None,
                    manager_pid=os.getpid(),
                )
                for i in range(self._num_workers)
            ],
        )

    def __next__(self):
        # torch's __next__ opens a profiler record_function around every
        # batch: ~5 us that records nothing unless a profiler is on.  Only a
        # map-style dataset's iterator that has begun skips it (torch's first
        # _reset stays torch's; an IterableDataset's iterator is the subclass
        # below).
        if self._sampler_iter is None or torch.autograd._profiler_enabled():
            return super().__next__()
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _reset(self, loader, first_iter=False) -> None:
        try:
            self._start_epoch(loader, first_iter)
        except Exception:
            raise
        except BaseException as e:
            self._end_on_interrupt(e)
            raise

    def _next_index(self):
        if self._pending_first_draw is not None:
            resume, self._pending_first_draw = self._pending_first_draw, None
            index = resume.first_draw(super()._next_index)
        else:
            index = super()._next_index()
        return countable(index, self._auto_collation)

    # ---- dispatch (torch's rules) -----------------------------------------

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        assert self._tasks_outstanding < max_tasks
        try:
            index = self._draw()
        except StopIteration:
            if not self._start_next_epoch():
                return
            try:
                index = self._draw()
            except StopIteration:
                return
        while self._send_idx in self._skip:  # yielded before a resume
            self._skip.discard(self._send_idx)
            self._position += self._samples_in(index)
            next(self._worker_queue_idx_cycle)
            self._send_idx += 1
            try:
                index = self._draw()
            except StopIteration:
                return
        for _ in range(self._num_workers):  # find the next active worker, if any
            worker_id = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_id]:
                if self._in_order or not _torch_api.IN_ORDER_FALSE_CAPS_EACH_WORKER:
                    break
                if self._workers_num_tasks[worker_id] < max_tasks // sum(self._workers_status):
                    break
        else:
            return
        task_id = self._epoch_base + self._send_idx
        position = self._position
        self._position += self._samples_in(index)
        early = self._dispatch(worker_id, task_id, index, position)
        self._workers_num_tasks[worker_id] += 1
        if self._task_numbers is not None:
            self._task_numbers[self._send_idx] = self._tasks_sent[worker_id]
            self._tasks_sent[worker_id] += 1
        if early is None:
            self._task_info[self._send_idx] = (worker_id,)
            self._tasks_outstanding += 1
        else:  # its result is already here
            self._task_info[self._send_idx] = (worker_id, early)
        self._send_idx += 1

    def _dispatch(self, worker_id, task_id, index, position):
        """Send one batch's task: to every worker (fetch="sample": rows of
        one slot) or to worker_id (a whole batch).  Returns None, or the
        batch's result if it is known at once (its first sample failed
        before there was a layout)."""
        epoch = self._epoch
        first_row = 0
        # An empty batch (a batch_sampler's) has no rows: one worker collates
        # it whole, failing as torch's collate does.
        rows = self._fetch == "sample" and self._samples_in(index) > 0
        if rows and self._handover.sample_layout is None:
            error = self._learn_layout(task_id, index, epoch, position)
            if error is not None:
                return error
            first_row = len(index)  # every row is the worker's that fetched it already
        slot = self._claim_slot()
        if rows and slot >= 0 and len(index) <= self._handover.sample_layout.capacity:
            self._ring.rows_begin(slot, task_id, len(index), first_row)
            self._pool.broadcast(Rows.wire(task_id, slot, index, epoch, position, first_row))
        else:
            # Everything else goes whole to one worker (a batch bigger than
            # the layout's rows is collated into the slot, or spills).
            self._pool.send(worker_id, Task.wire(task_id, index, slot, epoch, position))
        return None

    def _next_data(self):
        if self._deferred_warnings:
            self._raise_deferred_warning()
        if self._owner_pid != os.getpid():
            raise RuntimeError(
                "this DataLoader iterator was made by the process this one was forked from, "
                "whose workers and ring it uses; iterate the loader again here (iter(loader)) "
                "for workers of this process's own."
            )
        if self._died is not None:
            raise WorkerDied(
                f"this DataLoader iterator ended when a worker died: {self._died} "
                "iter(loader) starts a new one with fresh workers."
            )
        if self._interrupted is not None:
            raise RuntimeError(
                f"this DataLoader iterator ended when a {self._interrupted} interrupted its "
                "next(), which may have been taking a batch on its way; iter(loader) starts a "
                "new one with fresh workers."
            )
        try:  # what _failing_workers() does, without a generator per batch
            batch = self._next_batch()
            while batch is _REPLAYED:
                batch = self._next_batch()
        except WorkerDied as e:
            self._end_on_death(e)
            raise
        except Exception:
            raise
        except BaseException as e:
            self._end_on_interrupt(e)
            raise
        finally:  # up to this batch, or to the error raised in its place (its wait counted)
            now = time.perf_counter()
            self._counters.wall_seconds += now - self._epoch_started
            self._epoch_started = now
        counters = self._counters
        if self._ring is not None:
            in_use = self._ring.nslots - self._ring.count_free()
            counters.occupancy_sum += in_use
            counters.occupancy_max = max(counters.occupancy_max, in_use)
        return batch

    def _next_batch(self):
        if self._ring is None and self._handover.learned_slot_bytes is not None:
            self._start_ring(self._known_slot_bytes())
        end = self._send_idx if self._next_epoch_at is None else self._next_epoch_at
        while True:
            if self._held:
                idx = self._first_in_turn(self._held)
                if idx is not None:
                    self._held.discard(idx)
                    worker_id, data = self._task_info.pop(idx)
                    return self._process_data(data, worker_id, idx)
            # Skip tasks of workers that became inactive without an answer.
            while self._rcvd_idx < end:
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    if len(info) == 2 or self._workers_status[info[0]]:
                        break
                    del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
            else:
                if self._deferred_warnings:  # instead of StopIteration (raised next time)
                    self._raise_deferred_warning()
                self._progress.epoch_ended()
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration

            if len(self._task_info[self._rcvd_idx]) == 2:
                self._held.discard(self._rcvd_idx)
                worker_id, data = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(data, worker_id, self._rcvd_idx - 1)

            assert not self._shutdown and self._tasks_outstanding > 0
            idx, data = self._get_data()
            self._tasks_outstanding -= 1
            if _kind(data) == "stop":
                worker_id = self._task_info[idx][0]
                self._workers_status[worker_id] = False
                self._progress.worker_ran_out(worker_id, data.state)
                if not self._persistent_workers:
                    self._pool.stop(worker_id)
                self._try_put_index()
                continue
            if idx != self._rcvd_idx:
                if not self._in_order and (
                    self._next_epoch_at is None or idx < self._next_epoch_at
                ):
                    if self._first_in_turn([idx]) is None:
                        self._task_info[idx] += (data,)
                        self._held.add(idx)
                        continue
                    worker_id = self._task_info.pop(idx)[0]
                    return self._process_data(data, worker_id, idx)
                self._task_info[idx] += (data,)
            else:
                worker_id = self._task_info.pop(idx)[0]
                self._rcvd_idx += 1
                return self._process_data(data, worker_id, idx)

    def _process_data(self, data, worker_id, idx):
        self._workers_num_tasks[worker_id] -= 1
        self._try_put_index()
        number = self._task_numbers.pop(idx) if self._task_numbers is not None else None
        if self._replay is not None:  # resuming an IterableDataset without state
            below, beyond = self._replay[worker_id]
            if number < below or number in beyond:
                _discard(data)
                return _REPLAYED
        if _kind(data) == "error":
            self._progress.batch_yielded(idx, worker_id, data.state, number)
            data.wrapper.reraise()
        batch, worker_state = self._unpack(data)
        self._progress.batch_yielded(idx, worker_id, worker_state, number)
        if self._pin_memory and not (self._registered and _kind(data) == "slot"):
            batch = self._pin(batch)
        if self._device_stage is not None:
            batch = self._device_stage(batch)
        return batch

    # ---- shutdown -----------------------------------------------------------

    def _shutdown_workers(self, graceful: bool = True) -> None:
        if (
            _utils is None
            or _utils.python_exit_status is not False
            or multiprocessing.util.is_exiting()
        ):
            # Interpreter exit (a thread still iterating once the main thread
            # has returned, too): multiprocessing's atexit ends daemon workers,
            # and closing them under it would make it fail.
            return
        if self._shutdown:
            return
        self._shutdown = True
        self._forget_deferred_warnings()
        if os.getpid() != self._owner_pid:
            return  # a forked child collecting a copy: the workers are not its own
        pool = getattr(self, "_pool", None)
        try:
            if pool is not None:
                pool.shutdown(graceful)
        finally:  # (interrupted, the workers are gone all the same: see shutdown)
            self._release_results()

    def _release_results(self) -> None:
        """Free what the gone workers left: results not yielded, and the ring."""
        while self._arrivals:
            _discard(self._arrivals.popleft()[1])
        # Results that arrived before their turn: their slots are free for
        # the loader's next iterator even while this one is still referenced.
        for info in getattr(self, "_task_info", {}).values():
            if len(info) == 2:
                _discard(info[1])
        self._task_info, self._held = {}, set()
        if self._ring is not None:
            # Every worker is gone: the ring goes back to the loader for its
            # next iterator (batches the user holds keep their slots), or,
            # when the loader is gone, keeps only the slots those batches hold.
            if self._loader_ref() is None:
                retire(self._ring)
            else:
                self._handover.keep_spare_ring(self._ring)
            self._ring = None

    def __del__(self) -> None:
        if hasattr(self, "_arrivals"):
            self._shutdown_workers()


class IterableShmLoaderIter(ShmLoaderIter):
    """An IterableDataset's: torch's __next__ is next() itself, so that its
    warning of a stream longer than len() names the user's line, as torch's
    does."""

    __next__ = _BaseDataLoaderIter.__next__

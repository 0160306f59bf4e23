"""The multi-process iterator: torch's dispatch and ordering, shmloader's transport.

ShmLoaderIter keeps torch's hook names (_reset, _next_index, _try_put_index,
_next_data, _process_data, _shutdown_workers) and makes each step of them
from parts that own their state, built here and depending one way only:

    ShmLoaderIter ─┬─> EpochPlanner (_iter_epochs.py): what each epoch is
                   ├─> DispatchRecord (_dispatch_record.py): one epoch's tasks
                   ├─> Delivery (_iter_deliver.py) ─┐ a result made a batch
                   ├─> Receiver (_iter_receive.py) ─┤ results as they arrive
                   ├─> RingKeeper (_iter_ring.py) <─┘ the ring and its slots
                   ├─> WorkerPool (_pool.py): the worker processes
                   └─> DeferredWarnings (_warn.py)

Dispatch follows torch's _MultiProcessingDataLoaderIter step for step (same
sampler draws, round-robin from worker 0 each epoch, at most
prefetch_factor * num_workers tasks in flight, in_order=False rules, the same
handling of exhausted IterableDataset workers), so batches and their order are
torch's.  The difference: each task is sent with a ring slot claimed for it;
its batch comes back as a published slot whose tensors the main process views
in place.  Tasks carry ids unique over the iterator's life, so results of an
earlier epoch (persistent workers) are recognised and dropped.

Beyond torch (all opt-in, see DataLoader): fetch="sample" sends each batch to
every worker, which fill its slot row by row (_worker/_rows.py, _worker/_sample_layout.py); the
first sample of the loader is fetched alone first (a "probe") to fix the
layout and size the ring.  prefetch_next_epoch keeps dispatching, when the
sampler runs out, the next epoch's batches; they are numbered on from this
epoch's (epoch index >= the record's next_epoch_at) and adopted by the next
_reset if the samplers still describe the epoch they were drawn for
(_next_epoch.py).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.util
import os
import time

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _utils
from torch.utils.data.dataloader import (
    _BaseDataLoaderIter,
)

from .._errors import WorkerDied
from .._shm._ring import current_pid
from .._worker._protocol import ErrorReply, Probe, ResumeWorker, Rows, Task
from .._worker._seeding import countable
from . import _torch_api
from ._iter_parts import build_parts
from ._iter_receive import discard, kind
from ._pool import pickled
from ._warn import init_as_torch

# What _process_data returns for a batch fetched again after a resume and dropped.
_REPLAYED = object()
# Asked once a batch, as torch's __next__ asks it.
_profiler_enabled = torch.autograd._profiler_enabled
# torch's own __next__.  Tools replace it on _BaseDataLoaderIter (InfoBatch's
# pruning, tracers); every iterator of torch's then runs theirs, and so do ours.
_TORCHS_NEXT = _BaseDataLoaderIter.__next__


class ShmLoaderIter(_BaseDataLoaderIter):
    # torch draws it as an int64 tensor's .item(), which types say may be a float.
    _base_seed: int

    def __init__(self, loader) -> None:
        resume = loader._resume
        rng_before = (
            torch.get_rng_state() if resume is not None and loader.generator is None else None
        )
        init_as_torch(super().__init__, loader)  # its warnings are torch's
        self._prefetch_factor = loader.prefetch_factor
        _torch_api.check_iterator(self)
        # After the same draws (a negative num_workers, set since the loader
        # was made, would otherwise start no worker and end the epoch at once).
        _torch_api.check_workers_and_prefetch(self._num_workers, self._prefetch_factor)
        loader._take_resume()  # this iterator resumes it
        if resume is not None:
            self._base_seed = resume.settle_base_seed(
                loader, self._base_seed, self._persistent_workers, rng_before
            )
        self._died: str | None = None  # the message of the WorkerDied that ended it
        self._interrupted: str | None = None  # the name of the interrupt that ended it
        self._shutdown = False
        self._finishing = False  # its sampler ran out: workers told FINISH (_finish_workers)
        self._owner_pid = os.getpid()
        self._made_with = loader._options()  # see DataLoader.__iter__
        self._in_order = loader.in_order
        self._fetch = loader.fetch
        self._batch_size = loader.batch_size
        self._counters = loader._counters
        parts = build_parts(self, loader, resume)
        self._deferred_warnings = parts.deferred_warnings
        self._epochs = parts.epochs
        self._ring_keeper = parts.ring_keeper
        self._pool = parts.pool
        self._receiver = parts.receiver
        self._delivery = parts.delivery
        self._record = parts.record
        self._ring_keeper.attach(self._pool)
        # A non-persistent loader's next iterator: its workers start once
        # this one's first batch is here (see _spare.py).
        self._spare = None if self._persistent_workers else loader._spare_workers
        self._reset(loader, first_iter=True)

    @property
    def _ring(self):
        """The ring, or None before a slot size is known."""
        return self._ring_keeper.ring

    def __next__(self):
        # torch's __next__ opens a profiler record_function around every
        # batch: ~5 us that records nothing unless a profiler is on.  Only a
        # map-style dataset's iterator that has begun skips it (torch's first
        # _reset stays torch's; an IterableDataset's iterator is the subclass
        # below), unless a tool has put its own __next__ in torch's place.
        if (
            self._sampler_iter is None
            or _profiler_enabled()
            or _BaseDataLoaderIter.__next__ is not _TORCHS_NEXT
        ):
            return _BaseDataLoaderIter.__next__(self)
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _next_index(self):
        return countable(self._epochs.first_draw(super()._next_index), self._auto_collation)

    # ---- epochs ---------------------------------------------------------------

    def _reset(self, loader, first_iter=False) -> None:
        try:
            self._start_epoch(loader, first_iter)
        except Exception:
            raise
        except BaseException as e:
            self._end_on_interrupt(e)
            raise

    def _start_epoch(self, loader, first_iter) -> None:
        if loader._counters is not self._counters:
            # A copy.copy of the loader, made while this persistent iterator
            # was live, goes on with it (as torch's copies do): the epoch is
            # counted in the copy's stats and described by its state_dict().
            self._use_counters(loader._counters)
        epochs = self._epochs
        loader._progress = epochs.progress
        self._deferred_warnings.forget()  # met in an epoch left unfinished
        keeper = self._ring_keeper
        if keeper.ring is None and not first_iter:
            # Sized by the last epoch's batches, after its last next().
            slot_bytes = keeper.known_slot_bytes()
            if slot_bytes:
                keeper.start(slot_bytes, self._pool)
        self._epoch_started = time.perf_counter()
        rewind = None  # an epoch whose prefetched batches are dropped
        if epochs.prefetched is not None:
            if epochs.prefetched.holds():
                self._adopt_next_epoch()
                return
            rewind = epochs.drop_prefetched(self._counters, self._record)
        # (A persistent iterator's first epoch has fresh workers too: it may
        # follow one whose workers died or whose options changed.)
        resume = epochs.begin(loader, fresh_workers=first_iter or not self._persistent_workers)
        super()._reset(loader, first_iter)
        self._record = self._record.fresh()
        if resume is not None:
            self._num_yielded = epochs.resume_into(resume, self._record, self._next_index)
        with self._failing_workers():
            if not first_iter:
                self._resume_workers(rewind)
                grown = keeper.outgrown()
                if grown is not None:
                    # A batch outgrew the slots: the ring is made anew, now
                    # that no task of an earlier epoch can still write it.
                    keeper.retire()
                    keeper.start(grown, self._pool)
            for _ in range(self._prefetch_factor * self._num_workers):
                self._try_put_index()

    def _use_counters(self, counters) -> None:
        self._counters = counters
        for part in (self._deferred_warnings, self._ring_keeper, self._receiver, self._delivery):
            part.counters = counters
        counters.use_ring(self._ring_keeper.ring, self._num_workers, counted=True)

    def _resume_workers(self, rewind) -> None:
        """Start persistent workers on a new epoch, dropping the old one's
        results (a worker computes the old tasks still queued before the
        resume, as torch's do, so that the RNG draws match).  `rewind`:
        the number of an epoch whose prefetched batches are dropped; workers
        that fetched some go back to their RNG state from before them."""
        for i in range(self._num_workers):
            self._pool.send(i, ResumeWorker.wire(self._shared_seed, rewind))
        for worker_id, rng_state in self._receiver.resumed(self._num_workers):
            self._epochs.progress.worker_resumed(worker_id, rng_state)

    def _start_next_epoch(self) -> bool:
        """prefetch_next_epoch: the sampler ran out; go on with the next
        epoch's (see EpochPlanner.start_next_epoch).  False when there is
        nothing to prefetch."""
        if self._record.next_epoch_at is not None:
            return False
        if self._ring_keeper.outgrown() is not None:
            return False  # the ring is made anew, larger, as the next epoch starts
        sampler_iter = self._epochs.start_next_epoch(self, self._index_sampler)
        if sampler_iter is None:
            return False
        self._sampler_iter = sampler_iter
        self._record.start_next_epoch()
        return True

    def _adopt_next_epoch(self) -> None:
        """Make the prefetched epoch the current one: its tasks are renumbered
        from 0 and everything about them (in flight, arrived) is kept.  Tasks
        of an epoch broken off leave the new epoch its whole prefetch window,
        as torch's reset does: their results are awaited and dropped first,
        so that their slots are free for that window."""
        record = self._record
        stale, arrived = record.adopt_next_epoch()
        for result in arrived:
            discard(result)
        self._receiver.drop_earlier(stale, record.epoch_base)
        self._num_yielded = 0
        self._epochs.adopt_prefetched(self._counters)
        with self._failing_workers():
            # Tasks not yet yielded, in flight or arrived, as torch's reset primes.
            while len(record.tasks) < self._prefetch_factor * self._num_workers:
                sent = record.send_idx
                self._try_put_index()
                if record.send_idx == sent:
                    break

    # ---- dispatch (torch's rules) -----------------------------------------

    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        record, epochs = self._record, self._epochs
        assert record.outstanding < max_tasks
        try:
            index = epochs.draw(self._next_index)
        except StopIteration:
            if not self._start_next_epoch():
                if not self._finishing:
                    self._finish_workers()
                return
            try:
                index = epochs.draw(self._next_index)
            except StopIteration:
                return
        while epochs.yielded_before_resume(record.send_idx):
            record.pass_over(epochs.samples_in(index))
            try:
                index = epochs.draw(self._next_index)
            except StopIteration:
                return
        worker_id = record.next_worker(
            max_tasks, not self._in_order and _torch_api.IN_ORDER_FALSE_CAPS_EACH_WORKER
        )
        if worker_id is None:
            return
        task_id = record.next_task_id
        position = record.take_position(epochs.samples_in(index))
        record.sent(worker_id, self._dispatch(worker_id, task_id, index, position))

    def _finish_workers(self) -> None:
        """The epoch's every task is sent: a non-persistent iterator's
        workers exit as their last batches are unpacked (see NOTE [pool:
        finished workers] in _pool.py).  fetch="batch" only: with
        fetch="sample" every worker may still write any slot until the
        epoch ends."""
        if not self._persistent_workers and self._fetch == "batch":
            self._finishing = True
            for worker_id, tasks in enumerate(self._record.workers_num_tasks):
                if not tasks:
                    self._pool.finish(worker_id)

    def _dispatch(self, worker_id, task_id, index, position):
        """Send one batch's task: to every worker (fetch="sample": rows of
        one slot) or to worker_id (a whole batch).  Returns None, or the
        batch's result if it is known at once (its first sample failed
        before there was a layout)."""
        epoch = self._epochs.epoch
        first_row = 0
        # An empty batch (a batch_sampler's) has no rows: one worker collates
        # it whole, failing as torch's collate does.
        rows = self._fetch == "sample" and self._epochs.samples_in(index) > 0
        handover = self._ring_keeper.handover
        if rows and handover.sample_layout is None:
            error = self._learn_layout(task_id, index, epoch, position)
            if error is not None:
                return error
            first_row = len(index)  # every row is the worker's that fetched it already
        slot = self._ring_keeper.claim()
        # Everything but rows goes whole to one worker (a batch bigger than
        # the layout's rows is collated into the slot, or spills).
        by_rows = rows and slot >= 0 and len(index) <= handover.sample_layout.capacity
        try:
            data = pickled(
                Rows.wire(task_id, slot, index, epoch, position, first_row)
                if by_rows
                else Task.wire(task_id, index, slot, epoch, position)
            )
        except Exception:
            if slot >= 0:
                self._ring_keeper.ring.abandon(slot)  # (no worker heard of it)
            return _unsendable(task_id, worker_id, by_rows)
        if by_rows:
            self._ring_keeper.ring.rows_begin(slot, task_id, len(index), first_row)
            self._pool.broadcast_pickled(data)
        else:
            self._pool.send_pickled(worker_id, data)
        return None

    def _learn_layout(self, task_id, index, epoch, position):
        """fetch="sample": every worker starts on its share of this batch's
        samples; the one with its first sample describes the layout it
        fixes, and the ring is made from it while the others go on fetching.
        Returns None, or the first sample's error (which becomes this
        batch's result)."""
        capacity = self._batch_size or len(index)
        try:
            data = pickled(Probe.wire(task_id, index, epoch, position, capacity))
        except Exception:
            return _unsendable(task_id, None, True)
        self._pool.broadcast_pickled(data)
        payload = self._receiver.take(task_id)
        if kind(payload) == "error":
            return payload
        layout = payload.layout
        slot_bytes = self._ring_keeper.slot_bytes
        if slot_bytes is not None and slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"slot_bytes={slot_bytes} is too small for fetch='sample' "
                f"batches of {capacity} samples of {layout.sample_bytes} bytes each: "
                f"{layout.slot_bytes} bytes are needed. Pass slot_bytes >= {layout.slot_bytes}, "
                "or leave it None."
            )
        self._ring_keeper.handover.sample_layout = layout
        self._ring_keeper.start(layout.slot_bytes, self._pool)
        return None

    # ---- results --------------------------------------------------------------

    def _next_data(self):
        if self._deferred_warnings.errors:
            self._deferred_warnings.raise_first()
        if self._owner_pid != current_pid():
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
            if self._spare is not None:
                spare, self._spare = self._spare, None
                spare.start(self._pool.ctx, self._num_workers)
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
        ring = self._ring_keeper.ring
        if ring is not None:
            in_use = ring.nslots - ring.count_free()
            counters.occupancy_sum += in_use
            counters.occupancy_max = max(counters.occupancy_max, in_use)
        return batch

    def _next_batch(self):
        keeper, record = self._ring_keeper, self._record
        if keeper.ring is None and keeper.handover.learned_slot_bytes is not None:
            keeper.start(keeper.known_slot_bytes(), self._pool)
        per_worker = self._fetch == "batch"
        while True:
            if record.waiting:
                idx = record.first_in_turn(record.waiting, per_worker)
                if idx is not None:
                    return self._yield_task(idx)
            idx = record.next_in_line()
            if idx is None:
                if self._deferred_warnings.errors:  # instead of StopIteration (raised next time)
                    self._deferred_warnings.raise_first()
                self._epochs.progress.epoch_ended()
                if not self._persistent_workers:
                    self._shutdown_workers(idle=True)
                raise StopIteration
            if record.tasks[idx].result is not None:
                record.rcvd_idx += 1
                return self._yield_task(idx)

            assert not self._shutdown and record.outstanding > 0
            idx, data = self._receiver.next_of_epoch(record.epoch_base)
            record.outstanding -= 1
            if kind(data) == "stop":
                worker_id = record.tasks[idx].worker_id
                record.workers_status[worker_id] = False
                self._epochs.progress.worker_ran_out(worker_id, data.state)
                if not self._persistent_workers:
                    self._pool.stop(worker_id)
                self._try_put_index()
                continue
            record.tasks[idx].result = data
            if idx == record.rcvd_idx:
                record.rcvd_idx += 1
                return self._yield_task(idx)
            if not self._in_order and (record.next_epoch_at is None or idx < record.next_epoch_at):
                if record.first_in_turn([idx], per_worker) is None:
                    record.waiting.add(idx)
                    continue
                return self._yield_task(idx)

    def _yield_task(self, idx):
        worker_id, data, number = self._record.yielded(idx)
        return self._process_data(data, worker_id, idx, number)

    def _process_data(self, data, worker_id, idx, number):
        self._try_put_index()
        progress = self._epochs.progress
        if self._epochs.replayed(worker_id, number):  # resuming an IterableDataset
            discard(data)
            return _REPLAYED
        if kind(data) == "error":
            progress.batch_yielded(idx, worker_id, data.state, number)
            data.wrapper.reraise()
        batch, worker_state = self._delivery.unpack(data)
        if self._finishing and not self._record.workers_num_tasks[worker_id]:
            self._pool.finish(worker_id)  # its last batch is unpacked
        progress.batch_yielded(idx, worker_id, worker_state, number)
        return self._delivery.to_device(batch, data)

    # ---- ends -----------------------------------------------------------------

    def _end_on_death(self, error: WorkerDied) -> None:
        self._died = str(error)
        self._shutdown_workers(graceful=False)

    def _end_on_interrupt(self, interrupt: BaseException) -> None:
        """A KeyboardInterrupt can land between any two steps of next()'s
        bookkeeping (a batch taken from the ring and not yet returned, a task
        recorded and not yet sent): going on could skip batches silently, so
        it ends this iterator, as a worker's death does (torch's, interrupted
        and asked again, may wait forever)."""
        self._interrupted = type(interrupt).__name__
        self._shutdown_workers(graceful=False)

    @contextlib.contextmanager
    def _failing_workers(self):
        """A worker's death ends this iterator: the other workers are stopped
        at once, and the loader's next iter() starts afresh."""
        try:
            yield
        except WorkerDied as e:
            self._end_on_death(e)
            raise

    def _shutdown_workers(self, graceful: bool = True, idle: bool = False) -> None:
        """Stop the workers: graceful=False at once (one died); idle=True
        (the epoch's end) without waiting for them to exit: whoever reuses
        or retires the ring waits (WorkerPool.leave_idle)."""
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
        self._deferred_warnings.forget()
        if os.getpid() != self._owner_pid:
            return  # a forked child collecting a copy: the workers are not its own
        writers_gone = None
        try:
            if idle:
                # Every task answered, each its own batch: no leaving worker
                # touches the ring again, and whoever uses it next need not
                # wait for them.  (Else, say a task sent to a worker whose
                # IterableDataset ran out, it may still give back its slot.)
                awaited = bool(self._record.outstanding) or self._fetch != "batch"
                self._pool.leave_idle(awaited)
                if awaited:
                    writers_gone = functools.partial(self._pool.reap, True)
            else:
                self._pool.shutdown(graceful)
        finally:  # (interrupted, the workers are gone all the same: see shutdown)
            self._release_results(writers_gone)

    def _release_results(self, writers_gone=None) -> None:
        """Free what the workers, gone or going (`writers_gone` waits until
        they are gone), left: results not yielded (their slots are free for
        the loader's next iterator even while this one is still referenced),
        and the ring."""
        self._receiver.drop_all()
        for result in self._record.arrived_results():
            discard(result)
        self._ring_keeper.hand_back(self._epochs.loader() is not None, writers_gone)

    def __del__(self) -> None:
        if hasattr(self, "_record"):  # (its parts are made at once, the record last)
            self._shutdown_workers()


def _unsendable(task_id, worker_id, by_rows):
    """The result of a batch whose indices could not be pickled (called where
    pickle's error is handled): that error, raised by the next() whose batch
    it is, as a worker's error is, so that the batches before it and after it
    are yielded (torch's loader cannot send such a task either, and waits for
    it until its timeout, or forever)."""
    to = "every DataLoader worker" if by_rows else f"DataLoader worker process {worker_id}"
    wrapper = ExceptionWrapper(
        where=f"in the main process, pickling this batch's indices to send them to {to} "
        "(a sampler's indices travel to the workers by pickle: yield numbers, strings, or "
        "tuples and lists of them)"
    )
    return ErrorReply._make(ErrorReply.wire(task_id, wrapper, None))


class _TorchsNext:
    """_BaseDataLoaderIter.__next__ as it is when next() looks it up: torch's,
    or what a tool put in its place."""

    def __get__(self, it, owner=None):
        return _BaseDataLoaderIter.__next__.__get__(it, owner)


class IterableShmLoaderIter(ShmLoaderIter):
    """An IterableDataset's: torch's __next__ is next() itself, so that its
    warning of a stream longer than len() names the user's line, as torch's
    does."""

    __next__ = _TorchsNext()

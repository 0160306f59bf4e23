"""The multi-process iterator: torch's dispatch and ordering, shmloader's transport.

Dispatch follows torch's _MultiProcessingDataLoaderIter step for step (same
sampler draws, round-robin from worker 0 each epoch, at most
prefetch_factor * num_workers tasks in flight, in_order=False rules, the same
handling of exhausted IterableDataset workers), so batches and their order are
torch's.  The difference: each task is sent with a ring slot claimed for it;
its batch comes back as a published slot whose tensors the main process views
in place.  Tasks carry ids unique over the iterator's life, so results of an
earlier epoch (persistent workers) are recognised and dropped.

Beyond torch (all opt-in, see DataLoader): fetch="sample" sends each batch to
every worker, which fill its slot row by row (_worker.py, _samples.py); the
first sample of the loader is fetched alone first (a "probe") to fix the
layout and size the ring.  prefetch_next_epoch keeps dispatching, when the
sampler runs out, the next epoch's batches; they are numbered on from this
epoch's (epoch index >= _next_epoch_at) and adopted by the next _reset if the
samplers still describe the epoch they were drawn for (_sampler_state.py).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing.util
import os
import time
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_fds

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _utils
from torch.utils.data.dataloader import (
    IterDataPipe,
    _DatasetKind,
    MapDataPipe,
    _BaseDataLoaderIter,
    _sharding_worker_init_fn,
)

from . import _cuda, _layout, _torch_api
from ._pool import WorkerDied, WorkerPool
from ._ring import MAX_SLOTS
from ._resume import STATE_BYTES, Progress, carries_state, replay_message, sampler_state
from ._rings import create_ring, reserve_in_background, retire, slots_that_fit, \
    smaller_ring_message
from ._sampler_state import PrefetchedEpoch, can_prefetch
from ._seeding import countable, positions_in
from ._warn import WarnsBetweenBatches, init_as_torch
from ._worker import MEASURE, NO_SLOT

# Slots beyond the prefetch_factor * num_workers batches in flight: the batch
# being yielded, the one the loop still holds, and two a user may keep (the
# last batch of a previous loop, one kept for logging) before any batch has
# to travel outside the ring (see _one_off.py).
SPARE_SLOTS = 4
# A new ring's slots are reserved as workers first write them; the rest of it
# after this many batches from it: not while the first batch is on its way,
# nor for a loader dropped after one batch.
RESERVE_REST_AFTER = 2


class ShmLoaderIter(WarnsBetweenBatches, _BaseDataLoaderIter):
    def __init__(self, loader) -> None:
        resume = loader._resume
        rng_before = torch.get_rng_state() if resume is not None and loader.generator is None \
            else None
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
            self._base_seed = resume.settle_base_seed(loader, self._base_seed,
                                                      self._persistent_workers, rng_before)
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
        self._row_errors = {}  # fetch="sample": task id -> {row: (ExceptionWrapper, collating)}
        self._slot_bytes = loader.slot_bytes
        self._sized_by_user = loader.num_slots is not None
        # Capped at what a ring can hold: tasks in flight beyond it travel
        # outside the ring (with the ring-full warning).
        self._nslots = loader.num_slots or min(
            self._prefetch_factor * self._num_workers + SPARE_SLOTS, MAX_SLOTS)
        device = loader.device
        self._device_stage = _cuda.DeviceStage(device) if device is not None else None
        # Pin the ring itself (once) where batches go to a CUDA device.
        self._register = torch.cuda.is_available() and (
            _torch_api.pins_to_cuda(self)
            or (device is not None and device.type == "cuda"))
        self._registered = False
        # Slot room beyond the batch's own for the worker state it carries.
        self._state_bytes = STATE_BYTES if carries_state(
            self._dataset_kind, loader.seed_per_sample) else 0

        slot_bytes = self._known_slot_bytes()
        if slot_bytes:
            # Before the workers are forked: a spare ring not taken is gone
            # then, not mapped on in them (its memory held) as they run.
            self._open_ring(slot_bytes)

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
        self._pool = WorkerPool(ctx, [
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
        ])
        self._next_epoch_at = None  # epoch index of the next epoch's first task
        self._prefetched = None  # its PrefetchedEpoch
        self._attach_ring()
        self._reset(loader, first_iter=True)

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

    # ---- ring -------------------------------------------------------------

    def _known_slot_bytes(self) -> int | None:
        """The slot size a ring can be made with before any batch of this
        iterator: fetch="sample"'s layout, the user's, or the one learned."""
        learned = self._handover.learned_slot_bytes
        if self._fetch == "sample":
            # (learned: a longer batch than the layout's spilled.)
            layout = self._handover.sample_layout
            return max(layout.slot_bytes, learned or 0) if layout is not None else None
        return self._slot_bytes or learned

    def _outgrown(self) -> bool:
        """Whether a batch did not fit this iterator's slots (with
        slot_bytes=None): a ring made now would have larger ones (see
        _reset)."""
        wanted = self._known_slot_bytes()
        return wanted is not None and self._ring.slot_bytes < wanted + self._state_bytes

    def _start_ring(self, slot_bytes: int) -> None:
        self._open_ring(slot_bytes)
        self._attach_ring()

    def _open_ring(self, slot_bytes: int) -> None:
        """The loader's spare ring where it fits, else a new one."""
        slot_bytes = max(slot_bytes, self._slot_bytes or 0) + self._state_bytes
        self._ring = self._handover.take_spare_ring(self._nslots, slot_bytes)
        if self._ring is None:
            # The stats stop reading the loader's last ring, so that its memory
            # is gone before this one is measured out and made.
            self._counters.use_ring(None, self._num_workers)
            self._ring = self._create_ring(slot_bytes)
            self._reserve_rest_in = RESERVE_REST_AFTER

    def _attach_ring(self) -> None:
        """Hand the ring to the workers, and count from it."""
        if self._ring is None:
            return
        if self._register:
            self._registered = self._ring.release_hook is not None
            if not self._registered:
                failure = _cuda.register(self._ring)
                self._registered = failure is None
                if failure is not None and not self._counters.warned_register:
                    self._counters.warned_register = True
                    self._warn(f"shmloader: could not pin the ring's memory with CUDA ({failure}); "
                               "batches are pinned by torch's copy instead.", "warned_register")
        self._pool.send_ring(self._ring)
        if self._fetch == "sample":
            self._pool.broadcast(("layout", self._handover.sample_layout))
        self._counters.use_ring(self._ring, self._num_workers)

    def _create_ring(self, slot_bytes: int):
        """A new ring, checked against the memory this process can get.  With
        the default num_slots, a ring that does not fit is made smaller, down
        to the batches in flight, the one being yielded and the one the loop
        holds; below that, or with a num_slots the user chose, it is a
        SharedMemoryError naming the bytes needed and available."""
        nslots = self._nslots
        if not self._sized_by_user:
            fit, room = slots_that_fit(slot_bytes)
            least = min(self._prefetch_factor * self._num_workers + 2, nslots)
            if least <= fit < nslots:
                nslots = fit
                if not self._counters.warned_smaller_ring:
                    self._counters.warned_smaller_ring = True
                    self._warn(smaller_ring_message(fit, self._nslots, slot_bytes, room),
                               "warned_smaller_ring")
        return create_ring(nslots, slot_bytes)  # (its error names the sizes)

    def _retire_ring(self) -> None:
        """This persistent iterator's ring is made anew (batches the loop
        keeps keep their slots)."""
        ring, self._ring = self._ring, None
        self._counters.use_ring(None, self._num_workers)
        retire(ring)

    def _learn_layout(self, task_id, index, epoch, position):
        """fetch="sample": every worker starts on its share of this batch's
        samples; the one with its first sample describes the layout it
        fixes, and the ring is made from it while the others go on fetching.
        Returns None, or the first sample's error (which becomes this
        batch's result)."""
        capacity = self._batch_size or len(index)
        self._pool.broadcast(("probe", task_id, index, epoch, position, capacity))
        earlier = []  # results of tasks sent before this one (an empty batch's)
        while True:
            arrived, payload = self._next_arrival()
            if arrived == task_id:
                break
            earlier.append((arrived, payload))
        self._arrivals.extendleft(reversed(earlier))
        if _kind(payload) == "error":
            return payload
        layout = payload[2]
        if self._slot_bytes is not None and self._slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"slot_bytes={self._slot_bytes} is too small for fetch='sample' "
                f"batches of {capacity} samples of {layout.sample_bytes} bytes each: "
                f"{layout.slot_bytes} bytes are needed. Pass slot_bytes >= {layout.slot_bytes}, "
                "or leave it None.")
        self._handover.sample_layout = layout
        self._start_ring(layout.slot_bytes)
        return None
    def _claim_slot(self) -> int:
        if self._ring is None:
            return MEASURE
        if self._registered:
            self._ring.release_hook.reclaim(self._ring)  # slots whose copies are done
        slot = self._ring.claim()
        if slot is not None:
            return slot
        # (A ring made smaller for want of room said so: batches beyond it are
        # expected there, and not the loop's doing.)
        if not self._counters.warned_ring_full and self._ring.nslots == self._nslots:
            self._counters.warned_ring_full = True
            self._warn(
                f"shmloader: all {self._ring.nslots} ring slots are in use (batches still "
                "referenced by your code, plus those in flight); further batches travel in "
                "shared memory of their own, made for each (slower), until slots are "
                "released. Any tensor kept from a batch (a mask collected for a metric) holds "
                "its batch's whole slot: keep a .clone() of it instead. The ring stays at "
                f"{self._ring.total_bytes} bytes; pass num_slots= to keep more batches in "
                "it.", "warned_ring_full"
            )
        return NO_SLOT

    # ---- epochs -----------------------------------------------------------

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
            self._counters = loader._counters
            self._counters.use_ring(self._ring, self._num_workers, counted=True)
        loader._progress = self._progress
        self._forget_deferred_warnings()  # met in an epoch left unfinished
        if self._ring is None and not first_iter:
            # Sized by the last epoch's batches, after its last next().
            slot_bytes = self._known_slot_bytes()
            if slot_bytes:
                self._start_ring(slot_bytes)
        self._epoch_started = time.perf_counter()
        rewind = None  # an epoch whose prefetched batches are dropped
        if self._prefetched is not None:
            if self._prefetched.holds():
                self._adopt_next_epoch()
                return
            rewind = loader._epochs_started = self._prefetched.epoch  # numbered again below
            self._counters.dropped_prefetched_batches += self._send_idx - self._next_epoch_at
        resume, self._resume = self._resume, None
        started_from = None  # a finished epoch's state: where the workers start
        if resume is not None and resume.finished:
            # Already applied: the new epoch starts as any other, its workers
            # from the saved states.
            started_from, resume = resume, None
        if resume is not None:
            resume.restore_sampler(loader)
        self._epoch = loader._next_epoch()  # numbers epochs for seed_per_sample
        # Before super()._reset, which runs iter() on the sampler.
        # (A persistent iterator's first epoch has fresh workers too: it may
        # follow one whose workers died or whose options changed.)
        self._progress.epoch_begins(loader, self._epoch, self._base_seed, self._num_workers,
                                    sampler_state(loader),
                                    fresh_workers=first_iter or not self._persistent_workers)
        if started_from is not None:
            self._progress.workers_start_from(
                [started_from.worker_state(i) for i in range(self._num_workers)])
        super()._reset(loader, first_iter)
        self._position = 0  # epoch position of the next sample to dispatch
        self._epoch_base += self._send_idx  # task ids stay unique across epochs
        self._send_idx = 0  # epoch index of the next task to send
        self._rcvd_idx = 0  # epoch index of the next batch to yield
        self._task_info = {}  # epoch index -> (worker_id,) or (worker_id, data)
        self._held = set()  # in_order=False: results waiting for their worker's earlier ones
        self._tasks_outstanding = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        # IterableDataset: each task's number among its worker's, and how many
        # each worker was sent (see Progress.batch_yielded).
        iterable = self._dataset_kind == _DatasetKind.Iterable
        self._task_numbers = {} if iterable else None
        self._tasks_sent = [0] * self._num_workers
        self._replay = None
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        self._next_epoch_at = self._prefetched = None
        if resume is not None:
            self._resume_epoch(resume)
        with self._failing_workers():
            if not first_iter:
                self._resume_workers(rewind)
                if self._ring is not None and self._outgrown():
                    # A batch outgrew the slots: the ring is made anew, now
                    # that no task of an earlier epoch can still write it.
                    self._retire_ring()
                    self._start_ring(self._known_slot_bytes())
            for _ in range(self._prefetch_factor * self._num_workers):
                self._try_put_index()

    def _resume_epoch(self, resume) -> None:
        """Pick up a loaded state's epoch after the batches it had yielded:
        their indices are drawn and dropped (map-style), or the workers'
        datasets resume from their own states, or, for an IterableDataset
        without state_dict, those batches are fetched again and dropped."""
        self._progress.resumed_from(resume)
        self._num_yielded = resume.skip + len(resume.skip_beyond)
        if resume.replay:
            if resume.replayed:
                # The batches the interrupted run yielded, known by their
                # worker's task numbers: with in_order=False, neither the
                # first batches to arrive nor those at the same positions.
                self._replay = [(below, set(beyond)) for below, beyond in resume.yielded_by_worker]
                self._warn(replay_message(resume.replayed))
            return
        self._pending_first_draw = resume
        for drawn in range(resume.skip):
            try:
                index = self._next_index()
            except StopIteration:
                raise resume.sampler_ran_out(drawn) from None
            self._position += self._samples_in(index)
            next(self._worker_queue_idx_cycle)
            self._send_idx += 1
        self._rcvd_idx = self._send_idx
        self._skip = set(resume.skip_beyond)

    def _next_index(self):
        if self._pending_first_draw is not None:
            resume, self._pending_first_draw = self._pending_first_draw, None
            index = resume.first_draw(super()._next_index)
        else:
            index = super()._next_index()
        return countable(index, self._auto_collation)

    def _samples_in(self, index) -> int:
        return positions_in(index, self._auto_collation)

    def _draw(self):
        """The next batch's indices, from this epoch's sampler or, once that
        ran out, the prefetched epoch's."""
        if self._prefetched is not None:
            return self._prefetched.draw(self._next_index)
        return self._next_index()

    def _start_next_epoch(self) -> bool:
        """prefetch_next_epoch: the sampler ran out; go on with the next
        epoch's sampler (set_epoch(e + 1) where it has one, privately: see
        _sampler_state.py).  False when there is nothing to prefetch."""
        if not self._prefetch_next_epoch or self._next_epoch_at is not None:
            return False
        if self._ring is not None and self._outgrown():
            return False  # the ring is made anew, larger, as the next epoch starts
        loader = self._loader_ref()
        # Nobody can start another epoch; or the loader let this iterator go
        # (load_state_dict); or a sampler's set_epoch could not be undone after the draws.
        if loader is None or loader._iterator is not self or not can_prefetch(loader):
            return False
        self._next_epoch_at = self._send_idx
        self._epoch = loader._next_epoch()
        self._next_epoch_start = Progress()
        self._next_epoch_start.epoch_begins(loader, self._epoch, self._base_seed,
                                            self._num_workers, sampler_state(loader),
                                            fresh_workers=False)
        self._progress.next_start = self._next_epoch_start
        self._prefetched = PrefetchedEpoch(weakref.proxy(loader), self._epoch)
        with contextlib.suppress(StopIteration):  # failed: the next draws stop at once
            self._sampler_iter = self._prefetched.draw(lambda: iter(self._index_sampler))
        self._position = 0
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        return True

    def _adopt_next_epoch(self) -> None:
        """Make the prefetched epoch the current one: its tasks are renumbered
        from 0 and everything about them (in flight, arrived) is kept."""
        shift = self._next_epoch_at
        self._epoch_base += shift
        self._send_idx -= shift
        self._rcvd_idx = 0
        self._task_info = {i - shift: info for i, info in self._task_info.items()}
        # Tasks of an epoch broken off (numbered below 0 now) leave the new
        # epoch its whole prefetch window, as torch's reset does: their
        # results are awaited and dropped first, so that their slots are free
        # for that window.
        stale = 0
        for idx in [i for i in self._task_info if i < 0]:
            info = self._task_info.pop(idx)
            self._workers_num_tasks[info[0]] -= 1
            if len(info) == 1:
                self._tasks_outstanding -= 1
                stale += 1
            else:
                _discard(info[1])
        kept = []  # the new epoch's results that come meanwhile
        while stale:
            task_id, payload = self._next_arrival()
            if task_id is not None and task_id < self._epoch_base:
                _discard(payload)
                stale -= 1
            else:
                kept.append((task_id, payload))
        self._arrivals.extendleft(reversed(kept))
        self._held = set()  # (the broken-off epoch's, dropped above)
        self._num_yielded = 0
        self._prefetched.adopt()
        self._next_epoch_at = self._prefetched = None
        self._progress.begin_like(self._next_epoch_start)
        self._counters.prefetched_epochs += 1
        with self._failing_workers():
            # Tasks not yet yielded, in flight or arrived, as torch's reset primes.
            while len(self._task_info) < self._prefetch_factor * self._num_workers:
                sent = self._send_idx
                self._try_put_index()
                if self._send_idx == sent:
                    break

    def _resume_workers(self, rewind) -> None:
        """Start persistent workers on a new epoch, dropping the old one's
        results (a worker computes the old tasks still queued before the
        resume, as torch's do, so that the RNG draws match).  `rewind`:
        the number of an epoch whose prefetched batches are dropped; workers
        that fetched some go back to their RNG state from before them."""
        for i in range(self._num_workers):
            self._pool.send(i, ("resume", self._shared_seed, rewind))
        pending = self._num_workers
        while pending:
            task_id, payload = self._next_arrival()
            if task_id is None:
                pending -= 1
                _, worker_id, rng_state = payload
                self._progress.worker_resumed(worker_id, rng_state)
            else:
                _discard(payload)
        # Every worker published or gave up its old tasks before it answered:
        # what is left arrived with the answers and is stale too.  Its slots
        # must be free before the new epoch claims any.
        while self._arrivals:
            _discard(self._arrivals.popleft()[1])

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
            self._pool.broadcast(("rows", task_id, slot, index, epoch, position, first_row))
        else:
            # Everything else goes whole to one worker (a batch bigger than
            # the layout's rows is collated into the slot, or spills).
            self._pool.send(worker_id, ("task", task_id, index, slot, epoch, position))
        return None

    # ---- receiving ----------------------------------------------------------

    def _next_arrival(self):
        """(task_id, payload) of the next result from any worker, or
        (None, ("resumed", ...)); sleeps until one comes, a worker dies, or the
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
        writing a later message).  So taking the slots, then the pipes, and
        sorting by task id keeps every worker's results in its own order,
        which in_order=False yields as they come; but the slots taken after
        reading messages (to include those published before them) may hold
        one published after a message not read yet, which then overtakes it.
        (So a resume's replay knows batches by their task numbers, not their
        order: see _resume_epoch.  in_order=True puts results in task order
        anyway: there the pipes are read as the sleep found them, sparing a
        poll() per batch.)"""
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
                fired = _wait_fds(self._pool.wait_fds, timeout) or None
            self._counters.wait_seconds += time.perf_counter() - started
            if fired is None:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            leases = self._acquire_all()  # what the sleep ended for
            if leases and not self._in_order:
                fired = self._ring.wait(0, self._pool.wait_fds) or []
        messages = self._pool.receive(fired)
        arrivals = [(lease.seq, lease) for lease in leases]
        for worker_id, msg in messages:
            arrivals.append(self._accept(worker_id, msg))
        if messages:  # slots published before those messages
            arrivals.extend((lease.seq, lease) for lease in self._acquire_all())
        more = []  # messages read while waiting for row errors
        # Only a fetch="sample" slot with failed rows needs more than passing on.
        arrivals = [self._with_row_errors(a, more)
                    if _kind(a[1]) == "slot" and a[1].failed_rows else a
                    for a in arrivals if a is not None]
        arrivals += more
        arrivals.sort(key=lambda a: -1 if a[0] is None else a[0])
        self._arrivals.extend(arrivals)

    def _with_row_errors(self, arrival, more):
        """A fetch="sample" slot with failed rows becomes the error of its
        first failed row, a failed fetch before a failed write (torch fetches
        every sample before it collates).  Each row's error was sent before
        that row counted as done, so all of them are in the pipes by now."""
        task_id, payload = arrival
        errors = self._row_errors.setdefault(task_id, {})
        while len(errors) < payload.failed_rows:
            # The pipes only: the ring would wake this at once for any READY slot.
            fired = wait_fds(self._pool.wait_fds, 1.0)
            for worker_id, msg in self._pool.receive(fired):
                other = self._accept(worker_id, msg)
                if other is not None:
                    more.append(other)
        del self._row_errors[task_id]
        payload.release()
        first = min(errors, key=lambda row: (errors[row][1], row))
        return task_id, ("error", task_id, errors[first][0])

    def _acquire_all(self):
        leases = []
        if self._ring is not None:
            while (lease := self._ring.acquire()) is not None:
                leases.append(lease)
        return leases

    def _accept(self, worker_id, msg):
        """The arrival (task_id or None, msg) for a worker's pipe message, or
        None for a row's error (kept until its slot arrives)."""
        kind = msg[0]
        if kind == "resumed":
            return None, msg
        if kind == "row_error":
            self._row_errors.setdefault(msg[1], {})[msg[2]] = msg[3:5]
            return None
        needed = msg[4] if kind == "batch" else msg[3] if kind == "segment" else 0
        if needed:  # measured: only with slot_bytes=None (see WorkerConfig)
            # The first batch sizes the ring, with headroom for batches that
            # vary a little.  The ring is made at the next next() call, so
            # that its prefaulting does not delay this batch; until then the
            # largest batch that arrived counts (a later batch may arrive
            # before the first one, and be smaller).  A batch that does not
            # fit the ring made since (it spilled, or was sent before the ring
            # was made) makes the slots larger when the next epoch starts
            # (see _reset), where memory holds all of them (else an outsized
            # batch would cost the ring, not just itself).
            handover = self._handover
            learned = needed + needed // 16 + 65536
            if self._ring is None:
                if learned > (handover.learned_slot_bytes or 0):
                    handover.learned_slot_bytes = learned
            elif needed > self._ring.slot_bytes - self._state_bytes:
                self._grow_for(learned)
        return msg[1], msg

    def _grow_for(self, learned: int) -> None:
        """A batch outgrew this iterator's ring: its slots grow to `learned`
        bytes at the next epoch, where a ring of those fits in memory in this
        one's place."""
        if learned > (self._handover.learned_slot_bytes or 0):
            fit, _ = slots_that_fit(learned + self._state_bytes, replacing=self._ring)
            if fit >= self._ring.nslots:
                self._handover.learned_slot_bytes = learned

    def _get_data(self):
        """(epoch index, data) of the next result of this epoch."""
        while True:
            task_id, payload = self._next_arrival()
            if task_id is not None and task_id >= self._epoch_base:
                return task_id - self._epoch_base, payload
            _discard(payload)

    def _next_data(self):
        if self._deferred_warnings:
            self._raise_deferred_warning()
        if self._owner_pid != os.getpid():
            raise RuntimeError(
                "this DataLoader iterator was made by the process this one was forked from, "
                "whose workers and ring it uses; iterate the loader again here (iter(loader)) "
                "for workers of this process's own.")
        if self._died is not None:
            raise WorkerDied(f"this DataLoader iterator ended when a worker died: {self._died} "
                             "iter(loader) starts a new one with fresh workers.")
        if self._interrupted is not None:
            raise RuntimeError(
                f"this DataLoader iterator ended when a {self._interrupted} interrupted its "
                "next(), which may have been taking a batch on its way; iter(loader) starts a "
                "new one with fresh workers.")
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
                self._progress.worker_ran_out(worker_id, data[2])
                if not self._persistent_workers:
                    self._pool.stop(worker_id)
                self._try_put_index()
                continue
            if idx != self._rcvd_idx:
                if not self._in_order and (self._next_epoch_at is None or
                                           idx < self._next_epoch_at):
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

    def _first_in_turn(self, indices):
        """The first of these arrived results whose worker has answered every
        earlier task of its own, or None.  With in_order=False a slot can
        overtake its worker's earlier answer on the pipe (see _collect); torch
        never yields a worker's results out of that worker's order (a resumed
        IterableDataset relies on it), so such a result waits its turn.
        (fetch="sample" tasks belong to no one worker.)"""
        for idx in sorted(indices):
            worker_id = self._task_info[idx][0]
            if self._fetch != "batch" or not any(
                    j < idx and len(info) == 1 and info[0] == worker_id
                    for j, info in self._task_info.items()):
                return idx
        return None

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
            self._progress.batch_yielded(idx, worker_id, data[3] if len(data) > 3 else None, number)
            data[2].reraise()
        batch, worker_state = self._unpack(data)
        self._progress.batch_yielded(idx, worker_id, worker_state, number)
        if self._pin_memory and not (self._registered and _kind(data) == "slot"):
            batch = self._pin(batch)
        if self._device_stage is not None:
            batch = self._device_stage(batch)
        return batch

    def _pin(self, batch):
        """torch's pin-memory thread's step: its errors come as that thread's."""
        try:
            return _utils.pin_memory.pin_memory(batch, self._pin_memory_device)
        except Exception:
            ExceptionWrapper(where=f"in pin memory thread for device {self._pin_device_id}"
                             ).reraise()

    def _unpack(self, data):
        counters = self._counters
        counters.batches += 1
        kind = _kind(data)
        if kind == "slot":
            lease = data
            counters.slot_batches += 1
            if self._reserve_rest_in:
                self._reserve_rest_in -= 1
                if not self._reserve_rest_in:
                    reserve_in_background(self._ring)
        elif kind == "segment":
            lease = data[5]  # a one-off segment's (see _one_off.py)
        else:  # "batch": pickled by torch
            counters.samples += data[5]
            self._count_outside_ring(data[2], data[6])
            return data[3], data[6]
        if lease.meta_len == 0:  # filled row by row (fetch="sample")
            meta = self._handover.sample_layout.meta(lease.rows)
        else:
            meta = lease.meta()
        batch, fallback_leaves, samples, worker_state = _layout.loads(
            meta, lease, kind == "segment" or not self._registered)
        counters.fallback_leaves += fallback_leaves
        counters.samples += samples
        if kind == "segment":
            self._count_outside_ring(data[2], worker_state)
        return batch, worker_state

    def _count_outside_ring(self, reason: str, worker_state) -> None:
        """Count a batch that came outside the ring, and why."""
        counters = self._counters
        if reason == "no_ring":
            counters.unsized_batches += 1
        elif reason == "ring_full":
            counters.ring_full_batches += 1
        else:
            counters.spilled_batches += 1
            self._warn_spill(worker_state)

    def _warn_spill(self, worker_state) -> None:
        if not self._counters.warned_spill:
            self._counters.warned_spill = True
            state_bytes = len(worker_state) if worker_state is not None else 0
            state = (f" (with the worker's state, {state_bytes} bytes: the dataset's "
                     "state_dict() and the RNGs)" if state_bytes > self._state_bytes else "")
            sized = (f"slot_bytes={self._slot_bytes}, rounded up to a page" if self._slot_bytes
                     else "sized from the loader's first batches")
            self._warn(
                f"shmloader: a batch{state} did not fit its slot "
                f"({self._ring.slot_bytes - self._state_bytes} bytes for a batch: {sized}) and was "
                "delivered whole in shared memory of its own (slower); later ones that do not fit "
                "will be too" + (
                    ". Pass slot_bytes= to size slots for your largest batch." if self._slot_bytes
                    else " until the next epoch starts, whose ring has slots made to fit the "
                    "largest batch seen. Pass slot_bytes= to size slots for your largest batch "
                    "from the start."),
                "warned_spill"
            )

    # ---- shutdown -----------------------------------------------------------

    def _shutdown_workers(self, graceful: bool = True) -> None:
        if _utils is None or _utils.python_exit_status is not False \
                or multiprocessing.util.is_exiting():
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


# What _process_data returns for a batch fetched again after a resume and dropped.
_REPLAYED = object()


# poll() takes milliseconds in a C int: a longer timeout is slept in parts.
_LONGEST_POLL_S = (2**31 - 1) / 1000


def _wait_fds(fds, timeout):
    """multiprocessing.connection.wait(fds, timeout) for any timeout (torch's
    timeout= takes a month; the ring's wait does too)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        part = None if deadline is None else \
            max(0.0, min(deadline - time.monotonic(), _LONGEST_POLL_S))
        fired = wait_fds(fds, part)
        if fired or part is None or part < _LONGEST_POLL_S:
            return fired


def _kind(payload) -> str:
    """A result is a worker's message tuple ("batch", "error", "stop", ...)
    or, for a batch in the ring, the SlotLease of its slot."""
    return payload[0] if type(payload) is tuple else "slot"


def _discard(payload) -> None:
    """Drop a result nobody will see; a slot goes straight back to the ring."""
    if _kind(payload) == "slot":
        payload.release()

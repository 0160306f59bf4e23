"""Epoch planning: starting an epoch (fresh, resumed from a state_dict, or
adopting the next-epoch batches prefetched in the last one), drawing its
indices, and ending it when a worker dies or the loop is interrupted.  A
mixin of ShmLoaderIter (_iterator.py), whose state it shares."""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref

from torch.utils.data.dataloader import _DatasetKind

from ._iter_receive import _discard
from ._iter_state import IterState
from ._next_epoch import PrefetchedEpoch, can_prefetch
from ._pool import WorkerDied
from ._protocol import Resume
from ._resume import Progress, replay_message, sampler_state
from ._seeding import positions_in


class EpochPlanning(IterState):
    """ShmLoaderIter's epochs: see this module's docstring."""

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
            assert self._next_epoch_at is not None  # (set with _prefetched)
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
        self._progress.epoch_begins(
            loader,
            self._epoch,
            self._base_seed,
            self._num_workers,
            sampler_state(loader),
            fresh_workers=first_iter or not self._persistent_workers,
        )
        if started_from is not None:
            self._progress.workers_start_from(
                [started_from.worker_state(i) for i in range(self._num_workers)]
            )
        super()._reset(loader, first_iter)
        self._new_epoch_bookkeeping()
        if resume is not None:
            self._resume_epoch(resume)
        self._send_first_tasks(first_iter, rewind)

    def _new_epoch_bookkeeping(self) -> None:
        """Per-epoch dispatch state, as torch's _reset sets it, and shmloader's."""
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

    def _send_first_tasks(self, first_iter, rewind) -> None:
        """Start the workers on the new epoch (persistent ones: dropping the
        last epoch's leftovers; a ring outgrown made anew), and send the
        first prefetch_factor * num_workers tasks."""
        with self._failing_workers():
            if not first_iter:
                self._resume_workers(rewind)
                grown = self._outgrown()
                if grown is not None:
                    # A batch outgrew the slots: the ring is made anew, now
                    # that no task of an earlier epoch can still write it.
                    self._retire_ring()
                    self._start_ring(grown)
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
        _next_epoch.py).  False when there is nothing to prefetch."""
        if not self._prefetch_next_epoch or self._next_epoch_at is not None:
            return False
        if self._outgrown() is not None:
            return False  # the ring is made anew, larger, as the next epoch starts
        loader = self._loader_ref()
        # Nobody can start another epoch; or the loader let this iterator go
        # (load_state_dict); or a sampler's set_epoch could not be undone after the draws.
        if loader is None or loader._iterator is not self or not can_prefetch(loader):
            return False
        self._next_epoch_at = self._send_idx
        self._epoch = loader._next_epoch()
        self._next_epoch_start = Progress()
        self._next_epoch_start.epoch_begins(
            loader,
            self._epoch,
            self._base_seed,
            self._num_workers,
            sampler_state(loader),
            fresh_workers=False,
        )
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
        shift, prefetched = self._next_epoch_at, self._prefetched
        assert shift is not None and prefetched is not None  # (see _start_epoch)
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
        prefetched.adopt()
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
            self._pool.send(i, Resume.wire(self._shared_seed, rewind))
        pending = self._num_workers
        while pending:
            task_id, payload = self._next_arrival()
            if task_id is None:
                pending -= 1
                self._progress.worker_resumed(payload.worker_id, payload.rng_state)
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

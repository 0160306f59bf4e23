"""The epoch planner: what each epoch of an iterator is (fresh, resumed
from a state_dict, or the next epoch's batches prefetched in the last one),
where its indices come from, and which of its batches a resume has yielded
already.  The iterator (_iterator.py) does the dispatching; this part
decides, and keeps the epoch's progress record (what state_dict() saves)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._features._next_epoch import PrefetchedEpoch, can_prefetch
from .._features._resume import replay_message, sampler_state
from .._features._resume_progress import Progress
from .._worker._seeding import positions_in

if TYPE_CHECKING:
    from .._features._resume import Resume
    from ._dispatch_record import DispatchRecord
    from ._stats import Counters


class EpochPlanner:
    """See this module's docstring."""

    def __init__(
        self,
        *,
        loader: Any,
        resume: Resume | None,
        base_seed: int,
        num_workers: int,
        auto_collation: bool,
        warn: Callable[[str], None],
    ) -> None:
        # prefetch_next_epoch (persistent workers, so the loader holds the
        # iterator): a weak reference, which leaves no cycle to keep dropped
        # loaders' workers alive until the garbage collector runs.
        self._loader_ref = weakref.ref(loader)
        self._prefetch_next_epoch = loader.prefetch_next_epoch
        # Its own record: state_dict() describes the loader's newest iterator.
        self.progress = loader._progress = Progress()
        self._resume = resume  # a loaded state this iterator's first epoch resumes
        self._base_seed = base_seed
        self._num_workers = num_workers
        self._auto_collation = auto_collation
        self._warn = warn
        self.epoch = 0  # its number, for seed_per_sample
        # Per worker, the numbers of its tasks to fetch again and drop (see resume_into).
        self._replay: list[tuple[int, set[int]]] | None = None
        self._skip: set[int] = set()  # epoch indices not to fetch again (in_order=False)
        self._pending_first_draw: Resume | None = None
        self.prefetched: PrefetchedEpoch | None = None  # the next epoch, drawn early
        self._next_epoch_start: Progress | None = None  # and its progress record

    def loader(self) -> Any:
        """The loader, or None once it is gone."""
        return self._loader_ref()

    def samples_in(self, index: Any) -> int:
        return positions_in(index, self._auto_collation)

    # ---- an epoch begins ----------------------------------------------------

    def drop_prefetched(self, counters: Counters, record: DispatchRecord) -> int:
        """The next epoch's batches, prefetched, are not this epoch's (the
        samplers changed since): they are counted as dropped, and their epoch
        is numbered again.  Returns its number, for the workers that fetched
        some to go back to their RNG state from before them."""
        loader, prefetched = self._loader_ref(), self.prefetched
        assert loader is not None and prefetched is not None  # (its iterator's reset)
        assert record.next_epoch_at is not None  # (set with prefetched)
        loader._epochs_started = prefetched.epoch  # numbered again
        counters.dropped_prefetched_batches += record.send_idx - record.next_epoch_at
        return prefetched.epoch

    def begin(self, loader: Any, fresh_workers: bool) -> Resume | None:
        """Number the epoch and start its progress record (before torch's
        _reset runs iter() on the sampler); a resume's sampler is restored
        first.  Returns the resume whose epoch this one finishes, if any."""
        self.prefetched = self._next_epoch_start = None
        resume, self._resume = self._resume, None
        started_from = None  # a finished epoch's state: where the workers start
        if resume is not None and resume.finished:
            # Already applied: the new epoch starts as any other, its workers
            # from the saved states.
            started_from, resume = resume, None
        if resume is not None:
            resume.restore_sampler(loader)
        self.epoch = loader._next_epoch()
        self.progress.epoch_begins(
            loader,
            self.epoch,
            self._base_seed,
            self._num_workers,
            sampler_state(loader),
            fresh_workers=fresh_workers,
        )
        if started_from is not None:
            self.progress.workers_start_from(
                [started_from.worker_state(i) for i in range(self._num_workers)]
            )
        self._replay = None
        return resume

    def resume_into(self, resume: Resume, record: DispatchRecord, next_index: Callable) -> int:
        """Pick up a loaded state's epoch after the batches it had yielded:
        their indices are drawn and passed over (map-style), or the workers'
        datasets resume from their own states, or, for an IterableDataset
        without state_dict, those batches are fetched again and dropped.
        Returns how many batches count as yielded."""
        self.progress.resumed_from(resume)
        if resume.replay:
            if resume.replayed:
                # The batches the interrupted run yielded, known by their
                # worker's task numbers: with in_order=False, neither the
                # first batches to arrive nor those at the same positions.
                self._replay = [(below, set(beyond)) for below, beyond in resume.yielded_by_worker]
                self._warn(replay_message(resume.replayed))
        else:
            self._pending_first_draw = resume
            for drawn in range(resume.skip):
                try:
                    index = next_index()
                except StopIteration:
                    raise resume.sampler_ran_out(drawn) from None
                record.pass_over(self.samples_in(index))
            record.rcvd_idx = record.send_idx
            self._skip = set(resume.skip_beyond)
        return resume.skip + len(resume.skip_beyond)

    # ---- its indices ---------------------------------------------------------

    def first_draw(self, next_index: Callable) -> Any:
        """The sampler's next indices (the first after a resume is drawn as
        the resumed sampler's)."""
        if self._pending_first_draw is not None:
            resume, self._pending_first_draw = self._pending_first_draw, None
            return resume.first_draw(next_index)
        return next_index()

    def draw(self, next_index: Callable) -> Any:
        """The next batch's indices, from this epoch's sampler or, once that
        ran out, the prefetched epoch's."""
        if self.prefetched is not None:
            return self.prefetched.draw(next_index)
        return next_index()

    def yielded_before_resume(self, idx: int) -> bool:
        """in_order=False resume: whether epoch index idx was yielded by the
        interrupted run (drawn then, not fetched again)."""
        if idx in self._skip:
            self._skip.discard(idx)
            return True
        return False

    def replayed(self, worker_id: int, number: int | None) -> bool:
        """Whether a worker's task (by its number) was fetched again only to
        be dropped (resuming an IterableDataset without state)."""
        if self._replay is None:
            return False
        below, beyond = self._replay[worker_id]
        assert number is not None  # (an IterableDataset's tasks are numbered)
        return number < below or number in beyond

    # ---- the next epoch, prefetched -----------------------------------------

    def start_next_epoch(self, iterator: Any, index_sampler: Any) -> Any:
        """prefetch_next_epoch: the sampler ran out; the next epoch's sampler
        goes on (set_epoch(e + 1) where it has one, privately: see
        _next_epoch.py).  Returns its sampler iterator, or None when there
        is nothing to prefetch (the loader is gone, or let `iterator` go
        (load_state_dict), or a sampler's set_epoch could not be undone
        after the draws)."""
        loader = self._loader_ref()
        if (
            not self._prefetch_next_epoch
            or loader is None
            or loader._iterator is not iterator
            or not can_prefetch(loader)
        ):
            return None
        self.epoch = loader._next_epoch()
        self._next_epoch_start = start = Progress()
        start.epoch_begins(
            loader,
            self.epoch,
            self._base_seed,
            self._num_workers,
            sampler_state(loader),
            fresh_workers=False,
        )
        self.progress.next_start = start
        self.prefetched = PrefetchedEpoch(weakref.proxy(loader), self.epoch)
        sampler_iter = iter(())  # failed: the next draws stop at once
        with contextlib.suppress(StopIteration):
            sampler_iter = self.prefetched.draw(lambda: iter(index_sampler))
        return sampler_iter

    def adopt_prefetched(self, counters: Counters) -> None:
        """The prefetched epoch is now the current one."""
        assert self.prefetched is not None and self._next_epoch_start is not None
        self.prefetched.adopt()
        self.progress.begin_like(self._next_epoch_start)
        self.prefetched = self._next_epoch_start = None
        counters.prefetched_epochs += 1

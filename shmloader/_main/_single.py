"""num_workers=0: torch's own single-process iterator, plus the bookkeeping
behind state_dict() (see _resume.py).  Batches are torch's, unchanged, but
for seed_per_sample's seeding of each sample."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from .._features._cuda import DeviceStage
from .._features._resume import replay_message, sampler_state
from .._features._resume_progress import Progress
from .._worker._seeding import Samples, countable, positions_in
from .._worker._state import own_state_copy, restore_worker_rng, worker_snapshot
from .._worker._user_objects import attribute
from ._warn import DeferredWarnings


class SingleProcessIter(_SingleProcessDataLoaderIter):
    # torch draws it as an int64 tensor's .item(), which types say may be a float.
    _base_seed: int

    def __init__(self, loader) -> None:
        self._deferred_warnings = DeferredWarnings(loader._counters)
        resume = loader._take_resume()
        if resume is not None and resume.finished:
            resume = None  # already applied: the new epoch starts as any other
        iterable = loader._dataset_kind == _DatasetKind.Iterable
        self._stateful = (
            loader.dataset
            if iterable and callable(attribute(loader.dataset, "state_dict"))
            else None
        )
        if resume is not None:
            # Before torch's __init__, which makes the sampler's and the
            # dataset's iterators.
            resume.restore_sampler(loader)
            dataset_state = (resume.worker_state(0) or {}).get("dataset")
            if self._stateful is not None and dataset_state is not None:
                self._stateful.load_state_dict(dataset_state)
        epoch_sampler_state = sampler_state(loader)
        # A stream without state_dict() is replayed from the epoch's start on a
        # resume: its draws (a shuffle as it starts, random filtering) come
        # from this process's RNGs, so their state as the epoch begins is saved
        # (as a worker's is), and a replay runs on it.
        replays = iterable and self._stateful is None
        replay_from = resume.main_epoch_start() if resume is not None and replays else None
        users_rngs = None
        if replay_from is not None:
            users_rngs = _process_rngs()
            restore_worker_rng(replay_from)
        epoch_start = (replay_from or worker_snapshot(None)) if replays else None
        rng_before = (
            torch.get_rng_state()
            if resume is not None and loader.generator is None and replay_from is None
            else None
        )
        super().__init__(loader)
        if resume is not None:
            self._base_seed = resume.settle_base_seed(loader, self._base_seed, False, rng_before)
        self._epoch = loader._next_epoch()
        self._begin_epoch(loader, epoch_sampler_state, epoch_start)
        self._device_stage = DeviceStage(loader.device) if loader.device is not None else None
        self._next_idx = 0  # epoch index of the next batch
        self._replay = 0
        self._pending_first_draw = None
        if resume is not None:
            self._resume_epoch(resume, iterable, users_rngs)

    def _begin_epoch(self, loader, epoch_sampler_state, epoch_start) -> None:
        """The epoch's record (what state_dict() saves), and under
        seed_per_sample the fetcher that seeds each sample."""
        # Its own record: state_dict() describes the loader's newest iterator.
        self._progress = loader._progress = Progress()
        # The base seed is saved only where samples are seeded from it.
        self._progress.epoch_begins(
            loader,
            self._epoch,
            self._base_seed if loader.seed_per_sample else None,
            1,
            epoch_sampler_state,
            fresh_workers=False,
            sampler_started=False,
        )
        if epoch_start is not None:
            self._progress.epoch_start_worker_states = [epoch_start]
        if loader.seed_per_sample:
            self._dataset_fetcher = _SeededFetcher(
                Samples(self._dataset, self._auto_collation, self._collate_fn, self._base_seed),
                self._auto_collation,
                self._epoch,
            )

    def _resume_epoch(self, resume, iterable: bool, users_rngs) -> None:
        """Go on from where the resumed state was taken: past the batches
        yielded before it, which a stream replays and a sampler draws again."""
        self._progress.resumed_from(resume)
        self._num_yielded = self._next_idx = resume.skip
        if iterable:
            if resume.replay:
                self._replay = resume.replayed
                self._next_idx = 0
                if self._replay:
                    self._deferred_warnings.warn(replay_message(self._replay))
                if users_rngs is not None:
                    # Now, on the epoch's RNGs, which then go back to the
                    # user's (restored to where they stood after those batches).
                    try:
                        self._replay_yielded()
                    finally:
                        _set_process_rngs(users_rngs)
        else:
            self._pending_first_draw = resume
            for drawn in range(resume.skip):
                try:
                    self._next_index()
                except StopIteration:
                    raise resume.sampler_ran_out(drawn) from None

    def _next_index(self):
        """The next batch's indices; under seed_per_sample, the positions its
        samples take are counted (see _SeededFetcher)."""
        self._progress.sampler_started = True
        if self._pending_first_draw is not None:
            resume, self._pending_first_draw = self._pending_first_draw, None
            index = resume.first_draw(super()._next_index)
        else:
            index = super()._next_index()
        if isinstance(self._dataset_fetcher, _SeededFetcher):
            index = self._dataset_fetcher.drawn(index)
        return index

    def _replay_yielded(self) -> None:
        """Fetch again and drop the batches yielded before the state was taken."""
        while self._replay:
            self._replay -= 1
            self._next_idx += 1
            with contextlib.suppress(Exception):
                super()._next_data()

    def _dataset_state(self):
        if self._stateful is None:
            return None
        # A copy, as a worker's pickled state is (see worker_snapshot).
        return {"dataset": own_state_copy(self._stateful, "the dataset's")}

    def _next_data(self):
        if self._deferred_warnings.errors:
            self._deferred_warnings.raise_first()
        if self._replay:
            # A state without the epoch's starting RNGs: the replay's draws
            # are undone at least (the user restores this process's RNGs to
            # where they stood after those batches).
            with _process_rngs_kept():
                self._replay_yielded()
        idx, self._next_idx = self._next_idx, self._next_idx + 1
        try:
            data = super()._next_data()
        except StopIteration:
            self._progress.epoch_ended()
            raise
        except Exception:
            # A stream goes on after a failed item (torch's fetcher allows it), so the
            # failed batch moves the dataset's state as a good one does.
            self._progress.batch_yielded(idx, 0, self._dataset_state())
            raise
        self._progress.batch_yielded(idx, 0, self._dataset_state())
        if self._device_stage is not None:
            data = self._device_stage(data)
        return data


class _SeededFetcher:
    """seed_per_sample in this process: each sample seeded as a worker seeds
    it (so batches are those of any num_workers), the process's own random
    states put back after each batch."""

    def __init__(self, samples: Samples, auto_collation: bool, epoch: int):
        self._samples = samples
        self._auto_collation = auto_collation
        self._epoch = epoch
        self._position = 0  # epoch position of the first sample of the batch drawn last
        self._next_position = 0

    def drawn(self, index):
        """The batch just drawn (fetched next, or skipped by a resume): the
        sample positions it takes."""
        index = countable(index, self._auto_collation)
        self._position = self._next_position
        self._next_position += positions_in(index, self._auto_collation)
        return index

    def fetch(self, index):
        with _process_rngs_kept():
            return self._samples.batch(index, self._epoch, self._position)


def _process_rngs():
    return random.getstate(), torch.get_rng_state(), np.random.get_state()


def _set_process_rngs(states) -> None:
    random.setstate(states[0])
    torch.set_rng_state(states[1])
    np.random.set_state(states[2])


@contextlib.contextmanager
def _process_rngs_kept():
    """This process's random, torch and numpy RNGs as they were before."""
    states = _process_rngs()
    try:
        yield
    finally:
        _set_process_rngs(states)

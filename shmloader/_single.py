"""num_workers=0: torch's own single-process iterator, plus the bookkeeping
behind state_dict() (see _resume.py).  Batches are torch's, unchanged."""
from __future__ import annotations

import contextlib
import pickle

from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter

from ._cuda import DeviceStage
from ._resume import warn_replay


class SingleProcessIter(_SingleProcessDataLoaderIter):
    def __init__(self, loader) -> None:
        resume = loader._take_resume()
        if resume is not None and resume.state["epoch_finished"]:
            resume = None
        iterable = loader._dataset_kind == _DatasetKind.Iterable
        self._stateful = loader.dataset if iterable and \
            callable(getattr(loader.dataset, "state_dict", None)) else None
        if resume is not None:
            # Before torch's __init__, which makes the sampler's and the
            # dataset's iterators.
            resume.restore_sampler(loader)
            if self._stateful is not None and resume.dataset_states():
                self._stateful.load_state_dict(resume.worker_dataset_state(0))
        super().__init__(loader)
        self._progress = loader._progress
        self._progress.epoch_begins(loader, loader._next_epoch(), None, 1)
        self._device_stage = DeviceStage(loader.device) if loader.device is not None else None
        self._next_idx = 0  # epoch index of the next batch
        self._replay = 0
        self._pending_first_draw = None
        if resume is not None:
            resume.restore_generator(loader)
            self._progress.resumed_from(resume)
            self._num_yielded = self._next_idx = resume.skip
            if iterable:
                if self._stateful is None or not resume.dataset_states():
                    self._replay = resume.skip
                    self._next_idx = 0
                    warn_replay(resume.skip)
            else:
                self._pending_first_draw = resume
                for _ in range(resume.skip):
                    try:
                        self._next_index()
                    except StopIteration:
                        break

    def _next_index(self):
        if self._pending_first_draw is not None:
            resume, self._pending_first_draw = self._pending_first_draw, None
            return resume.first_draw(super()._next_index)
        return super()._next_index()

    def _next_data(self):
        while self._replay:
            self._replay -= 1
            self._next_idx += 1
            with contextlib.suppress(Exception):
                super()._next_data()
        idx, self._next_idx = self._next_idx, self._next_idx + 1
        try:
            data = super()._next_data()
        except StopIteration:
            self._progress.finished = True
            raise
        except Exception:
            self._progress.batch_yielded(idx, 0, None)
            raise
        state = None
        if self._stateful is not None:
            state = pickle.dumps((None, self._stateful.state_dict()), pickle.HIGHEST_PROTOCOL)
        self._progress.batch_yielded(idx, 0, state)
        if self._device_stage is not None:
            data = self._device_stage(data)
        return data

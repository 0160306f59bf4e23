"""What a worker's tasks share: its dataset and fetcher, the collate that
counts samples, the ring as it mapped it, its counters, and the RNG state
its epoch began in; and what every kind of task does alike (begin an epoch,
give a slot back, take the worker's state, word an error).

The tasks themselves: a whole batch (_batch.py), a batch's rows or
the first batch's probe with fetch="sample" (_rows.py).  The loop
that hands them out: _loop.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, _DatasetKind
from torch.utils.data.graph_settings import apply_random_seed

from .._errors import SharedMemoryError
from .._shm._segment import shm_full_message, transport_shm_full_message
from ._arena import SlotCollate
from ._config import WorkerConfig
from ._protocol import Resumed, ResumeWorker
from ._sample_layout import SampleLayout
from ._seeding import Samples
from ._slots import MappedRing, WorkerCounters
from ._state import carries_state, plain_worker_state, restore_worker_rng, worker_snapshot
from ._user_objects import attribute


class CountingCollate:
    """The collate function, remembering how many samples it was last given."""

    def __init__(self, fn):
        self.fn = fn
        self.samples = 0

    def __call__(self, data):
        self.samples = len(data) if isinstance(data, list) else 1
        return self.fn(data)


def reseeded(dataset, shared_seed: int | None):
    """An IterDataPipe's random pipes seeded from the loader's shared seed (a
    new one each epoch of persistent workers), as torch's workers do."""
    if not isinstance(dataset, IterDataPipe):
        return dataset
    assert shared_seed is not None  # the loader draws one for every IterDataPipe
    shared_rng = torch.Generator()
    shared_rng.manual_seed(shared_seed)
    return apply_random_seed(dataset, shared_rng)


class TaskContext:
    """What one worker's tasks share (see the module's note)."""

    def __init__(self, cfg: WorkerConfig, dataset) -> None:
        self.cfg = cfg
        self.dataset = dataset
        self.where = f"in DataLoader worker process {cfg.worker_id}"
        self.slot_collate = SlotCollate() if cfg.slot_collate else None
        self.collate_fn = CountingCollate(self.slot_collate or cfg.collate_fn)
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
        self.counters = WorkerCounters(cfg.worker_id)
        self.mapped: MappedRing | None = None  # once the ring has come
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

    def resume(self, msg: ResumeWorker) -> tuple:
        """A new epoch of persistent workers: a new fetcher, on the RNG states
        the old epoch's last tasks left.  Returns the Resumed reply."""
        self.iteration_end = False
        self.rewind(msg.rewind)
        self.dataset = reseeded(self.dataset, msg.shared_seed)
        try:
            self.fetcher, self.fetcher_error = self._make_fetcher(), None
        except Exception:
            self.fetcher, self.fetcher_error = None, ExceptionWrapper(where=self.where)
        # With the RNG states the old epoch's last tasks left (a new
        # epoch's dataset state starts afresh): where this epoch begins.
        return Resumed.wire(self.cfg.worker_id, worker_snapshot(None) if self.snapshots else None)

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
            self.mapped.ring.abandon(slot)

    def snapshot(self):
        """worker_snapshot() where batches carry the worker's state, else None."""
        return worker_snapshot(self.stateful) if self.snapshots else None

    def batch_error(self, error: Exception):
        """The ExceptionWrapper of a batch's error.  torch's failure to
        allocate shared memory (its collate's in a worker, or its transport's)
        in /dev/shm says what to change; it stays a RuntimeError, as torch's."""
        if not (
            isinstance(error, RuntimeError) and "unable to allocate shared memory" in str(error)
        ):
            return ExceptionWrapper(where=self.where)
        return self._shm_error(transport_shm_full_message(str(error)), error)

    def shm_full(self, cause: OSError):
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

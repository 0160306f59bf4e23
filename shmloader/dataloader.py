"""shmloader.DataLoader: torch's DataLoader with a shared-memory slot ring."""

from __future__ import annotations

import contextvars
import copy
import inspect
import numbers
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np
import torch.utils.data
from torch.utils.data import Dataset, Sampler, _DatasetKind
from torch.utils.data._utils.collate import default_collate

from ._errors import RingBypassedWarning, ShmloaderWarning
from ._features._cuda import check_device
from ._features._foreign_state import foreign_state
from ._features._rebuild import options
from ._features._resume import Resume
from ._features._resume_check import check_state
from ._features._resume_progress import Progress, state_dict
from ._main._iterator import IterableShmLoaderIter, ShmLoaderIter
from ._main._open_files import check_num_workers
from ._main._pool import reap_leaving
from ._main._ring_memory import RingHandover
from ._main._single import SingleProcessIter
from ._main._spare import SpareWorkers
from ._main._stats import Counters, LoaderStats
from ._main._warn import check_workers_as_torch, warn
from ._shm._ring import MAX_SLOTS
from ._worker._arena import changed_collation

# Set while shmloader.integrations.accelerate prepares a loader: Accelerate's
# own preparation then goes on, and shmloader puts its loader back inside the
# result (NOTE [accelerate]).
preparing_for_ring: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "preparing_for_ring", default=False
)


def _positive_int(name, value, upper=None):
    """`value` as a Python int (numpy's integers accepted, as torch accepts them for
    num_workers), or None; anything else is a clear error."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} should be a positive int or None, but got {name}={value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} should be at most {upper}, but got {name}={value!r}")
    return int(value)


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} should be True or False, but got {name}={value!r}")
    return value


def _fetched_one_by_one(dataset) -> bool:
    """Whether dataset[i] for each index of a batch is what torch's fetcher
    gets: it calls __getitems__ with the whole batch where a dataset has one,
    and torch's Subset and StackDataset only pass the batch on to datasets of
    theirs that have one."""
    if not getattr(dataset, "__getitems__", None):
        return True
    if type(dataset) is torch.utils.data.Subset:
        return _fetched_one_by_one(dataset.dataset)
    if type(dataset) is torch.utils.data.StackDataset:
        inner = dataset.datasets
        return all(map(_fetched_one_by_one, inner.values() if isinstance(inner, dict) else inner))
    return False


def _check_fetch(loader, fetch, assignment):
    if fetch not in ("batch", "sample"):
        raise ValueError(f"fetch should be 'batch' or 'sample', but got fetch={fetch!r}")
    if assignment not in (None, "interleaved", "dynamic"):
        raise ValueError(
            f"assignment should be 'interleaved' or 'dynamic', but got assignment={assignment!r}"
        )
    if fetch == "batch":
        if assignment is not None:
            raise ValueError(
                f"assignment={assignment!r} decides which worker fetches which sample and "
                "applies to fetch='sample' only; with fetch='batch' workers take whole batches "
                "in turn, as in torch."
            )
        return
    if loader._dataset_kind == _DatasetKind.Iterable:
        raise ValueError(
            "fetch='sample' needs a map-style dataset (samples fetched by index); an "
            "IterableDataset's samples come from its iterator in each worker. Use "
            "fetch='batch'."
        )
    if not loader._auto_collation:
        raise ValueError(
            "fetch='sample' assembles batches from samples, but batch_size=None turns off "
            "batching; use fetch='batch'."
        )
    if not _fetched_one_by_one(loader.dataset):
        raise ValueError(
            "fetch='sample' fetches each sample with dataset[i], but this dataset defines "
            "__getitems__, which torch's DataLoader calls with a whole batch instead, so the "
            "batches could differ. Use fetch='batch'."
        )
    if loader.collate_fn is not default_collate:
        raise ValueError(
            "fetch='sample' writes each sample straight into its row of the batch, which is "
            "what the default collate_fn does; a custom collate_fn needs the whole batch at "
            "once. Use fetch='batch' with it, or drop collate_fn."
        )
    changed = changed_collation()
    if changed is not None:
        raise ValueError(
            "fetch='sample' writes each sample straight into its row of the batch, as torch's "
            "own default collation does, but torch.utils.data._utils.collate."
            f"default_collate_fn_map was changed ({changed}), so default_collate batches "
            "otherwise. Use fetch='batch'."
        )


def _check_map_style(loader):
    for name in ("seed_per_sample", "prefetch_next_epoch"):
        if getattr(loader, name) and loader._dataset_kind == _DatasetKind.Iterable:
            raise ValueError(
                f"{name}=True needs a map-style dataset (samples at known positions of a "
                "sampler); an IterableDataset's samples come from its iterator in each worker."
            )
    if (
        loader.seed_per_sample
        and loader._auto_collation
        and not _fetched_one_by_one(loader.dataset)
    ):
        raise ValueError(
            "seed_per_sample=True seeds and fetches each sample with dataset[i], but this "
            "dataset defines __getitems__, which torch's DataLoader calls with a whole batch "
            "instead, so the batches could differ. Drop seed_per_sample, or __getitems__."
        )
    if loader.prefetch_next_epoch and not (loader.persistent_workers and loader.num_workers > 0):
        raise ValueError(
            "prefetch_next_epoch=True needs persistent_workers=True (and num_workers > 0): "
            "the workers that prefetch the next epoch must outlive this one."
        )


# Generic like torch's (DataLoader[Tensor] in annotations and subclasses).
_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[_T_co]):
    """Drop-in replacement for torch.utils.data.DataLoader.

    Takes exactly torch's arguments, with torch's defaults and checks, and
    yields the same batches in the same order.  With num_workers > 0, workers
    write batches into a ring of shared-memory slots and the batches you get
    are views of those slots (no tensor byte is pickled); a slot is reused
    only once every tensor viewing it is gone.  num_workers=0 is torch's own
    single-process path.

    Options beyond torch's (keyword-only):
        slot_bytes: bytes of batch per slot (each slot also keeps 16 KiB
            for the worker's state, and is rounded up to a page).  Default
            None: sized from the first batch (its size plus 1/16 and 64 KiB;
            the first prefetch_factor * num_workers + 1 batches travel
            outside the ring meanwhile, each in a memfd segment of its own), and made larger when the next epoch
            starts if a batch did not fit.  A batch larger than its slot is
            still delivered whole, in a memfd segment of its own (a "spill").
        num_slots: slots in the ring.  Default prefetch_factor * num_workers
            + 4: the batches in flight, the one being yielded, the one your
            loop still holds and two more you may keep.  Keep more batches
            alive than that and the extra ones travel outside the ring
            (one warning); the ring never has more slots.
        fetch: "batch" (default, torch's way: each worker builds whole
            batches) or "sample": every worker fetches single samples and
            writes each straight into its row of a shared batch slot, so all
            workers work on batch 0 and one slow sample holds up one row, not
            a worker's whole batch.  Needs a map-style dataset, automatic
            batching and the default collate; the first sample fixes each
            field's shape and dtype, and a sample that differs is an error
            naming the field.  Batches and their order are fetch="batch"'s.
        assignment: fetch="sample" only.  "interleaved" (default): sample j
            of the epoch goes to worker j % num_workers.  "dynamic": each
            idle worker takes the next unfetched sample (for uneven costs).
        seed_per_sample: seed random, torch and numpy before every sample
            from (base seed, epoch, sample position), so random augmentations
            are the same whatever num_workers, fetch or assignment is.
            Needs a map-style dataset (and uses __getitem__ per sample, never
            __getitems__).  With num_workers=0 the main process's random
            states are put back after each batch.
        prefetch_next_epoch: with persistent_workers, start filling free
            slots with epoch e + 1 (calling sampler.set_epoch(e + 1) where the
            sampler has it) as soon as epoch e's sampler runs out, so the next
            iter() yields at once.  If, by that iter(), the sampler or the
            generator changed (set_epoch with another value, a reseeded
            generator), the prefetched batches are dropped and fetched again.
        device: None (default): batches stay on the CPU, as torch's.  A
            device ("cuda", torch.device("cuda:1"), ...): the loader copies
            each batch there itself (for CUDA on a side stream, from the
            ring's memory pinned once) and yields tensors that are safe to
            use on the stream current at that moment.  "cpu" changes nothing.

    pin_memory=True with CUDA pins the ring's memory once instead of copying
    every batch into pinned memory; a slot is reused only after the copies
    reading it (non_blocking ones included) have finished.
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[_T_co]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        fetch: str = "batch",
        assignment: str | None = None,
        seed_per_sample: bool = False,
        prefetch_next_epoch: bool = False,
        device: torch.device | str | int | None = None,
    ) -> None:
        # Plain attributes, as torch's arguments are: code that rebuilds a
        # loader from its attributes (Lightning, say) keeps them.
        self.slot_bytes = _positive_int("slot_bytes", slot_bytes, upper=2**62)
        self.num_slots = _positive_int("num_slots", num_slots, upper=MAX_SLOTS)
        self._ring_handover = RingHandover()
        self._spare_workers = SpareWorkers()
        self._retire_ring_when_gone()
        self._counters = Counters()
        self._epochs_started = 0
        self._progress = Progress()
        self._resume: Resume | None = None  # a loaded state, for the next iterator
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.fetch = fetch
        self.assignment = assignment
        self.seed_per_sample = seed_per_sample
        self.prefetch_next_epoch = prefetch_next_epoch
        self.device: Any = device  # a torch.device once checked (see _check_options)
        self._check_options()
        self._warn_if_ring_too_small()

    def _options(self) -> tuple:
        """shmloader's options as an iterator is made with them, each in one
        form (None and the value it stands for alike)."""
        assignment = (self.assignment or "interleaved") if self.fetch == "sample" else None
        device = None if self.device is not None and self.device.type == "cpu" else self.device
        return (
            self.slot_bytes,
            self.num_slots,
            self.fetch,
            assignment,
            self.seed_per_sample,
            self.prefetch_next_epoch,
            device,
        )

    def _check_options(self) -> None:
        """shmloader's options, at construction and again at each iter():
        they, and torch's attributes they depend on (collate_fn, say), may be
        set in between, as torch's may."""
        self.slot_bytes = _positive_int("slot_bytes", self.slot_bytes, upper=2**62)
        self.num_slots = _positive_int("num_slots", self.num_slots, upper=MAX_SLOTS)
        _check_fetch(self, self.fetch, self.assignment)
        _check_flag("seed_per_sample", self.seed_per_sample)
        _check_flag("prefetch_next_epoch", self.prefetch_next_epoch)
        self.device = check_device(self.device)
        _check_map_style(self)
        check_num_workers(self.num_workers)  # under the open-files limit

    def _retire_ring_when_gone(self) -> None:
        # A batch kept after its loader is gone keeps its own slot's memory,
        # not the whole ring's; its spare workers exit (at interpreter exit
        # everything goes anyway: multiprocessing ends daemon processes).
        weakref.finalize(self, self._ring_handover.retire_spare_ring).atexit = False
        weakref.finalize(self, self._spare_workers.stop).atexit = False
        # (and the workers its last epoch left, once they have exited: see WorkerPool.leave_idle)
        weakref.finalize(self, reap_leaving, True).atexit = False

    def __setstate__(self, state):
        # A copy (pickle, deepcopy, copy.copy, a spawned process's) starts
        # without a ring, and counts and resumes apart from the original
        # (copy.copy hands over the original's objects themselves; a live
        # persistent iterator it shares counts for whichever loader last
        # started an epoch on it, see ShmLoaderIter._start_epoch).
        self.__dict__.update(state)
        self._ring_handover = copy.deepcopy(self._ring_handover)
        self._spare_workers = SpareWorkers()
        self._counters = copy.deepcopy(self._counters)
        self._progress = copy.deepcopy(self._progress)
        self._retire_ring_when_gone()

    def _next_epoch(self) -> int:
        """Number the epoch an iterator starts (0, 1, ...): seed_per_sample's epoch."""
        self._epochs_started += 1
        return self._epochs_started - 1

    def _warn_if_ring_too_small(self):
        if self.num_slots is None or self.num_workers == 0:  # no ring without workers
            return
        in_flight = self.prefetch_factor * self.num_workers
        if self.num_slots < in_flight + 2:
            warnings.warn(
                f"num_slots={self.num_slots} cannot hold the "
                f"prefetch_factor * num_workers = {in_flight} batches in flight plus the one "
                "being yielded and the one your loop holds: some batches will travel by torch's "
                f"(slower) transport. Use num_slots >= {in_flight + 2}, or leave it None.",
                ShmloaderWarning,
                stacklevel=3,
            )

    def _take_resume(self):
        resume, self._resume = self._resume, None
        return resume

    def state_dict(self) -> dict:
        """Where this loader stands, as torchdata's StatefulDataLoader.state_dict():
        after k batches of an epoch, a new loader given this state (via
        load_state_dict, before iter()) yields batch k + 1 onwards of that
        epoch, then the following epochs, as an uninterrupted run would.
        A plain dict of ints, bools, bytes, lists and tensors (torch.save
        keeps it).  Costs no round trip to the workers."""
        if self._resume is not None:
            return self._resume.state  # loaded and not yet used
        return state_dict(self, self._progress)

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from a state_dict() of a loader over the same dataset with
        the same batching (else ValueError); call it before iter().  A
        persistent iterator already running goes on with its epoch, no longer
        this loader's (as in torchdata's StatefulDataLoader)."""
        if isinstance(state_dict, dict) and "version" not in state_dict:
            state_dict = foreign_state(self, state_dict)  # torchdata's, where it carries over
        state = check_state(self, state_dict)
        # A persistent iterator is let go, as torchdata's StatefulDataLoader
        # does: the next iter() starts afresh, while one still in use goes on
        # with its workers (until it is dropped) and no longer counts here.
        self._iterator = None
        self._resume = Resume(self, state)
        self._progress = Progress()
        self._epochs_started = state["epoch"]

    def _get_iterator(self):
        if self.num_workers == 0:
            return SingleProcessIter(self)
        check_workers_as_torch(self.check_worker_number_rationality)
        if self._dataset_kind == _DatasetKind.Iterable:
            return IterableShmLoaderIter(self)
        return ShmLoaderIter(self)

    def __iter__(self):
        # A persistent iterator whose workers failed (a worker died), that a
        # forked child inherited (its workers are the parent's), or made with
        # options since changed (its workers and ring were made with them)
        # starts over with fresh workers instead of being reset.
        # (A subclass's _get_iterator may return another kind of iterator.)
        self._check_options()
        if isinstance(self._iterator, ShmLoaderIter) and (
            self._iterator._shutdown
            or self._iterator._owner_pid != os.getpid()
            or self._iterator._made_with != self._options()
        ):
            self._iterator._shutdown_workers()  # (a no-op for the first two)
            prefetched = self._iterator._epochs.prefetched
            if prefetched is not None:  # its next epoch, numbered already, is drawn anew
                self._epochs_started = prefetched.epoch
            self._iterator = None
        return super().__iter__()

    def stats(self) -> LoaderStats:
        """Counters of this loader's iterators so far (see LoaderStats)."""
        return self._counters.snapshot()

    # NOTE [accelerate]: Accelerate's prepare() replaces a loader with its
    # DataLoaderShard around a *torch* DataLoader built from the loader's
    # torch arguments, so a shmloader loader handed to it would silently lose
    # the ring and its options.  The first thing Accelerator.prepare_data_loader
    # reads of a loader is `_is_accelerate_prepared` (whether it was prepared
    # already).  Read by Accelerate's own code (not by a tool that lists every
    # attribute, inspect.getmembers say) outside
    # shmloader.integrations.accelerate, it says the user took the plain path:
    # they are told, once per loader, the one line to change.
    # shmloader.integrations.accelerate lets the preparation run and puts a
    # shmloader loader back in place of the torch one (same arguments, same
    # options), so Accelerate's sharding, device placement, gradient state and
    # save_state() are its own.
    @property
    def _is_accelerate_prepared(self) -> bool:
        reader = sys._getframe(1).f_globals.get("__name__", "")
        if (
            reader.partition(".")[0] == "accelerate"
            and not preparing_for_ring.get()
            and not self.__dict__.get("_told_ring_bypassed")
        ):
            self.__dict__["_told_ring_bypassed"] = True
            defaults = inspect.signature(DataLoader.__init__).parameters
            changed = [
                f"{name}={value!r}"
                for name, value in options(self).items()
                if value != defaults[name].default
            ]
            lost = f" and its options ({', '.join(changed)}) are dropped" if changed else ""
            warn(
                "accelerator.prepare() rebuilds this shmloader DataLoader as Accelerate's "
                "DataLoaderShard around a torch DataLoader: its batches will not travel "
                f"through shmloader's ring{lost}. To keep them, prepare it with "
                "`loader = shmloader.integrations.accelerate.prepare_data_loader("
                "accelerator, loader)` (see shmloader's docs/integrations.md).",
                RingBypassedWarning,
                also_past=tuple(
                    p + os.sep for p in getattr(sys.modules.get("accelerate"), "__path__", ())
                ),
            )
        return self.__dict__.get("_accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = value

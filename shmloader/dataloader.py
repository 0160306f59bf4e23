"""shmloader.DataLoader: torch's DataLoader with a shared-memory slot ring."""
from __future__ import annotations

import warnings

import torch.utils.data

from ._iterator import ShmLoaderIter
from ._ring import MAX_SLOTS
from ._rings import RingOptions
from ._stats import Counters, LoaderStats


def _check_positive_int(name, value, upper=None):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} should be a positive int or None, but got {name}={value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} should be at most {upper}, but got {name}={value!r}")


class DataLoader(torch.utils.data.DataLoader):
    """Drop-in replacement for torch.utils.data.DataLoader.

    Takes exactly torch's arguments, with torch's defaults and checks, and
    yields the same batches in the same order.  With num_workers > 0, workers
    write batches into a ring of shared-memory slots and the batches you get
    are views of those slots (no tensor byte is pickled); a slot is reused
    only once every tensor viewing it is gone.  num_workers=0 is torch's own
    single-process path.

    Options beyond torch's (keyword-only):
        slot_bytes: bytes per slot.  Default None: sized from the first batch
            (its size plus 25% and 64 KiB); the first prefetch_factor *
            num_workers batches then travel by torch's transport.  A batch
            larger than its slot is still delivered whole (a "spill").
        num_slots: slots in the ring.  Default prefetch_factor * num_workers
            + 4: the batches in flight, the one being yielded, the one your
            loop still holds and two more you may keep.  Keep more batches
            alive than that and the extra ones travel by torch's transport
            (one warning); ring memory is capped at num_slots * slot_bytes.
    """

    def __init__(
        self,
        dataset,
        batch_size=1,
        shuffle=None,
        sampler=None,
        batch_sampler=None,
        num_workers=0,
        collate_fn=None,
        pin_memory=False,
        drop_last=False,
        timeout=0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor=None,
        persistent_workers=False,
        pin_memory_device="",
        in_order=True,
        slot_bytes=None,
        num_slots=None,
    ):
        _check_positive_int("slot_bytes", slot_bytes, upper=2**62)
        _check_positive_int("num_slots", num_slots, upper=MAX_SLOTS)
        self._shm_options = RingOptions(slot_bytes, num_slots)
        self._counters = Counters()
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
        self._warn_if_ring_too_small()

    def _warn_if_ring_too_small(self):
        in_flight = self.prefetch_factor * self.num_workers if self.num_workers else 0
        if self._shm_options.num_slots is not None and self._shm_options.num_slots < in_flight + 2:
            warnings.warn(
                f"num_slots={self._shm_options.num_slots} cannot hold the "
                f"prefetch_factor * num_workers = {in_flight} batches in flight plus the one "
                "being yielded and the one your loop holds: some batches will travel by torch's "
                f"(slower) transport. Use num_slots >= {in_flight + 2}, or leave it None.",
                stacklevel=3,
            )

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        return ShmLoaderIter(self)

    def __iter__(self):
        # A persistent iterator whose workers failed (a worker died) starts
        # over with fresh workers instead of being reset.
        if self._iterator is not None and self._iterator._shutdown:
            self._iterator = None
        return super().__iter__()

    def stats(self) -> LoaderStats:
        """Counters of this loader's iterators so far (see LoaderStats)."""
        return self._counters.snapshot()

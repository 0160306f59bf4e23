"""The iterator's ring: where it comes from (the loader's spare ring, or a
new one sized from the first batch or the user's slot_bytes, checked
against memory), how it is handed to the workers, how a task claims a slot
of it, and when its slots grow for the next epoch.  A mixin of
ShmLoaderIter (_iterator.py), whose state it shares."""

from __future__ import annotations

from typing import cast

import torch

from . import _cuda, _torch_api
from ._iter_receive import _kind
from ._iter_state import IterState
from ._protocol import MEASURE, NO_SLOT, Probe, UseLayout
from ._resume import STATE_BYTES, carries_state
from ._ring import MAX_SLOTS
from ._ring_memory import create_ring, retire, slots_that_fit, smaller_ring_message

# Slots beyond the prefetch_factor * num_workers batches in flight: the batch
# being yielded, the one the loop still holds, and two a user may keep (the
# last batch of a previous loop, one kept for logging) before any batch has
# to travel outside the ring (see _one_off.py).
SPARE_SLOTS = 4
# A new ring's slots are reserved as workers first write them; the rest of it
# after this many batches from it: not while the first batch is on its way,
# nor for a loader dropped after one batch.
RESERVE_REST_AFTER = 2


class RingKeeping(IterState):
    """ShmLoaderIter's ring: see this module's docstring."""

    def _init_ring(self, loader) -> None:
        """The ring's options, and the loader's spare ring where one is known."""
        self._slot_bytes = loader.slot_bytes
        self._sized_by_user = loader.num_slots is not None
        # Capped at what a ring can hold: tasks in flight beyond it travel
        # outside the ring (with the ring-full warning).
        self._nslots = loader.num_slots or min(
            self._prefetch_factor * self._num_workers + SPARE_SLOTS, MAX_SLOTS
        )
        device = loader.device
        self._device_stage = _cuda.DeviceStage(device) if device is not None else None
        # Pin the ring itself (once) where batches go to a CUDA device.
        self._register = torch.cuda.is_available() and (
            _torch_api.pins_to_cuda(self) or (device is not None and device.type == "cuda")
        )
        self._registered = False
        # Slot room beyond the batch's own for the worker state it carries.
        self._state_bytes = (
            STATE_BYTES if carries_state(self._dataset_kind, loader.seed_per_sample) else 0
        )
        slot_bytes = self._known_slot_bytes()
        if slot_bytes:
            # Before the workers are forked: a spare ring not taken is gone
            # then, not mapped on in them (its memory held) as they run.
            self._open_ring(slot_bytes)

    def _known_slot_bytes(self) -> int | None:
        """The slot size a ring can be made with before any batch of this
        iterator: fetch="sample"'s layout, the user's, or the one learned."""
        learned = self._handover.learned_slot_bytes
        if self._fetch == "sample":
            # (learned: a longer batch than the layout's spilled.)
            layout = self._handover.sample_layout
            return max(layout.slot_bytes, learned or 0) if layout is not None else None
        return self._slot_bytes or learned

    def _outgrown(self) -> int | None:
        """Where a batch did not fit this iterator's ring's slots (with
        slot_bytes=None), the larger slot size a ring made now would have
        (see _reset); else None."""
        ring, wanted = self._ring, self._known_slot_bytes()
        if ring is None or wanted is None or ring.slot_bytes >= wanted + self._state_bytes:
            return None
        return wanted

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
                    self._warn(
                        f"shmloader: could not pin the ring's memory with CUDA ({failure}); "
                        "batches are pinned by torch's copy instead.",
                        "warned_register",
                    )
        self._pool.send_ring(self._ring)
        if self._fetch == "sample":
            self._pool.broadcast(UseLayout.wire(self._handover.sample_layout))
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
                    self._warn(
                        smaller_ring_message(fit, self._nslots, slot_bytes, room),
                        "warned_smaller_ring",
                    )
        return create_ring(nslots, slot_bytes)  # (its error names the sizes)

    def _retire_ring(self) -> None:
        """This persistent iterator's ring is made anew (batches the loop
        keeps keep their slots)."""
        ring, self._ring = self._ring, None
        assert ring is not None  # (called for an outgrown ring)
        self._counters.use_ring(None, self._num_workers)
        retire(ring)

    def _learn_layout(self, task_id, index, epoch, position):
        """fetch="sample": every worker starts on its share of this batch's
        samples; the one with its first sample describes the layout it
        fixes, and the ring is made from it while the others go on fetching.
        Returns None, or the first sample's error (which becomes this
        batch's result)."""
        capacity = self._batch_size or len(index)
        self._pool.broadcast(Probe.wire(task_id, index, epoch, position, capacity))
        earlier = []  # results of tasks sent before this one (an empty batch's)
        while True:
            arrived, payload = self._next_arrival()
            if arrived == task_id:
                break
            earlier.append((arrived, payload))
        self._arrivals.extendleft(reversed(earlier))
        if _kind(payload) == "error":
            return payload
        layout = payload.layout
        if self._slot_bytes is not None and self._slot_bytes < layout.slot_bytes:
            raise ValueError(
                f"slot_bytes={self._slot_bytes} is too small for fetch='sample' "
                f"batches of {capacity} samples of {layout.sample_bytes} bytes each: "
                f"{layout.slot_bytes} bytes are needed. Pass slot_bytes >= {layout.slot_bytes}, "
                "or leave it None."
            )
        self._handover.sample_layout = layout
        self._start_ring(layout.slot_bytes)
        return None

    def _claim_slot(self) -> int:
        if self._ring is None:
            return MEASURE
        if self._registered:
            # Slots whose copies are done (the hook is register()'s Fences).
            cast(_cuda.Fences, self._ring.release_hook).reclaim(self._ring)
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
                "it.",
                "warned_ring_full",
            )
        return NO_SLOT

    def _grow_for(self, learned: int) -> None:
        """A batch outgrew this iterator's ring: its slots grow to `learned`
        bytes at the next epoch, where a ring of those fits in memory in this
        one's place."""
        ring = self._ring
        assert ring is not None  # (only a batch sent to a ring outgrows it)
        if learned > (self._handover.learned_slot_bytes or 0):
            fit, _ = slots_that_fit(learned + self._state_bytes, replacing=ring)
            if fit >= ring.nslots:
                self._handover.learned_slot_bytes = learned

"""The ring keeper: one iterator's ring, where it comes from (the loader's
spare ring, or a new one sized from the first batch or the user's
slot_bytes, checked against memory), how it is handed to the workers and
pinned, how a task claims a slot of it, when the rest of it is reserved, when
its slots grow for the next epoch, and where it goes when the workers are
gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from .._features import _cuda
from .._shm._ring import MAX_SLOTS, Ring
from .._worker._protocol import MEASURE, NO_SLOT, UseLayout
from ._ring_memory import (
    RingHandover,
    create_ring,
    reserve_in_background,
    retire,
    slots_that_fit,
    smaller_ring_message,
    smaller_ring_slots,
)

if TYPE_CHECKING:
    from ._pool import WorkerPool
    from ._stats import Counters

# Slots beyond the prefetch_factor * num_workers batches in flight: the batch
# being yielded, the one the loop still holds, and two a user may keep (the
# last batch of a previous loop, one kept for logging) before any batch has
# to travel outside the ring (see _one_off.py).
SPARE_SLOTS = 4
# A new ring's slots are reserved as workers first write them; the rest of it
# after this many batches from it: not while the first batch is on its way,
# nor for a loader dropped after one batch.
RESERVE_REST_AFTER = 2


class RingKeeper:
    """One iterator's ring: see this module's docstring.  `ring` is None
    until a slot size is known (the first batch measures it)."""

    def __init__(
        self,
        *,
        handover: RingHandover,
        counters: Counters,
        warn: Callable[[str, str], None],
        num_workers: int,
        prefetch_factor: int,
        fetch: str,
        slot_bytes: int | None,
        num_slots: int | None,
        state_bytes: int,
        register: bool,
    ) -> None:
        self.handover = handover  # the loader's: spare ring, learned slot size, layout
        self.counters = counters  # the loader's (a copy.copy of it may take over)
        self._warn = warn
        self._num_workers = num_workers
        self._in_flight = prefetch_factor * num_workers
        self._fetch = fetch
        self.slot_bytes = slot_bytes  # the user's
        self._sized_by_user = num_slots is not None
        # Capped at what a ring can hold: tasks in flight beyond it travel
        # outside the ring (with the ring-full warning).
        self._nslots = num_slots or min(self._in_flight + SPARE_SLOTS, MAX_SLOTS)
        # The fewest slots a default ring short of memory is made with: the
        # batches in flight, the one being yielded and the one the loop holds.
        self._least = None if self._sized_by_user else min(self._in_flight + 2, self._nslots)
        # Slot room beyond the batch's own for the worker state a batch carries.
        self.state_bytes = state_bytes
        self._register = register  # pin the ring (once): batches go to a CUDA device
        self.registered = False
        self.ring: Ring | None = None
        self._reserve_rest_in = 0  # batches until the rest of a new ring is reserved
        slot_bytes = self.known_slot_bytes()
        if slot_bytes:
            # Before the workers are forked: a spare ring not taken is gone
            # then, not mapped on in them (its memory held) as they run.
            self._open(slot_bytes)

    def known_slot_bytes(self) -> int | None:
        """The slot size a ring can be made with before any batch of this
        iterator: fetch="sample"'s layout, the user's, or the one learned."""
        learned = self.handover.learned_slot_bytes
        if self._fetch == "sample":
            # (learned: a longer batch than the layout's spilled.)
            layout = self.handover.sample_layout
            return max(layout.slot_bytes, learned or 0) if layout is not None else None
        return self.slot_bytes or learned

    def outgrown(self) -> int | None:
        """Where a batch did not fit this ring's slots (with slot_bytes=None),
        the larger slot size a ring made now would have; else None."""
        ring, wanted = self.ring, self.known_slot_bytes()
        if ring is None or wanted is None or ring.slot_bytes >= wanted + self.state_bytes:
            return None
        return wanted

    def batch_room(self) -> int:
        """Bytes of a slot that a batch may fill."""
        assert self.ring is not None
        return self.ring.slot_bytes - self.state_bytes

    def start(self, slot_bytes: int, pool: WorkerPool) -> None:
        self._open(slot_bytes)
        self.attach(pool)

    def _open(self, slot_bytes: int) -> None:
        """The loader's spare ring where it fits, else a new one."""
        slot_bytes = max(slot_bytes, self.slot_bytes or 0) + self.state_bytes
        self.ring = self.handover.take_spare_ring(self._nslots, slot_bytes, self._least)
        if self.ring is None:
            # The stats stop reading the loader's last ring, so that its memory
            # is gone before this one is measured out and made.
            self.counters.use_ring(None, self._num_workers)
            self.ring = self._create(slot_bytes)
            self._reserve_rest_in = RESERVE_REST_AFTER

    def attach(self, pool: WorkerPool) -> None:
        """Hand the ring to the workers, and count from it."""
        if self.ring is None:
            return
        if self._register:
            self.registered = self.ring.release_hook is not None
            if not self.registered:
                failure = _cuda.register(self.ring)
                self.registered = failure is None
                if failure is not None and not self.counters.warned_register:
                    self.counters.warned_register = True
                    self._warn(
                        f"shmloader: could not pin the ring's memory with CUDA ({failure}); "
                        "batches are pinned by torch's copy instead.",
                        "warned_register",
                    )
        pool.send_ring(self.ring)
        if self._fetch == "sample":
            pool.broadcast(UseLayout.wire(self.handover.sample_layout))
        self.counters.use_ring(self.ring, self._num_workers)

    def _create(self, slot_bytes: int) -> Ring:
        """A new ring, checked against the memory this process can get.  With
        the default num_slots, a ring that does not fit is made smaller, down
        to the batches in flight, the one being yielded and the one the loop
        holds; below that, or with a num_slots the user chose, it is a
        SharedMemoryError naming the bytes needed and available."""
        nslots = self._nslots
        if self._least is not None:
            smaller = smaller_ring_slots(nslots, self._least, slot_bytes)
            if smaller is not None:
                nslots, room = smaller
                if not self.counters.warned_smaller_ring:
                    self.counters.warned_smaller_ring = True
                    self._warn(
                        smaller_ring_message(nslots, self._nslots, slot_bytes, room),
                        "warned_smaller_ring",
                    )
        return create_ring(nslots, slot_bytes)  # (its error names the sizes)

    def retire(self) -> None:
        """The ring is made anew (batches the loop keeps keep their slots)."""
        ring, self.ring = self.ring, None
        assert ring is not None  # (called for an outgrown ring)
        self.counters.use_ring(None, self._num_workers)
        retire(ring)

    def hand_back(
        self, loader_alive: bool, writers_gone: Callable[[], object] | None = None
    ) -> None:
        """Every worker is gone, or told to go (`writers_gone` waits until
        they are): the ring goes back to the loader for its next iterator
        (batches the user holds keep their slots), or, when the loader is
        gone, keeps only the slots those batches hold."""
        if self.ring is not None:
            if loader_alive:
                self.handover.keep_spare_ring(self.ring, writers_gone)
            else:
                if writers_gone is not None:
                    writers_gone()
                retire(self.ring)
            self.ring = None

    def claim(self) -> int:
        """A free slot for a task, or MEASURE (no ring yet: the batch is
        measured), or NO_SLOT (every slot in use)."""
        if self.ring is None:
            return MEASURE
        if self.registered:
            # Slots whose copies are done (the hook is register()'s Fences).
            cast(_cuda.Fences, self.ring.release_hook).reclaim(self.ring)
        slot = self.ring.claim()
        if slot is not None:
            return slot
        # (A ring made smaller for want of room said so: batches beyond it are
        # expected there, and not the loop's doing.)
        if not self.counters.warned_ring_full and self.ring.nslots == self._nslots:
            self.counters.warned_ring_full = True
            self._warn(
                f"shmloader: all {self.ring.nslots} ring slots are in use (batches still "
                "referenced by your code, plus those in flight); further batches travel in "
                "shared memory of their own, made for each (slower), until slots are "
                "released. Any tensor kept from a batch (a mask collected for a metric) holds "
                "its batch's whole slot: keep a .clone() of it instead. The ring stays at "
                f"{self.ring.total_bytes} bytes; pass num_slots= to keep more batches in "
                "it.",
                "warned_ring_full",
            )
        return NO_SLOT

    def delivered_from_slot(self) -> None:
        """A batch came from a slot: after the first few of a new ring, the
        rest of its memory is reserved, in the background."""
        if self._reserve_rest_in:
            self._reserve_rest_in -= 1
            if not self._reserve_rest_in:
                assert self.ring is not None  # (a batch came from it)
                reserve_in_background(self.ring)

    def measured(self, needed: int) -> None:
        """A worker measured a batch at `needed` bytes (only with
        slot_bytes=None, see WorkerConfig).  The first batch sizes the ring,
        with headroom for batches that vary a little; the ring is made at the
        next next() call, so that its prefaulting does not delay this batch;
        until then the largest batch that arrived counts (a later batch may
        arrive before the first one, and be smaller).  A batch that does not
        fit the ring made since (it spilled, or was sent before the ring was
        made) makes the slots larger when the next epoch starts, where memory
        holds all of them (else an outsized batch would cost the ring, not
        just itself)."""
        learned = needed + needed // 16 + 65536
        if self.ring is None:
            if learned > (self.handover.learned_slot_bytes or 0):
                self.handover.learned_slot_bytes = learned
        elif needed > self.batch_room() and learned > (self.handover.learned_slot_bytes or 0):
            fit, _ = slots_that_fit(learned + self.state_bytes, replacing=self.ring)
            if fit >= self.ring.nslots:
                self.handover.learned_slot_bytes = learned

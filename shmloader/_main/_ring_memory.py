"""Where a loader's rings come from: creation in memfd memory, with a clear
error when memory is short, and reuse from one iterator of a loader to the next.
The main side's: the segment itself, which workers make too, is _segment.py's
(NOTE [segment: both sides])."""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import SharedMemoryError
from .._shm import _memory
from .._shm._ring import CLAIMED, Ring
from .._shm._segment import new_segment, ring_bytes_message
from .._worker._sample_layout import SampleLayout
from . import _fork
from ._open_files import too_many_open_files

# Optional cap, in bytes, on one ring's shared memory: a ring that would be
# larger fails at start.
LIMIT_ENV = "SHMLOADER_SHM_LIMIT"


def _limit_bytes() -> int | None:
    limit = os.environ.get(LIMIT_ENV)
    if not limit:
        return None
    try:
        limit_bytes = int(limit)
    except ValueError:
        limit_bytes = -1
    if limit_bytes < 0:
        raise ValueError(f"{LIMIT_ENV} should be a number of bytes (0 or more), but is {limit!r}")
    return limit_bytes


def _slot_pages_bytes(slot_bytes: int) -> int:
    page = os.sysconf("SC_PAGESIZE")
    return -(-slot_bytes // page) * page


# Room left beside a ring's slots for its header (slot descriptors, worker
# counters), rounded up generously.
_HEADER_ROOM = 1 << 20


def slots_that_fit(slot_bytes: int, replacing: Ring | None = None) -> tuple[int, str]:
    """(how many slots of `slot_bytes` the memory this process can get now
    holds, under SHMLOADER_SHM_LIMIT; that room in words).  `replacing`: a
    ring to be retired first, whose memory counts as free."""
    free, room = _memory.available()
    if replacing is not None:
        free += replacing.total_bytes
    slot = _slot_pages_bytes(slot_bytes)
    fit = max(0, free - _HEADER_ROOM) // slot
    limit_bytes = _limit_bytes()
    if limit_bytes is not None and limit_bytes // slot < fit:
        fit = limit_bytes // slot
        room = f"{LIMIT_ENV}={limit_bytes} caps a ring at that many bytes (raise or unset it)"
    return fit, room


def smaller_ring_slots(
    nslots: int, least: int, slot_bytes: int, replacing: Ring | None = None
) -> tuple[int, str] | None:
    """Where the memory this process can get (see slots_that_fit) holds
    fewer than a default ring's `nslots` slots of `slot_bytes` but at least
    `least`: (how many it holds, that room in words), the size of the
    smaller ring made instead; else None (all of them fit, or too few:
    create_ring's error)."""
    fit, room = slots_that_fit(slot_bytes, replacing)
    return (fit, room) if least <= fit < nslots else None


def smaller_ring_message(fit: int, nslots: int, slot_bytes: int, room: str) -> str:
    """What a loader says when its default ring of `nslots` did not fit in
    memory and it works on with `fit` slots."""
    return (
        f"shmloader: {room}, for {nslots} slots of {slot_bytes} bytes: its ring has {fit} "
        "of them, and batches beyond them travel in shared memory of their own when every "
        "slot is held. num_slots= sets the ring's size (a ring that then does not fit is an error)."
    )


def create_ring(nslots: int, slot_bytes: int) -> Ring:
    """A new ring that no one else can open and nothing can leave behind:
    it lives only in the fds the workers receive.  SharedMemoryError where
    the memory this process can get does not hold it; OSError (EMFILE) with
    the limit and what to do where its two files do not fit."""
    fit, room = slots_that_fit(slot_bytes)
    if fit < nslots:
        raise SharedMemoryError(ring_bytes_message(nslots, slot_bytes, room))
    try:
        ring = new_segment(nslots, slot_bytes)
    except OSError as e:
        if e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        doing = f"making the ring of shared memory ({nslots} x {slot_bytes} bytes)"
        raise OSError(e.errno, too_many_open_files(doing)) from e
    _fork.track(ring)
    return ring


def reserve_in_background(ring: Ring) -> None:
    """Reserve the slots no worker has written yet, in a thread (the GIL is
    released while it runs), so that the whole ring holds its memory soon
    after the first batches, not only as slots are first used: a loader made
    later then sees what this one takes.  A slot that cannot be reserved now
    is left to its first writer, which reports it (SharedMemoryError)."""

    def reserve():
        try:
            ring.reserve_all()
        except OSError:
            pass

    thread = threading.Thread(target=reserve, name="shmloader-reserve", daemon=True)
    _reserving[ring] = thread
    thread.start()


# Rings whose reservation thread may still run (retire waits for it: its
# pages would come back after the retirement dropped them).
_reserving: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(eq=False)  # (one per loader: compared by identity)
class RingHandover:
    """What a loader's iterators pass on to the next one: the slot size
    learned from the first batch, fetch="sample"'s layout, and a ring whose
    workers have exited (so a new epoch does not prefault a new one)."""

    learned_slot_bytes: int | None = None
    sample_layout: SampleLayout | None = None  # fetch="sample", once probed
    spare_ring: Ring | None = None
    # Waits until the workers of the iterator that gave the spare ring back
    # are gone (they may still give back a slot): before it is settled.
    _writers_gone: Callable[[], object] | None = None

    def __getstate__(self):
        # A copy of the loader (pickle, deepcopy) makes a ring of its own.
        return {**self.__dict__, "spare_ring": None, "_writers_gone": None}

    def _spare_settled(self) -> Ring | None:
        """The spare ring, taken from the handover, its workers gone and
        what they left freed."""
        ring, self.spare_ring = self.spare_ring, None
        writers_gone, self._writers_gone = self._writers_gone, None
        if ring is not None and ring.owned_here:
            if writers_gone is not None:
                writers_gone()
            _settle(ring)
        return ring

    def take_spare_ring(
        self, nslots: int, slot_bytes: int, least: int | None = None
    ) -> Ring | None:
        """The spare ring, where it has `nslots` slots of `slot_bytes` or
        more; else None (it is retired).  `least`: `nslots` is the default
        size, which a ring short of memory may have fewer slots than, down to
        `least` (see smaller_ring_slots): a spare ring made smaller so is
        taken too while memory still falls short of the default size and
        holds it (else each iterator would retire it and make the same)."""
        ring = self._spare_settled()
        # (Never a forked child's copy: its workers would write the parent's slots.)
        if ring is not None and ring.owned_here and ring.slot_bytes >= slot_bytes:
            if ring.nslots == nslots:
                return ring
            if least is not None and least <= ring.nslots < nslots:
                smaller = smaller_ring_slots(nslots, least, slot_bytes, replacing=ring)
                if smaller is not None and ring.nslots <= smaller[0]:
                    return ring
        if ring is not None:
            retire(ring)  # (batches kept from it keep their slots only)
        return None

    def keep_spare_ring(self, ring: Ring, writers_gone: Callable[[], object] | None) -> None:
        """Take back the ring of an iterator whose workers have exited, or
        are told to and may not have yet: `writers_gone` waits until they
        are, before the ring is settled (taken or retired).  Where the
        loader has a spare ring already (two of its iterators were alive at
        once), it keeps the better of the two and retires the other."""
        other = self._spare_settled()
        if other is None:
            self.spare_ring, self._writers_gone = ring, writers_gone
            return
        if writers_gone is not None:
            writers_gone()
        _settle(ring)
        kept = ring
        if _spare_rank(other) > _spare_rank(ring):
            kept, other = other, ring
        self.spare_ring = kept
        retire(other)  # (batches kept from it keep their slots only)

    def retire_spare_ring(self) -> None:
        """The loader is gone: its spare ring keeps only the memory of the
        slots batches still hold."""
        ring = self._spare_settled()
        if ring is not None:
            retire(ring)


def _spare_rank(ring: Ring) -> tuple[bool, int, int]:
    """Of two spare rings, the loader keeps the one of higher rank: one its
    next iterator may take (this process's, larger slots: the slot size
    learned only grows), then the one whose slots the user's batches hold
    most of (those slots keep their memory either way, while the retired
    ring's free slots give theirs back)."""
    return ring.owned_here, ring.slot_bytes, ring.nslots - ring.count_free()


def _settle(ring: Ring) -> None:
    """Free what exited workers left in `ring`: slots they claimed but never
    filled, and batches published but never taken."""
    for slot in range(ring.nslots):
        if ring.slot_state(slot) == CLAIMED:
            ring.abandon(slot)
    while (lease := ring.acquire()) is not None:
        lease.release()


def retire(ring: Ring) -> None:
    """A ring no loader will use again: only the slots batches the user keeps
    still hold keep their pages (see Ring.retire)."""
    if not ring.owned_here:
        return  # a forked child's copy of a loader: the slots are its parent's
    thread = _reserving.pop(ring, None)
    if thread is not None:
        thread.join()
    _settle(ring)
    ring.retire()

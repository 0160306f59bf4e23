"""Where a loader's rings come from: creation, with a clear error when shared
memory is short, and reuse from one iterator of a loader to the next."""
from __future__ import annotations

import errno
import os
import resource
import secrets
import threading
import weakref
from dataclasses import dataclass

from . import _fork
from ._ring import CLAIMED, Ring
from ._samples import SampleLayout

SHM_DIR = "/dev/shm"
# Optional cap, in bytes, on one ring's shared memory: a ring that would be
# larger fails at start exactly as on a /dev/shm of that size.
LIMIT_ENV = "SHMLOADER_SHM_LIMIT"


class SharedMemoryError(RuntimeError):
    """The ring does not fit in shared memory."""


# What to do about shared memory that is short, in every such message.
_SHM_ADVICE = (f"Enlarge {SHM_DIR} (docker: --shm-size) or free space in it, or lower "
               "num_slots, slot_bytes or the batch size.")


def _free_room() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return f"{SHM_DIR} cannot be inspected"
    return f"{st.f_bavail * st.f_frsize} bytes are free in {SHM_DIR}"


def _ring_bytes_message(nslots, slot_bytes, short) -> str:
    """`short`: what the room falls short of, in words."""
    return (
        f"shmloader needs {nslots * slot_bytes} bytes of shared memory for its ring "
        f"({nslots} slots x {slot_bytes} bytes) but {short}. {_SHM_ADVICE}"
    )


def address_space_limit() -> str:
    """This process's address-space limit, in words."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return f"RLIMIT_AS, `ulimit -v`: {limit} here"


def shm_full_message(cause: str) -> str:
    """What to do when a slot's pages cannot be reserved on its first use
    (/dev/shm had room for the ring when it was made, but no longer)."""
    return (
        f"shmloader could not reserve a ring slot's shared memory ({cause}): {SHM_DIR} "
        "filled up after the ring was made, so this batch is lost (torch's transport, which "
        f"needs {SHM_DIR} too, fails such batches as well). {_SHM_ADVICE}")


def transport_shm_full_message(cause: str, ring_bytes: int) -> str:
    """What to do when torch's shared memory (its collate's in a worker, or its
    transport's) finds no room in /dev/shm beside a ring that keeps its own."""
    return (
        f"torch could not allocate shared memory for this batch ({cause}): {SHM_DIR} is full, "
        f"and shmloader's ring keeps {ring_bytes} bytes of it for its slots. Enlarge {SHM_DIR} "
        "(docker: --shm-size). Batches that go through the ring need no room beyond it: pass "
        "slot_bytes= of at least your largest batch's bytes, keep clones rather than views of "
        "batch tensors you collect (a kept view holds its slot), or pass a smaller num_slots= "
        "to leave more room for the rest.")


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


def _check_limit(nslots: int, slot_bytes: int) -> None:
    limit_bytes = _limit_bytes()
    if limit_bytes is not None and nslots * _slot_pages_bytes(slot_bytes) > limit_bytes:
        raise SharedMemoryError(_ring_bytes_message(
            nslots, slot_bytes,
            f"{LIMIT_ENV}={limit_bytes} caps a ring at {limit_bytes} bytes (raise or unset it)"))


# Room left beside a ring's slots for its header (slot descriptors, worker
# counters), rounded up generously.
_HEADER_ROOM = 1 << 20


def slots_with_room(nslots: int, slot_bytes: int, replacing: Ring | None = None,
                    keep_free: int = 0) -> tuple[int, str]:
    """(how many of `nslots` slots of `slot_bytes` fit in the shared memory
    free now, and under SHMLOADER_SHM_LIMIT; that room in words).  All of
    them where /dev/shm cannot be inspected (making the ring then says).
    `replacing`: a ring to be retired first, whose room counts as free;
    `keep_free`: bytes of /dev/shm to leave beside the ring."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        return nslots, f"{SHM_DIR} cannot be inspected ({e.strerror})"
    promised = _promised(but=replacing)  # (made by other loaders, not all reserved yet)
    free = st.f_bavail * st.f_frsize - promised
    if replacing is not None:
        free += replacing.total_bytes - _unreserved(replacing)
    slot = _slot_pages_bytes(slot_bytes)
    fit = max(0, free - _HEADER_ROOM - keep_free) // slot
    room = f"{SHM_DIR} has {free} bytes free" + (
        f" beside the {promised} bytes other rings of this process will take" if promised else "")
    limit_bytes = _limit_bytes()
    if limit_bytes is not None and limit_bytes // slot < fit:
        fit = limit_bytes // slot
        room = f"{LIMIT_ENV}={limit_bytes} caps a ring at that many bytes"
    return min(nslots, fit), room


def _unreserved(ring: Ring) -> int:
    try:
        return max(0, ring.total_bytes - os.fstat(ring.fds[0]).st_blocks * 512)
    except (OSError, IndexError):
        return 0


def _promised(but=None) -> int:
    """Bytes this process's live rings (but `but`) will still reserve: room
    that statvfs shows free, but is theirs (rings are reserved lazily)."""
    return sum(_unreserved(ring) for ring in _fork.tracked_rings()
               if ring is not but and ring.owned_here and ring not in _retired)


def room_for_the_rest(ring: Ring) -> bool:
    """Whether /dev/shm has room for the slots of `ring` (a spare one, or a
    persistent iterator's) not reserved yet: their room was checked when it
    was made, not since."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return True
    return _unreserved(ring) <= st.f_bavail * st.f_frsize - _promised(but=ring)


def make_room_for_the_rest(ring: Ring) -> bool:
    """room_for_the_rest(ring), taking back the room of idle rings first
    where it is short (see release_idle_rings)."""
    if room_for_the_rest(ring):
        return True
    release_idle_rings()
    return room_for_the_rest(ring)


def idle_rings_crowd_shm() -> bool:
    """Whether rings idle between their loaders' epochs hold more of /dev/shm
    than is left free: a loader about to send batches by torch's transport
    (sizing its ring) should have their room then."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    idle = sum(holder.idle_ring_bytes() for holder in list(_idle_rings))
    return idle > st.f_bavail * st.f_frsize - _promised()


def short_room_message(fit: int, nslots: int, slot_bytes: int, room: str) -> str:
    """What a loader says when its default ring of `nslots` did not fit: it
    works on with `fit` slots, or none, the rest of its batches by torch's
    transport."""
    others = sum(ring.total_bytes for ring in _fork.tracked_rings() if ring.owned_here)
    held = (f"; rings of this process's other shmloader loaders, mid-epoch or holding "
            f"batches you keep, take up to {others} bytes of it") if others else ""
    ring = (f"its ring has {fit} of its {nslots} slots, and the batches beyond them travel"
            if fit else "too little for a ring beside the batches in flight, so batches travel")
    return (
        f"shmloader: {room}{held}, for slots of {slot_bytes} bytes: "
        f"{ring} by torch's transport, as all of torch's DataLoader's do (slower). Enlarge "
        f"{SHM_DIR} (docker: --shm-size) or free space in it for the whole ring; num_slots= "
        "sets the ring's size (a ring that then does not fit is an error).")


def create_ring(nslots: int, slot_bytes: int) -> Ring:
    """A new, prefaulted ring that no one else can open and nothing can leave
    behind in /dev/shm: it lives only in the fds the workers receive."""
    _check_limit(nslots, slot_bytes)
    ring = _create(nslots, slot_bytes)
    _fork.track(ring)
    return ring


def _create(nslots: int, slot_bytes: int) -> Ring:
    try:
        try:
            return Ring.create_in(SHM_DIR, nslots, slot_bytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        # No O_TMPFILE on this tmpfs: a fresh unguessable name, unlinked at once.
        for _ in range(8):
            name = f"/shmloader-{os.getpid()}-{secrets.token_hex(12)}"
            try:
                return Ring.create_named(name, nslots, slot_bytes)
            except FileExistsError:
                continue  # someone holds that name: never attach to it, pick another
        raise FileExistsError(errno.EEXIST, f"no free shared-memory name after 8 tries ({name})")
    except OSError as e:
        if e.errno == errno.ENOMEM and resource.getrlimit(resource.RLIMIT_AS)[0] != \
                resource.RLIM_INFINITY:
            raise SharedMemoryError(
                f"shmloader could not map its ring of {nslots * slot_bytes} bytes ({nslots} "
                f"slots x {slot_bytes} bytes): no address space was left for it "
                f"({address_space_limit()}). Raise that limit, or lower num_slots, slot_bytes "
                "or the batch size.") from e
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EOVERFLOW):
            raise SharedMemoryError(_ring_bytes_message(
                nslots, slot_bytes, f"{_free_room()} ({e.strerror})")) from e
        raise


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
# Rings retired: their dropped slots are not reserved again.
_retired: weakref.WeakSet = weakref.WeakSet()


# What holds a ring no batch is on its way to (a handover's spare ring; a
# persistent iterator between epochs), each with give_back_ring(): memory a
# loader short of room may take back.
_idle_rings: weakref.WeakSet = weakref.WeakSet()


def idle_ring_held_by(holder) -> None:
    """`holder`'s ring is idle until it uses it again (see release_idle_rings)."""
    _idle_rings.add(holder)


def ring_in_use_by(holder) -> None:
    _idle_rings.discard(holder)


@dataclass(eq=False)  # (kept in a WeakSet: hashed by identity)
class RingHandover:
    """What a loader's iterators pass on to the next one: the slot size
    learned from the first batch, fetch="sample"'s layout, and a ring whose
    workers have exited (so a new epoch does not prefault a new one)."""

    learned_slot_bytes: int | None = None
    largest_batch_bytes: int = 0  # of the batches measured (see ShmLoaderIter._grow_for)
    sample_layout: SampleLayout | None = None  # fetch="sample", once probed
    spare_ring: Ring | None = None

    def __getstate__(self):
        # A copy of the loader (pickle, deepcopy) makes a ring of its own.
        return {**self.__dict__, "spare_ring": None}

    def take_spare_ring(self, nslots: int, slot_bytes: int) -> Ring | None:
        ring, self.spare_ring = self.spare_ring, None
        # (Never a forked child's copy: its workers would write the parent's slots.)
        if ring is not None and ring.owned_here and ring.nslots == nslots \
                and ring.slot_bytes >= slot_bytes:
            return ring
        if ring is not None:
            retire(ring)  # (batches kept from it keep their slots only)
        return None

    def keep_spare_ring(self, ring: Ring) -> None:
        """Take back the ring of an iterator whose workers have all exited."""
        _settle(ring)
        self.spare_ring = ring
        idle_ring_held_by(self)

    def give_back_ring(self) -> None:
        self.retire_spare_ring()

    def idle_ring_bytes(self) -> int:
        return self.spare_ring.total_bytes if self.spare_ring is not None else 0

    def retire_spare_ring(self) -> None:
        """The loader is gone: its spare ring keeps only the memory of the
        slots batches still hold."""
        ring, self.spare_ring = self.spare_ring, None
        if ring is not None:
            retire(ring)


def release_idle_rings() -> None:
    """Give back the memory of every ring of this process that sits idle
    between its loader's epochs (where torch's loader keeps nothing): for a
    loader short of room.  Their loaders make new rings when they next
    iterate."""
    for holder in list(_idle_rings):
        _idle_rings.discard(holder)
        holder.give_back_ring()


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
    _retired.add(ring)

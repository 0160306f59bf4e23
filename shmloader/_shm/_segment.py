"""A segment of shared memory, for a ring or for sealed bytes (a
SharedList's entries, the workers' pickled dataset): made in memfd memory
(or in /dev/shm where memfd_create is refused), and what to say when memory
runs out, for a ring, for one batch, or for those bytes.

NOTE [segment: both sides]
Both sides make segments: the main process its rings (_ring_memory.py), a
worker the one-off segment of a batch that travels outside the ring
(_one_off.py); and a worker words the SharedMemoryError of a batch whose
memory ran out.  So this module imports nothing of the main side's: the
rest of _ring_memory.py (a loader's rings, kept safe across forks by
_fork.py, which warns through _warn.py) stays there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import resource

from .._errors import SharedMemoryError
from . import _memory, _poison
from ._ring import Ring

SHM_DIR = "/dev/shm"  # only where memfd_create is refused (see new_segment)


# What to do about memory that is short, in every such message.
_ADVICE = (
    "Lower num_slots, slot_bytes or the batch size, or give the process more memory "
    "(a container's memory limit, docker: --memory)."
)


def ring_bytes_message(nslots, slot_bytes, short) -> str:
    """`short`: what the room falls short of, in words."""
    return (
        f"shmloader needs {nslots * slot_bytes} bytes of shared memory for its ring "
        f"({nslots} slots x {slot_bytes} bytes) but {short}. {_ADVICE}"
    )


def address_space_limit() -> str:
    """This process's address-space limit, in words."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return f"RLIMIT_AS, `ulimit -v`: {limit} here"


def shm_full_message(cause: str) -> str:
    """What to do when a batch's pages (a slot's on its first use, or a
    one-off segment's) cannot be reserved."""
    return (
        f"shmloader could not reserve shared memory for this batch ({cause}): memory ran out "
        "(the machine's or the memory cgroup's), so this batch is lost. " + _ADVICE
    )


def transport_shm_full_message(cause: str) -> str:
    """What to do when torch's shared memory (its collate's in a worker, or its
    transport's, which live in /dev/shm) finds no room there."""
    return (
        f"torch could not allocate shared memory for this batch ({cause}): {SHM_DIR} is full. "
        "shmloader's ring does not use it, but batches that do not go through the ring do: "
        "pass slot_bytes= of at least your largest batch's bytes, keep clones rather than "
        "views of batch tensors you collect (a kept view holds its slot), or enlarge "
        f"{SHM_DIR} (docker: --shm-size)."
    )


# Why rings live in /dev/shm instead of memfd memory in this process, or None.
_memfd_refused: str | None = None


def ring_memory() -> str:
    """Where this process's rings live, in one line (for stats())."""
    if _memfd_refused is None:
        return "memfd (anonymous shared memory, limited by memory alone)"
    return f"{SHM_DIR} (memfd_create refused: {_memfd_refused}): limited by its size"


def new_segment(nslots: int, slot_bytes: int) -> Ring:
    """A ring's segment in memfd memory, or in /dev/shm where memfd_create is
    refused; SharedMemoryError where memory (or /dev/shm) is short.  In poison
    mode its slots are overwritten as they are released (_poison.py)."""
    return _poison.arm(_new_segment(nslots, slot_bytes))


def _new_segment(nslots: int, slot_bytes: int) -> Ring:
    global _memfd_refused
    try:
        if _memfd_refused is None:
            try:
                return Ring.create_memfd("shmloader-ring", nslots, slot_bytes)
            except OSError as e:
                # An old kernel (ENOSYS) or a seccomp filter (EPERM, ENOSYS):
                # /dev/shm from now on, as torch's shared memory.
                if e.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL):
                    raise
                _memfd_refused = e.strerror or str(e)
        return Ring.create_in(SHM_DIR, nslots, slot_bytes)
    except OSError as e:
        if (
            e.errno == errno.ENOMEM
            and resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
        ):
            raise SharedMemoryError(
                f"shmloader could not map its ring of {nslots * slot_bytes} bytes ({nslots} "
                f"slots x {slot_bytes} bytes): no address space was left for it "
                f"({address_space_limit()}). Raise that limit, or lower num_slots, slot_bytes "
                "or the batch size."
            ) from e
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EOVERFLOW):
            raise SharedMemoryError(
                ring_bytes_message(nslots, slot_bytes, f"{_memory.available()[1]} ({e.strerror})")
            ) from e
        raise


# ---- a sealed segment of bytes (SharedList's entries, the workers' dataset) ----


def new_sealable_segment(name: str) -> int:
    """A new memfd, or where memfd_create is refused (an old kernel, a seccomp
    filter) an unnamed file in /dev/shm, as for the ring: either way its
    memory is held only by fds and mappings, and goes with the last one."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES, errno.EINVAL):
            raise
    return os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)


def write_segment(fd: int, what: str, data, position: int) -> None:
    """Write all of `data` at `position`; a SharedMemoryError naming `what`
    where memory runs out."""
    view = memoryview(data).cast("B")
    while view:
        try:
            done = os.pwrite(fd, view, position)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise SharedMemoryError(
                f"{what} ran out of shared memory ({e.strerror}) after writing {position} "
                f"bytes of its segment: {_memory.available()[1]}. Free memory, or give the process "
                "more (a container's memory limit, docker: --memory; where memfd_create is "
                f"refused, the size of {SHM_DIR})."
            ) from e
        view = view[done:]
        position += done


def seal_segment(fd: int) -> None:
    """No process can change the segment from now on: its readers may trust
    it.  (A memfd only: a file in /dev/shm cannot be sealed.)"""
    seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EINVAL):
            raise

"""Batches that do not travel in a ring slot, each in a memfd segment of its own.

A batch that comes before the ring is sized, outgrows its slot, or comes while
the user holds every slot would otherwise go by torch's transport, whose
shared memory lives in /dev/shm: a container's 64 MB fails there (Docker's,
Kubernetes' default).  Instead the worker writes the batch, laid out as in a
slot (_layout), into a one-slot ring made for it in memfd memory, and sends
the segment's fds after its pipe message (SCM_RIGHTS, as the ring's own fds
go to the workers).  The main process maps it and takes its slot's lease: the
batch's tensors view the mapping, which lives as long as they do, exactly as
a slot lease does, and is unmapped when the last of them is gone (in poison
mode, overwritten first: NOTE [poison: who writes the pattern]).  Its fds
are closed at once, so kept batches hold no fd.  Only leaves that cannot live
in shared memory at all (sparse, CUDA, arbitrary objects) still go by torch's
pickling, inside the metadata, as from a slot.
"""

from __future__ import annotations

import errno
import os
import socket
from multiprocessing.reduction import recvfds, sendfds

import torch

from .._shm import _layout, _poison
from .._shm._ring import Ring
from .._shm._segment import new_segment
from ._arena import Arena


def write(task_id: int, data, samples: int, state, nbytes: int, reserve: int, owns=None) -> Ring:
    """A one-slot segment of `nbytes` (+ `reserve` for the worker's state)
    holding `data`, published as task `task_id`.  OSError when its memory
    cannot be reserved; SlotFull or the batch's own pickling error when it
    does not fit or cannot be laid out."""
    segment = new_segment(1, nbytes + reserve)
    segment.reserve(0)  # all of it now: no SIGBUS for want of memory while writing
    slot = segment.claim()
    assert slot is not None  # a new segment's one slot is free
    memory = segment.memory(slot)
    arena = Arena(
        memory, torch.frombuffer(memory, dtype=torch.uint8).untyped_storage(), reserve=reserve
    )
    meta_off, meta_len = arena.write_meta(
        _layout.dumps(data, arena.place_all, samples, state, owns)
    )
    segment.publish(slot, task_id, meta_off, meta_len)
    return segment


def send(conn, message: tuple, segment: Ring) -> None:
    """`message` on the worker's result pipe, the segment's fds after it."""
    conn.send(message)
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
        sendfds(s, list(segment.fds))


def receive(conn):
    """The SlotLease of the segment whose fds follow the message just read
    from `conn` (the main process's end of a worker's result pipe)."""
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            fds = recvfds(s, 2)
    except (RuntimeError, AssertionError) as e:
        # multiprocessing's words for fds the kernel dropped: no room for them
        raise OSError(errno.EMFILE, f"receiving a batch's shared memory: {e}") from e
    try:
        segment = Ring.attach(*fds)  # (checks owner, mode and header; keeps copies)
    finally:
        for fd in fds:
            os.close(fd)
    segment.close_fds()  # the mapping stays
    return _poison.arm_one_off(segment).acquire()

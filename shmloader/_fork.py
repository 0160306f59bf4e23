"""Batches held across a fork of the training process.

Torch's batches live in shared memory that stays theirs: a child forked while
the parent holds a batch (a multiprocessing 'fork' Process, another loader's
workers) keeps seeing it, whatever the parent does next.  A slot is reused as
soon as the parent's views of it are gone, so before any fork the parent
swaps the slots it holds for private copies at the same addresses; the child
inherits those, and each slot is mapped back when the parent releases it.

A loader forking its own workers skips the copies of its own ring's slots: its
workers write that ring, they do not read what the parent holds of it, and the
copies would delay every epoch's start (the last batch of the previous epoch is
usually still held).  Other rings' held slots are copied: another loader's
batches may be what this loader's dataset reads.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref

from ._warn import warn

_consumer_rings: weakref.WeakSet = weakref.WeakSet()
_forking = threading.local()  # .own_ring: the ring of the loader this thread forks workers of
_NOT_FORKING_WORKERS = object()


def track(ring) -> None:
    """Keep `ring`'s held slots safe across this process's forks."""
    _consumer_rings.add(ring)


@contextlib.contextmanager
def forking_own_workers(own_ring):
    """Forks in this block start the workers of the loader whose ring is
    `own_ring` (None before it has one)."""
    _forking.own_ring = own_ring
    try:
        yield
    finally:
        _forking.own_ring = _NOT_FORKING_WORKERS


def _before_fork() -> None:
    own_ring = getattr(_forking, "own_ring", _NOT_FORKING_WORKERS)
    for ring in list(_consumer_rings):
        if ring is own_ring:
            continue
        try:
            ring.privatize_held()
        except OSError as e:
            warn(f"shmloader: could not copy the batches this process holds before it forked "
                 f"({e}); the child may see their memory reused by later batches.")


os.register_at_fork(before=_before_fork)

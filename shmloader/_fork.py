"""Batches held across a fork of the training process.

Torch's batches live in shared memory that stays theirs: a child forked while
the parent holds a batch (a multiprocessing 'fork' Process, another loader's
workers) keeps seeing it, whatever the parent does next.  A slot is reused as
soon as the parent's views of it are gone, so before any fork the parent
swaps the slots it holds for private copies at the same addresses; the child
inherits those, and each slot is mapped back when the parent releases it.

shmloader's own workers never read the batches their parent holds, so forking
them skips the copies (they would delay every epoch's start).
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref

from ._warn import warn

_consumer_rings: weakref.WeakSet = weakref.WeakSet()
_forking = threading.local()  # .own_workers: this thread is starting shmloader's workers


def track(ring) -> None:
    """Keep `ring`'s held slots safe across this process's forks."""
    _consumer_rings.add(ring)


@contextlib.contextmanager
def forking_own_workers():
    _forking.own_workers = True
    try:
        yield
    finally:
        _forking.own_workers = False


def _before_fork() -> None:
    if getattr(_forking, "own_workers", False):
        return
    for ring in list(_consumer_rings):
        try:
            ring.privatize_held()
        except OSError as e:
            warn(f"shmloader: could not copy the batches this process holds before it forked "
                 f"({e}); the child may see their memory reused by later batches.")


os.register_at_fork(before=_before_fork)

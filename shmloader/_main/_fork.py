"""Batches held across a fork of the training process.

Torch's batches live in shared memory that stays theirs: a child forked while
the parent holds a batch (a multiprocessing 'fork' Process, a loader's workers
whose dataset keeps earlier batches) keeps seeing it, whatever the parent does
next.  A slot is reused as soon as the parent's views of it are gone, so before
any fork the parent swaps the slots it holds for private copies at the same
addresses; the child inherits those, and each slot is mapped back when the
parent releases it.  A slot is copied once however many forks follow (a
non-persistent loader's next epoch forks all its workers while the loop's
variable still holds the previous epoch's last batch: one copy).
"""

from __future__ import annotations

import os
import weakref

from ._warn import warn

_consumer_rings: weakref.WeakSet = weakref.WeakSet()


def track(ring) -> None:
    """Keep `ring`'s held slots safe across this process's forks."""
    _consumer_rings.add(ring)


def tracked_rings() -> list:
    """The rings of this process still alive (made here or inherited)."""
    return list(_consumer_rings)


def _before_fork() -> None:
    for ring in tracked_rings():
        try:
            ring.privatize_held()
        except OSError as e:
            warn(
                f"shmloader: could not copy the batches this process holds before it forked "
                f"({e}); the child may see their memory reused by later batches."
            )


os.register_at_fork(before=_before_fork)

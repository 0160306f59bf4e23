"""Poison mode (SHMLOADER_DEBUG_POISON=1), a debugging aid: every slot, and
every one-off segment, is overwritten with PATTERN the moment its lease is
released, before any worker may claim it again, so that memory a batch's
views no longer hold reads as the pattern, never as a later batch
([reliability](../../docs/reliability.md#poison-mode)).

NOTE [poison: who writes the pattern]
The pattern is written by the main process's handle of the ring (C, in
shmring_release: the data bytes, then FREE with release order), and only
there: workers never release a slot their main process read.  A ring's
slots are overwritten in the shared pages, which is what a worker writes
next; a forked child that inherited a held batch has a private copy of its
slot by then (_main/_fork.py).  A one-off segment is never written again,
but a forked child may still map its pages and keep that batch, so only
this process's view of it is overwritten (fresh private memory filled with
the pattern), and the last few released stay mapped (QUARANTINE) so that a
leaked raw pointer reads the pattern rather than whatever is mapped there
next.
The variable is read when a ring or one-off segment is made.
"""

from __future__ import annotations

import collections
import functools
import os
import weakref

from ._ring import Ring

ENV = "SHMLOADER_DEBUG_POISON"

# 0xA5 in every byte: as float32 -2.87e-16, float64 -2.50e-127, float16
# -0.0220, int32 -1515870811, int64 -6510615555426900571, uint8 165; not a
# zeroed page's bytes, nor (in every byte) a likely batch's.
PATTERN = 0xA5

# One-off segments whose view poison mode keeps mapped after their release:
# the last QUARANTINE released, fewer where they hold more than
# QUARANTINE_BYTES (their pattern's memory; the segment's own pages are gone).
QUARANTINE = 8
QUARANTINE_BYTES = 256 << 20
_quarantine: collections.deque[Ring] = collections.deque()


def enabled() -> bool:
    """Whether SHMLOADER_DEBUG_POISON asks for poison mode now ("", "0": no)."""
    return os.environ.get(ENV, "") not in ("", "0")


def arm(ring: Ring) -> Ring:
    """`ring` (a loader's) poisons each slot it releases, where the mode is on."""
    if enabled():
        ring.set_poison(PATTERN)
    return ring


def arm_one_off(segment: Ring) -> Ring:
    """`segment` (a one-off batch's, as the main process mapped it) poisons
    its view when its batch is released, where the mode is on, and stays
    mapped a while after (see QUARANTINE)."""
    if enabled():
        segment.set_poison(PATTERN, private_view=True)
        # (A weak reference: the segment's lease holds it until its release.)
        segment.release_hook = functools.partial(_release_quarantined, weakref.ref(segment))
    return segment


def _release_quarantined(segment_ref: weakref.ref[Ring], slot: int) -> None:
    """A one-off segment's release_hook: the slot released (its view
    poisoned), and the segment kept mapped among the last ones released.
    (Any thread may release a batch: each step here is one under the GIL.)"""
    segment = segment_ref()
    if segment is None:  # (its lease holds it: cannot be)
        return
    segment.release(slot)
    _quarantine.append(segment)
    while len(_quarantine) > QUARANTINE or (
        len(_quarantine) > 1 and sum(s.total_bytes for s in list(_quarantine)) > QUARANTINE_BYTES
    ):
        try:
            _quarantine.popleft()  # unmapped, unless something else holds it
        except IndexError:
            break

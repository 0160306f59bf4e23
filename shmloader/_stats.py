"""What a loader did: always on, a handful of integer additions per batch."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one loader's counters, over all its iterators so far.

    batches: batches yielded by worker iterators (num_workers > 0).
    slot_batches: of those, batches that arrived as views of a ring slot.
    unsized_batches: batches sent by torch's transport before the ring was
        sized from the first batch (slot_bytes=None).
    ring_full_batches: batches sent by torch's transport because every slot
        was held (kept batches, see num_slots).
    spilled_batches: batches larger than their slot, delivered whole by
        torch's transport.
    fallback_leaves: tensor-like leaves that cannot live in a slot (CUDA,
        sparse, nested, subclasses, object arrays), pickled by torch.
    wait_seconds: time the main process slept waiting for data.
    ring_slots, slot_bytes: the current ring's geometry (0 before it exists).
    """

    batches: int = 0
    slot_batches: int = 0
    unsized_batches: int = 0
    ring_full_batches: int = 0
    spilled_batches: int = 0
    fallback_leaves: int = 0
    wait_seconds: float = 0.0
    ring_slots: int = 0
    slot_bytes: int = 0

    def __str__(self) -> str:
        share = self.slot_batches / self.batches if self.batches else 0.0
        return (
            f"{self.batches} batches, {self.slot_batches} through the ring ({share:.0%}); "
            f"torch transport: {self.unsized_batches} before sizing, "
            f"{self.ring_full_batches} ring full, {self.spilled_batches} spilled; "
            f"{self.fallback_leaves} fallback leaves; waited {self.wait_seconds:.3f} s; "
            f"ring {self.ring_slots} x {self.slot_bytes} bytes"
        )


class Counters:
    """The mutable counters behind LoaderStats, shared by a loader's iterators."""

    __slots__ = tuple(f.name for f in dataclasses.fields(LoaderStats)) + ("warned_ring_full",
                                                                          "warned_spill")

    def __init__(self):
        for f in dataclasses.fields(LoaderStats):
            setattr(self, f.name, f.default)
        self.warned_ring_full = False
        self.warned_spill = False

    def snapshot(self) -> LoaderStats:
        return LoaderStats(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LoaderStats)})

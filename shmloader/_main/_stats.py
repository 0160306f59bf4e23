"""What a loader did: always on, a handful of additions per batch and no
system call.  Workers count their own busy time, samples and bytes in the
ring's header (see _worker_slots.WorkerCounters); a snapshot reads them there."""

from __future__ import annotations

import dataclasses

from .._shm._segment import ring_memory


@dataclasses.dataclass(frozen=True)
class WorkerStats:
    """One worker slot's totals over the loader's iterators (worker i of
    each): time spent fetching and writing, samples fetched, bytes written.
    Fetched, not yielded: batches of a prefetched epoch that was dropped, or
    in flight when an epoch was broken off, count here and not in
    LoaderStats.samples."""

    busy_seconds: float = 0.0
    samples: int = 0
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one loader's counters, over all its iterators so far.

    batches, samples: yielded by worker iterators (num_workers > 0).
    wait_seconds: time the main process slept waiting for data;
    wall_seconds: time from each iter() to its last batch, summed, so
        wait_fraction = wait_seconds / wall_seconds says how data-bound the
        loop was (near 0: the loader kept up; near 1: training waited).
    slot_batches: of the batches, those that arrived as views of a ring slot.
    The batches that came outside the ring, each in a one-off memfd segment
    of its own (or pickled by torch where it cannot be laid out in shared
    memory):
    unsized_batches: before the ring was sized from the first batch
        (slot_bytes=None, fetch="batch");
    ring_full_batches: while every slot was held (kept batches, see num_slots);
    spilled_batches: larger than their slot, delivered whole.
    fallback_leaves: tensor-like leaves that cannot live in a slot (CUDA,
        sparse, nested, subclasses, object arrays), pickled by torch.
    occupancy_mean, occupancy_max: slots in use (in flight, ready, or held
        by your code) when a batch was yielded.
    prefetched_epochs: epochs that began with batches prefetched during the
        previous one (prefetch_next_epoch).
    dropped_prefetched_batches: batches prefetched for an epoch that turned
        out another (set_epoch not called with e + 1, a generator reseeded):
        fetched by the workers, their __getitem__ calls made, then dropped.
    ring_slots, slot_bytes: the current ring's geometry (0 before it exists).
    ring_memory: where rings live, in one line: memfd memory, or /dev/shm
        where memfd_create is refused (and why).
    workers: per worker, see WorkerStats (work done before a worker had the
        ring is added once it has it: a worker that exits first, as a
        non-persistent one may in a short epoch, leaves it out).
    bytes_moved: bytes workers wrote into slots or one-off segments, or sent by torch's transport
        (its pickles and the tensor storages it shares).
    """

    batches: int = 0
    samples: int = 0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    slot_batches: int = 0
    unsized_batches: int = 0
    ring_full_batches: int = 0
    spilled_batches: int = 0
    fallback_leaves: int = 0
    occupancy_mean: float = 0.0
    occupancy_max: int = 0
    prefetched_epochs: int = 0
    dropped_prefetched_batches: int = 0
    ring_slots: int = 0
    slot_bytes: int = 0
    ring_memory: str = ""
    workers: tuple = ()

    @property
    def wait_fraction(self) -> float:
        return self.wait_seconds / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def bytes_moved(self) -> int:
        return sum(w.bytes for w in self.workers)

    def __str__(self) -> str:
        share = self.slot_batches / self.batches if self.batches else 0.0
        lines = [
            f"{self.batches} batches, {self.samples} samples; waited for data "
            f"{self.wait_seconds:.3f} s of {self.wall_seconds:.3f} s ({self.wait_fraction:.0%})",
            f"ring: {self.ring_slots} x {self.slot_bytes} bytes, {self.occupancy_mean:.1f} slots "
            f"in use on average (max {self.occupancy_max}); {self.slot_batches} batches through "
            f"it ({share:.0%}), {self.bytes_moved / 1e9:.3f} GB moved; in {self.ring_memory}",
            f"outside the ring: {self.unsized_batches} before sizing, {self.ring_full_batches} "
            f"ring full, {self.spilled_batches} spilled; {self.fallback_leaves} fallback leaves; "
            f"{self.prefetched_epochs} prefetched epochs ({self.dropped_prefetched_batches} "
            f"prefetched batches dropped)",
        ]
        for i, w in enumerate(self.workers):
            lines.append(
                f"worker {i}: busy {w.busy_seconds:.3f} s, {w.samples} samples fetched, "
                f"{w.bytes / 1e9:.3f} GB"
            )
        return "\n".join(lines)


_COUNTED = (
    "batches",
    "samples",
    "wait_seconds",
    "wall_seconds",
    "slot_batches",
    "unsized_batches",
    "ring_full_batches",
    "spilled_batches",
    "fallback_leaves",
    "occupancy_max",
    "prefetched_epochs",
    "dropped_prefetched_batches",
)


class Counters:
    """The mutable counters behind LoaderStats, shared by a loader's iterators."""

    __slots__ = _COUNTED + (
        "occupancy_sum",
        "warned_ring_full",
        "warned_spill",
        "warned_register",
        "warned_smaller_ring",
        "_ring",
        "_workers",
        "_retired",
        "_counted",
    )
    # _COUNTED's and occupancy_sum, which __init__ sets by name.
    batches: int
    samples: int
    wait_seconds: float
    wall_seconds: float
    slot_batches: int
    unsized_batches: int
    ring_full_batches: int
    spilled_batches: int
    fallback_leaves: int
    occupancy_max: int
    prefetched_epochs: int
    dropped_prefetched_batches: int
    occupancy_sum: int

    def __init__(self):
        for name in _COUNTED + ("occupancy_sum",):
            setattr(self, name, 0)
        self.warned_ring_full = False
        self.warned_spill = False
        self.warned_register = False
        self.warned_smaller_ring = False
        self._ring = None  # the ring whose worker counters are live
        self._workers = 0
        self._retired = []  # [busy_ns, samples, batches, bytes] per worker, of older rings
        self._counted = []  # the same, what _retired holds of the live ring (see use_ring)

    def use_ring(self, ring, num_workers: int, counted: bool = False) -> None:
        """Count from `ring` (a ring's worker counters only grow, so a ring
        handed to the next iterator is not counted twice).  `counted`: these
        totals already hold what `ring` counted so far (they are a shallow
        copy's, taken while its original counted from `ring`): only what it
        adds from now on counts."""
        if ring is not self._ring:
            self._retire()
            self._ring = ring
            self._counted = self._read(ring) if counted else []
        self._workers = max(self._workers, num_workers)

    def _retire(self) -> None:
        for i, counts in enumerate(self._live()):
            while len(self._retired) <= i:
                self._retired.append([0, 0, 0, 0])
            self._retired[i] = [a + b for a, b in zip(self._retired[i], counts)]

    def _read(self, ring):
        return [list(ring.worker_read(i)) for i in range(self._workers)] if ring is not None else []

    def _live(self):
        counted = self._counted + [[0, 0, 0, 0]] * (self._workers - len(self._counted))
        return [
            [a - b for a, b in zip(now, before)]
            for now, before in zip(self._read(self._ring), counted)
        ]

    def _totals(self):
        totals = [list(c) for c in self._retired]
        for i, counts in enumerate(self._live()):
            while len(totals) <= i:
                totals.append([0, 0, 0, 0])
            totals[i] = [a + b for a, b in zip(totals[i], counts)]
        return totals

    def __getstate__(self):
        # A copy of the loader (pickle, deepcopy) keeps the totals, not the ring.
        state = {name: getattr(self, name) for name in self.__slots__}
        state.update(_ring=None, _retired=self._totals(), _counted=[])
        return None, state

    def snapshot(self) -> LoaderStats:
        totals = self._totals()
        ring = self._ring
        return LoaderStats(
            **{name: getattr(self, name) for name in _COUNTED},
            occupancy_mean=self.occupancy_sum / self.batches if self.batches else 0.0,
            ring_slots=ring.nslots if ring is not None else 0,
            slot_bytes=ring.slot_bytes if ring is not None else 0,
            ring_memory=ring_memory(),
            workers=tuple(
                WorkerStats(busy_ns / 1e9, samples, nbytes)
                for busy_ns, samples, _, nbytes in totals
            ),
        )

"""A worker's bookkeeping of the ring: its mapping of the ring's slots, and
the counters it adds to the ring's header (busy ns, samples, batches, bytes
written), kept here until the ring exists (see _stats.py)."""

from __future__ import annotations

import errno
import os
import time

import torch

from .._shm._ring import Ring, SlotMemory
from ._arena import Arena
from ._exit import NoRingFds, NoRingMapping


class MappedRing:
    """The ring as this worker mapped it: the Ring, and one torch storage per
    slot, made at the slot's first use."""

    def __init__(self, fds: tuple[int, int]) -> None:
        try:
            self.ring = Ring.attach(*fds)  # keeps its own copies of the fds
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise NoRingFds(str(e)) from e
            if e.errno == errno.ENOMEM:
                raise NoRingMapping(str(e)) from e
            raise
        for fd in fds:
            os.close(fd)
        self._storages: dict[int, tuple[SlotMemory, torch.UntypedStorage]] = {}

    def slot(self, slot: int) -> tuple[SlotMemory, torch.UntypedStorage]:
        """(SlotMemory, uint8 storage) of `slot`; its first use reserves its
        pages (OSError when memory has run out since the ring was made)."""
        if slot not in self._storages:
            self.ring.reserve(slot)
            memory = self.ring.memory(slot)
            storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
            self._storages[slot] = (memory, storage)
        return self._storages[slot]

    def arena(self, slot: int, reserve: int) -> Arena:
        return Arena(*self.slot(slot), reserve=reserve)


class WorkerCounters:
    """This worker's counters: busy ns, samples, batches, bytes written.
    Added to the ring's copy when there is one, kept until then."""

    def __init__(self, worker_id):
        self._worker_id = worker_id
        self._pending = [0, 0, 0, 0]
        self.started = 0

    def start(self):
        self.started = time.perf_counter_ns()

    def add(self, mapped: MappedRing | None, samples, batches, nbytes):
        pending = self._pending
        pending[0] += time.perf_counter_ns() - self.started
        pending[1] += samples
        pending[2] += batches
        pending[3] += nbytes
        if mapped is not None:
            mapped.ring.worker_add(self._worker_id, *pending)
            self._pending = [0, 0, 0, 0]

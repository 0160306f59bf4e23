"""Delivery: a worker's result made into the batch the loop gets, tensor
views of its slot (or of a one-off segment, or torch's unpickled batch),
counted in the loader's stats, pinned as torch's pin-memory thread pins, and
moved to the device= the user asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch._utils import ExceptionWrapper
from torch.utils.data import _utils

from .._shm import _layout
from .._worker._protocol import NO_RING, RING_FULL
from ._iter_receive import kind

if TYPE_CHECKING:
    from .._features._cuda import DeviceStage
    from ._iter_ring import RingKeeper
    from ._stats import Counters


class Delivery:
    """See this module's docstring."""

    def __init__(
        self,
        *,
        ring_keeper: RingKeeper,
        counters: Counters,
        warn: Callable[[str, str], None],
        pin_memory: bool,
        pin_memory_device: str | None,
        pin_device_id: int | None,
        device_stage: DeviceStage | None,
    ) -> None:
        self._keeper = ring_keeper
        self.counters = counters  # the loader's (a copy.copy of it may take over)
        self._warn = warn
        self._pin_memory = pin_memory
        self._pin_memory_device = pin_memory_device
        self._pin_device_id = pin_device_id  # the device torch's pin thread would use
        self._device_stage = device_stage
        self._decoder = _layout.Decoder()

    def unpack(self, data: Any) -> tuple[Any, bytes | None]:
        """(batch, the worker's state it carries) of a batch's result."""
        counters = self.counters
        counters.batches += 1
        result_kind = kind(data)
        if result_kind == "slot":
            lease = data
            counters.slot_batches += 1
            self._keeper.delivered_from_slot()
        elif result_kind == "segment":
            lease = data.lease  # a one-off segment's (see _one_off.py)
        else:  # "batch": pickled by torch
            counters.samples += data.samples
            self._count_outside_ring(data.reason, data.state)
            return data.data, data.state
        if lease.meta_len == 0:  # filled row by row (fetch="sample")
            layout = self._keeper.handover.sample_layout
            assert layout is not None  # (set before any slot is filled by rows)
            meta = layout.meta(lease.rows)
        else:
            meta = lease.meta()
        batch, fallback_leaves, samples, worker_state = self._decoder.loads(
            meta, lease, result_kind == "segment" or not self._keeper.registered
        )
        counters.fallback_leaves += fallback_leaves
        counters.samples += samples
        if result_kind == "segment":
            self._count_outside_ring(data.reason, worker_state)
        return batch, worker_state

    def to_device(self, batch: Any, data: Any) -> Any:
        """The batch pinned (unless its slot is in the pinned ring) and moved
        to device=, as the loader's options ask."""
        if self._pin_memory and not (self._keeper.registered and kind(data) == "slot"):
            batch = self._pin(batch)
        if self._device_stage is not None:
            batch = self._device_stage(batch)
        return batch

    def _count_outside_ring(self, reason: str, worker_state: bytes | None) -> None:
        """Count a batch that came outside the ring, and why."""
        counters = self.counters
        if reason == NO_RING:
            counters.unsized_batches += 1
        elif reason == RING_FULL:
            counters.ring_full_batches += 1
        else:
            counters.spilled_batches += 1
            self._warn_spill(worker_state)

    def _warn_spill(self, worker_state: bytes | None) -> None:
        if self.counters.warned_spill:
            return
        keeper = self._keeper
        self.counters.warned_spill = True
        state_bytes = len(worker_state) if worker_state is not None else 0
        state = (
            f" (with the worker's state, {state_bytes} bytes: the dataset's "
            "state_dict() and the RNGs)"
            if state_bytes > keeper.state_bytes
            else ""
        )
        sized = (
            f"slot_bytes={keeper.slot_bytes}, rounded up to a page"
            if keeper.slot_bytes
            else "sized from the loader's first batches"
        )
        self._warn(
            f"shmloader: a batch{state} did not fit its slot "
            f"({keeper.batch_room()} bytes for a batch: {sized}) and was "
            "delivered whole in shared memory of its own (slower); later ones that do not fit "
            "will be too"
            + (
                ". Pass slot_bytes= to size slots for your largest batch."
                if keeper.slot_bytes
                else " until the next epoch starts, whose ring has slots made to fit the "
                "largest batch seen. Pass slot_bytes= to size slots for your largest batch "
                "from the start."
            ),
            "warned_spill",
        )

    def _pin(self, batch: Any) -> Any:
        """torch's pin-memory thread's step: its errors come as that thread's."""
        try:
            return _utils.pin_memory.pin_memory(batch, self._pin_memory_device)
        except Exception:
            ExceptionWrapper(
                where=f"in pin memory thread for device {self._pin_device_id}"
            ).reraise()

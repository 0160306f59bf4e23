"""CUDA: the ring's memory pinned once, slots fenced against pending copies,
and batches delivered on the device.

Pinning.  torch pins each batch with a second full copy in the training
process.  A ring's memory is fixed, so it is registered with CUDA once
(cudaHostRegister, through torch's CUDA runtime bindings, as torch's own
checkpoint stager does) and every view of a slot is pinned memory: a
non_blocking copy to the GPU is a DMA straight from the slot.

Fencing.  Such a copy may still be reading the slot after your last view of
it is gone.  So, on a registered ring, a lease's slot is not freed when its
views die: a CUDA event is recorded on the current stream then (the stream
your copies ran on, unless you copied on another one and dropped the views
while it was not current), and the slot goes back to the ring once the event
has completed; a worker never gets a slot whose event is pending.  The
bookkeeping (Fences) takes any fence maker, so it is tested without a GPU.

Device delivery (device="cuda").  Each batch is copied on a side stream; the
current stream waits for the copy, and every tensor is marked as used on it
(record_stream), so the batch is safe to use on the current stream and its
memory is not reused while the stream still needs it.
"""

from __future__ import annotations

import collections
import collections.abc
from typing import Any

import torch

# cudaHostRegisterPortable: pinned for every CUDA context, as torch's own.
_REGISTER_PORTABLE = 1


class CudaFence:
    """An event recorded now on the current CUDA stream."""

    def __init__(self):
        self._event = torch.cuda.Event()
        self._event.record()

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        self._event.synchronize()


class Fences:
    """A ring's release_hook: slots whose views are gone wait here, each with a
    fence, until the copies that may read them are done."""

    def __init__(self, make_fence=CudaFence):
        self._make_fence = make_fence
        self._pending = collections.deque()  # (slot, fence)

    def __call__(self, slot: int) -> None:
        self._pending.append((slot, self._make_fence()))

    def __len__(self) -> int:
        return len(self._pending)

    def reclaim(self, ring) -> None:
        """Give back to `ring` every slot whose fence has passed."""
        for _ in range(len(self._pending)):
            slot, fence = self._pending.popleft()
            if fence.done():
                ring.release(slot)
            else:
                self._pending.append((slot, fence))

    def wait_all(self) -> None:
        """Block until every pending fence has passed (before unmapping)."""
        for _, fence in self._pending:
            fence.wait()


def register(ring, cudart=None) -> str | None:
    """Pin the ring's slots with CUDA and fence its slots.  Returns None, or
    why it could not be done (the caller falls back to torch's pinning)."""
    try:
        ring.reserve_all()  # pinning touches every page: they must be there
        cudart = cudart or torch.cuda.cudart()
        address, size = ring.data_address, ring.data_bytes
        code = int(cudart.cudaHostRegister(address, size, _REGISTER_PORTABLE))
    except Exception as e:  # no CUDA runtime, a forked child, ...
        return f"{type(e).__name__}: {e}"
    if code != 0:
        return f"cudaHostRegister of {size} bytes failed with cudaError {code}"
    fences = Fences()

    def unregister():
        fences.wait_all()
        cudart.cudaHostUnregister(address)

    ring.release_hook = fences
    ring.on_destroy = unregister
    return None


def to_device(data, device: torch.device):
    """`data` with every tensor moved to `device` without blocking; the
    containers rebuilt as torch's pin_memory rebuilds them."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, collections.abc.Mapping):
        moved = {k: to_device(v, device) for k, v in data.items()}
        mapping_type: Any = type(data)  # a Mapping subclass: its constructor's arguments vary
        try:
            return mapping_type(moved)
        except TypeError:
            return moved
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(to_device(v, device) for v in data))
    if isinstance(data, tuple):
        return tuple(to_device(v, device) for v in data)
    if isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        items = [to_device(v, device) for v in data]
        sequence_type: Any = type(data)  # a Sequence subclass: its constructor's arguments vary
        try:
            return sequence_type(items)
        except TypeError:
            return items
    return data


class DeviceStage:
    """Moves yielded batches to `device`: for CUDA on a side stream, made safe
    to use on the stream current when the batch is yielded."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, batch):
        if self._stream is None:
            return batch if self.device.type == "cpu" else to_device(batch, self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            moved = to_device(batch, self.device)
        current.wait_stream(self._stream)
        for t in _tensors(moved):
            if t.device.type == "cuda":
                t.record_stream(current)
        return moved


def _tensors(data):
    if isinstance(data, torch.Tensor):
        yield data
    elif isinstance(data, collections.abc.Mapping):
        for v in data.values():
            yield from _tensors(v)
    elif isinstance(data, collections.abc.Sequence) and not isinstance(data, (str, bytes)):
        for v in data:
            yield from _tensors(v)


def check_device(device):
    """The torch.device for the device= option, or None; a clear ValueError
    for a device that does not exist here."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device should be a torch.device or a string such as 'cuda', "
            f"but got device={device!r} ({e})"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={str(device)!r}, but CUDA is not available here "
            "(torch.cuda.is_available() is False); leave device=None to get "
            "CPU batches."
        )
    if device.type == "meta":
        raise ValueError(
            "device='meta' would deliver tensors without data; leave "
            "device=None to get CPU batches."
        )
    if device.type not in ("cpu", "cuda"):
        try:  # another accelerator: fail here, not at every batch
            torch.empty(0, device=device)
        except (AssertionError, RuntimeError) as e:
            raise ValueError(
                f"device={str(device)!r} is not usable here ({e}); leave "
                "device=None to get CPU batches."
            ) from None
    return device

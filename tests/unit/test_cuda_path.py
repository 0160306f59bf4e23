"""The GPU path (shmloader/_features/_cuda.py): what runs without a GPU runs everywhere (the slot
fences behind a fake fence, registration against a fake CUDA runtime, device=
handling), and the CUDA tests run where CUDA is."""

import gc
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import shmloader
from shmloader._features import _cuda
from shmloader._main import _torch_api
from shmloader._shm._ring import FREE, READING, Ring


def needs_cuda(test):
    """A test on a CUDA device: marked `cuda`, skipped on a machine without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return pytest.mark.cuda(skip(test))


class FakeFence:
    """A fence the test passes by hand, like a copy the GPU has not finished."""

    def __init__(self):
        self.passed = False
        self.waited = False

    def done(self):
        return self.passed

    def wait(self):
        self.waited = True
        self.passed = True


class FakeCudart:
    def __init__(self, code=0, fail=None):
        self.code = code
        self.fail = fail
        self.calls = []

    def cudaHostRegister(self, address, size, flags):
        if self.fail is not None:
            raise self.fail
        self.calls.append(("register", address, size, flags))
        return self.code

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


def _published(ring, seq):
    slot = ring.claim()
    ring.publish(slot, seq, 0, 0)
    return ring.acquire()


# ---- fences: a slot comes back only once its copies are done ----------------


def test_fenced_slot_is_not_reused_until_its_fence_passes():
    ring = Ring.create_in("/dev/shm", 2, 4096)
    fences_made = []

    def make():
        fences_made.append(FakeFence())
        return fences_made[-1]

    fences = _cuda.Fences(make)
    ring.release_hook = fences
    lease = _published(ring, 1)
    slot = lease.slot
    view = torch.frombuffer(lease, dtype=torch.uint8)  # the batch's tensor
    del lease
    assert ring.slot_state(slot) == READING  # a view is alive
    del view
    gc.collect()
    # The last view is gone, but a copy may still read the slot.
    assert len(fences) == 1 and ring.slot_state(slot) == READING
    fences.reclaim(ring)
    assert ring.slot_state(slot) == READING
    other = ring.claim()
    assert other is not None and other != slot and ring.claim() is None  # never the fenced one
    fences_made[0].passed = True
    fences.reclaim(ring)
    assert ring.slot_state(slot) == FREE and len(fences) == 0
    assert ring.claim() == slot


def test_fences_pass_out_of_order():
    ring = Ring.create_in("/dev/shm", 3, 4096)
    made = []
    fences = _cuda.Fences(lambda: made.append(FakeFence()) or made[-1])
    ring.release_hook = fences
    slots = []
    for seq in range(3):
        lease = _published(ring, seq)
        slots.append(lease.slot)
        lease.release()
    made[1].passed = True  # a later copy finished first (another stream)
    fences.reclaim(ring)
    assert [ring.slot_state(s) for s in slots] == [READING, FREE, READING]
    fences.wait_all()
    assert [f.waited for f in made] == [True, False, True]  # the pending ones


def test_a_failing_fence_maker_gives_the_slot_back_at_once():
    ring = Ring.create_in("/dev/shm", 1, 4096)

    def broken():
        raise RuntimeError("device lost")

    ring.release_hook = _cuda.Fences(broken)
    lease = _published(ring, 1)
    slot = lease.slot
    del lease  # dealloc: the hook raises, the slot must not be lost
    gc.collect()
    assert ring.slot_state(slot) == FREE


def test_a_ctrl_c_met_in_a_release_hook_reaches_the_loop():
    """A release hook is Python (poison mode's, the fences): a Ctrl-C pending when a
    batch is freed is raised in it, inside a deallocation, where it would be printed
    and dropped and the training loop would go on; it reaches the loop instead."""
    ring = Ring.create_in("/dev/shm", 1, 4096)

    def interrupted(slot):
        raise KeyboardInterrupt

    ring.release_hook = interrupted
    lease = _published(ring, 1)
    with pytest.raises(KeyboardInterrupt):
        del lease  # (dealloc: the hook raises)
        for _ in range(10_000):  # the loop's next bytecodes
            pass


# ---- registration --------------------------------------------------------------


def test_register_pins_the_slots_once_and_unregisters_after_the_last_fence():
    ring = Ring.create_in("/dev/shm", 3, 10000)
    cudart = FakeCudart()
    assert _cuda.register(ring, cudart) is None
    assert cudart.calls == [("register", ring.data_address, ring.data_bytes, 1)]
    assert ring.data_bytes == 3 * ring.slot_bytes
    assert isinstance(ring.release_hook, _cuda.Fences)
    address = ring.data_address
    del ring
    gc.collect()
    assert cudart.calls[-1] == ("unregister", address)


@pytest.mark.parametrize(
    "cudart, expected",
    [
        (FakeCudart(code=2), "cudaError 2"),
        (FakeCudart(fail=RuntimeError("CUDA driver too old")), "CUDA driver too old"),
    ],
)
def test_register_failure_is_reported_and_leaves_the_ring_plain(cudart, expected):
    ring = Ring.create_in("/dev/shm", 2, 4096)
    failure = _cuda.register(ring, cudart)
    assert expected in failure
    assert ring.release_hook is None and ring.on_destroy is None


def test_register_without_cuda_fails_cleanly():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: registration would succeed")
    ring = Ring.create_in("/dev/shm", 1, 4096)
    assert _cuda.register(ring) is not None


# ---- device= ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nope", 3.5, "cuda:x"])
def test_bad_device_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="device should be"):
        shmloader.DataLoader(range(4), device=bad)


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(ValueError, match="CUDA is not available"):
        shmloader.DataLoader(range(4), device="cuda")


@pytest.mark.parametrize("device", ["meta", "xpu", "mps"])
def test_device_without_data_or_backend_is_a_clear_error(device):
    """Refused at construction, not failed at every batch."""
    backend = getattr(torch, device, None)
    if device != "meta" and backend is not None and backend.is_available():
        pytest.skip(f"{device} is here")
    with pytest.raises(ValueError, match=f"device='{device}'"):
        shmloader.DataLoader(range(4), device=device)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_cpu_device_yields_torchs_batches(num_workers):
    ds = TensorDataset(torch.randn(20, 3, 4), torch.arange(20))
    g1, g2 = (torch.Generator().manual_seed(3) for _ in range(2))
    ref = list(
        TorchDataLoader(ds, batch_size=6, shuffle=True, generator=g1, num_workers=num_workers)
    )
    got = list(
        shmloader.DataLoader(
            ds,
            batch_size=6,
            shuffle=True,
            generator=g2,
            num_workers=num_workers,
            device=torch.device("cpu"),
        )
    )
    assert len(got) == len(ref)
    for (a, b), (c, d) in zip(ref, got):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_to_device_keeps_containers():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "s")], "b": Pair(torch.ones(1), 3)}
    moved = _cuda.to_device(batch, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][1] == "s"
    assert isinstance(moved["a"][1], tuple) and isinstance(moved["b"], Pair)
    assert moved["b"].x.device.type == "meta" and moved["b"].y == 3


# ---- on a GPU ---------------------------------------------------------------------


def _images(n=64):
    return TensorDataset(torch.randint(0, 256, (n, 3, 64, 64), dtype=torch.uint8), torch.arange(n))


@needs_cuda
def test_pinned_slots_report_is_pinned_and_match_torch():
    ds = _images()
    ref = list(TorchDataLoader(ds, batch_size=8, num_workers=2, pin_memory=True))
    loader = shmloader.DataLoader(
        ds, batch_size=8, num_workers=2, pin_memory=True, slot_bytes=1 << 20
    )
    got = list(loader)
    assert all(b[0].is_pinned() for b in got)
    for (a, b), (c, d) in zip(ref, got):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert loader.stats().slot_batches == len(got)


@needs_cuda
def test_non_blocking_copies_are_never_overwritten():
    """Slow GPU work queued before each copy keeps the copies pending while the
    loop drops its views at once: a slot reused too early would corrupt them."""
    ds = _images(256)
    loader = shmloader.DataLoader(
        ds, batch_size=8, num_workers=2, pin_memory=True, slot_bytes=1 << 20, num_slots=4
    )
    copies = []
    for images, labels in loader:
        torch.cuda._sleep(2_000_000)  # keep the stream busy
        copies.append((images.to("cuda", non_blocking=True), labels.clone()))
        del images
    torch.cuda.synchronize()
    for gpu_images, labels in copies:
        assert torch.equal(gpu_images.cpu(), ds.tensors[0][labels])


@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_cuda_yields_torchs_batches_on_the_gpu(num_workers):
    ds = _images()
    g1, g2 = (torch.Generator().manual_seed(5) for _ in range(2))
    ref = list(TorchDataLoader(ds, batch_size=8, shuffle=True, generator=g1))
    loader = shmloader.DataLoader(
        ds, batch_size=8, shuffle=True, generator=g2, num_workers=num_workers, device="cuda"
    )
    assert len(loader) == len(ref)
    got = list(loader)
    for (a, b), (c, d) in zip(ref, got):
        assert c.device.type == "cuda" and torch.equal(a, c.cpu()) and torch.equal(b, d.cpu())


@needs_cuda
def test_registration_failure_falls_back_to_torchs_pinning(monkeypatch):
    monkeypatch.setattr(_cuda, "register", lambda ring: "cudaHostRegister failed (test)")
    loader = shmloader.DataLoader(
        _images(), batch_size=8, num_workers=2, pin_memory=True, slot_bytes=1 << 20
    )
    with pytest.warns(shmloader.ShmloaderWarning, match="could not pin the ring"):
        got = list(loader)
    assert all(b[0].is_pinned() for b in got)


@pytest.mark.parametrize("pin_memory_device", ["", "cuda"])
def test_with_cuda_pin_memory_registers_the_ring_under_this_torch(monkeypatch, pin_memory_device):
    """Whether the ring is pinned is read off what the installed torch's own iterator sets:
    torch 2.6 pins to pin_memory_device ("" meaning CUDA), later torch to the current
    accelerator. Torch is told it has CUDA here (the machines that run CI have none); a
    decision that held on one torch only fails under the other (CI runs torch 2.6 too)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(
            torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda")
        )

    def pins_to_cuda(**kw):
        loader = TorchDataLoader(range(8), batch_size=2, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # later torch: pin_memory_device is deprecated
            return _torch_api.pins_to_cuda(_BaseDataLoaderIter(loader))

    assert pins_to_cuda(pin_memory=True, pin_memory_device=pin_memory_device)
    assert not pins_to_cuda(pin_memory=False, pin_memory_device=pin_memory_device)

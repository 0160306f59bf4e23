"""Poison mode (SHMLOADER_DEBUG_POISON=1, docs/reliability.md#poison-mode), and the lease rule
attacked under it (NOTE [contract 3: views are safe]).

In poison mode the main process overwrites a slot's data with the pattern the moment its lease
is released, before any worker may claim it, and a one-off segment's view the moment its batch
is released.  The first tests show that the mode catches a breach: memory read past its lease
through a raw pointer reads the pattern (and the old batch without the mode).  The rest keep a
batch's memory alive every way a user can, run on until every slot has been reused several
times, and compare what was kept with torch's DataLoader's batch: each way either keeps its
slot or has a copy, since under poison mode a breach would read the pattern or a later batch."""

import ctypes
import gc
import io
import os
import pickle
import queue
import random
import threading
import zlib

import numpy as np
import pytest
import torch
import torch.multiprocessing
import torch.utils.data as tud
import torch.utils.dlpack

from shmloader import DataLoader
from shmloader._shm import _poison
from shmloader._shm._ring import FREE, READING, Ring
from shmloader._shm._segment import new_segment
from shmloader._worker import _one_off

# The datasets and collate functions are the test's own: they reach workers by fork.
CONTEXT = "fork"
PATTERN = bytes([_poison.PATTERN])

BATCH = 4
WIDTH = 2048  # float64 values a sample: 16 KiB, so a batch's leaf is a view of its slot
SLOT = 1 << 17


class Distinct(tud.Dataset):
    """Sample i: WIDTH float64 values none of which any other sample has (and none zero)."""

    def __init__(self, n=64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange(i * WIDTH + 1, (i + 1) * WIDTH + 1, dtype=torch.float64)


def numpy_collate(samples):
    """A batch whose leaf is a numpy array (a view of its slot, as torch's transport would
    give an array of its own)."""
    return np.stack([s.numpy() for s in samples])


def _expected(dataset, collate_fn=None):
    loader = tud.DataLoader(dataset, batch_size=BATCH, collate_fn=collate_fn)
    return [_numpy(b) for b in loader]


@pytest.fixture
def poison(monkeypatch):
    """Poison mode on, for the rings and one-off segments made from here on."""
    monkeypatch.setenv(_poison.ENV, "1")


# ---------------------------------------------------------------------------- the mode itself


def test_the_mode_is_read_when_a_ring_is_made(monkeypatch):
    for value, on in [("1", True), ("yes", True), ("0", False), ("", False), (None, False)]:
        if value is None:
            monkeypatch.delenv(_poison.ENV, raising=False)
        else:
            monkeypatch.setenv(_poison.ENV, value)
        assert new_segment(1, 4096).poison == (_poison.PATTERN if on else -1), value


def _published(ring, data=b"a batch", seq=7):
    slot = ring.claim()
    ring.reserve(slot)
    ring.memory(slot).write(0, data)
    ring.publish(slot, seq, 0, len(data))
    return slot


def test_a_released_slot_is_all_pattern_before_it_is_free_and_nothing_else_is_touched():
    ring = Ring.create_memfd("shmloader-test", 3, 4096)
    ring.set_poison(_poison.PATTERN)
    _published(ring, b"another batch", seq=1)
    _published(ring, b"this batch", seq=2)
    never = ring.claim()  # published without a write: its pages never reserved
    ring.publish(never, 3, 0, 0)
    leases = {lease.seq: lease for lease in (ring.acquire(), ring.acquire(), ring.acquire())}
    lease = leases[2]
    slot = lease.slot
    assert lease.meta() == b"this batch"
    lease.release()
    assert ring.slot_state(slot) == FREE
    assert ring.memory(slot).read(0, ring.slot_bytes) == PATTERN * ring.slot_bytes
    # The held batch's slot and the ring's header are not the released slot's data.
    assert ring.slot_state(leases[1].slot) == READING
    assert (leases[1].seq, leases[1].meta()) == (1, b"another batch")
    # A slot never written has no batch to hide (nor, maybe, memory behind it): left alone.
    leases[3].release()
    assert ring.memory(never).read(0, ring.slot_bytes) == bytes(ring.slot_bytes)
    # The next batch in the slot is whole, and the ring goes on.
    assert _published(ring, b"next", seq=4) == slot
    assert ring.acquire().meta() == b"next"


def test_a_slot_that_is_not_the_consumers_is_never_overwritten():
    ring = Ring.create_memfd("shmloader-test", 1, 4096)
    ring.set_poison(_poison.PATTERN)
    slot = _published(ring)  # READY: the consumer has not taken it
    with pytest.raises(OSError):
        ring.release(slot)
    assert ring.memory(slot).read(0, 7) == b"a batch"


def test_without_the_mode_a_released_slot_keeps_its_bytes():
    ring = Ring.create_memfd("shmloader-test", 1, 4096)
    assert ring.poison == -1
    slot = _published(ring)
    ring.acquire().release()
    assert ring.memory(slot).read(0, 7) == b"a batch"


def test_a_retired_rings_released_slot_reads_zeros():
    """Past its loader a ring gives back the pages of each slot released: after the pattern,
    they go, and the slot reads as zeros (never as its batch)."""
    ring = Ring.create_memfd("shmloader-test", 2, 4096)
    ring.set_poison(_poison.PATTERN)
    slot = _published(ring)
    lease = ring.acquire()
    ring.retire()
    assert lease.meta() == b"a batch"  # kept: its slot keeps its pages
    lease.release()
    assert ring.memory(slot).read(0, ring.slot_bytes) == bytes(ring.slot_bytes)


def test_a_one_off_segment_is_overwritten_in_this_process_only(poison):
    """A one-off batch's segment as the main process receives it: released, its view here
    reads the pattern, while the segment's pages (which a forked child may still map and
    keep) are untouched; the view stays mapped (quarantined) for a leaked pointer to read."""
    data = torch.arange(1, 4097, dtype=torch.float64)
    segment = _one_off.write(5, data, 1, None, 64 << 10, 0)
    sender, receiver = torch.multiprocessing.Pipe()
    _one_off.send(sender, ("segment",), segment)
    assert receiver.recv() == ("segment",)
    lease = _one_off.receive(receiver)
    assert lease.ring.poison == _poison.PATTERN
    address = ctypes.addressof(ctypes.c_char.from_buffer(lease))
    nbytes = len(lease)
    lease.release()
    del lease
    gc.collect()
    assert ctypes.string_at(address, nbytes) == PATTERN * nbytes  # quarantined: still mapped
    # The worker's mapping of the same pages: the batch, whole.
    assert segment.memory(0).read(0, data.nbytes) == data.numpy().tobytes()


PAYLOAD = 4096


def _producer(fd, efd, tasks):
    """Fills each slot it is sent with its task's payload and the payload's crc32 at the slot's
    end (quickly: far sooner than the pattern covers a slot), then publishes it."""
    ring = Ring.attach(fd, efd)
    meta_off = ring.slot_bytes - 64
    while (task := tasks.recv()) is not None:
        seq, slot = task
        data = random.Random(seq).randbytes(PAYLOAD)
        ring.reserve(slot)
        memory = ring.memory(slot)
        memory.write(0, data)
        header = str(zlib.crc32(data)).encode()
        memory.write(meta_off, header)
        ring.publish(slot, seq, meta_off, len(header))


@pytest.mark.slow
def test_the_pattern_is_written_before_any_producer_may_claim_the_slot():
    """Slots released in another thread (as the garbage collector or a training thread releases
    them) while the consumer claims and producers refill: no payload ever shows the pattern,
    so it is whole before the slot is FREE.  (A race test: with the pattern written after FREE,
    about half of the runs fail.)"""
    ring = Ring.create_memfd("shmloader-test", 4, 1 << 20)
    ring.set_poison(_poison.PATTERN)
    ctx = torch.multiprocessing.get_context("fork")
    pipes, producers = [], []
    for _ in range(2):
        parent, child = ctx.Pipe()
        producer = ctx.Process(target=_producer, args=(*ring.fds, child), daemon=True)
        producer.start()
        pipes.append(parent)
        producers.append(producer)
    released = queue.SimpleQueue()
    poisoned = []
    freed, tell_freed = os.pipe()  # wakes the consumer when a slot is FREE again

    def releaser():
        while (lease := released.get()) is not None:
            slot = lease.slot
            lease.release()
            poisoned.append(ring.memory(slot).read(0, 64) == PATTERN * 64)
            del lease
            os.write(tell_freed, b"x")

    thread = threading.Thread(target=releaser)
    thread.start()
    rounds, sent, received = 10000, 0, 0
    try:
        while received < rounds:
            while sent < rounds and (slot := ring.claim()) is not None:
                pipes[sent % 2].send((sent, slot))
                sent += 1
            lease = ring.acquire()
            if lease is None:
                fired = ring.wait(60, [freed] + [p.sentinel for p in producers])
                assert fired is not None and set(fired) <= {freed}, "a producer died or hung"
                if fired:
                    os.read(freed, 4096)
                continue
            data = lease.read(0, PAYLOAD)
            assert int(lease.meta()) == zlib.crc32(data), f"batch {lease.seq} was overwritten"
            assert data == random.Random(lease.seq).randbytes(len(data))
            released.put(lease)
            del lease
            received += 1
    finally:
        released.put(None)
        thread.join(60)
        for pipe in pipes:
            pipe.send(None)
        for producer in producers:
            producer.join(60)
        os.close(freed)
        os.close(tell_freed)
    assert all(producer.exitcode == 0 for producer in producers)
    # (Read after the release, a slot may already hold its next batch: most read the pattern.)
    assert poisoned.count(True) > 0


# ---------------------------------------------------------------------------- a breach is caught


def _loader(dataset, **options):
    options = {
        "batch_size": BATCH,
        "num_workers": 1,
        "prefetch_factor": 2,
        "slot_bytes": SLOT,
        "num_slots": 5,
        "multiprocessing_context": CONTEXT,
        **options,
    }
    return DataLoader(dataset, **options)


def _leak_raw(tensor):
    """A raw view of `tensor`'s bytes that holds nothing: memory taken by address."""
    return (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())


@pytest.mark.parametrize("mode", ["poison", "plain"])
def test_a_leaked_raw_view_of_a_slot_reads_the_pattern(monkeypatch, mode):
    if mode == "poison":
        monkeypatch.setenv(_poison.ENV, "1")
    else:
        monkeypatch.delenv(_poison.ENV, raising=False)
    loader = _loader(Distinct())
    it = iter(loader)
    batch = next(it)
    want = batch.numpy().tobytes()
    raw = _leak_raw(batch)
    del it  # the workers go, so that nothing refills the slot; the loader keeps the ring mapped
    gc.collect()
    del batch  # the slot's last view: it is released
    gc.collect()
    if mode == "poison":
        assert raw.raw == PATTERN * len(want), "the released slot still shows its batch"
    else:
        assert raw.raw == want  # what poison mode is there to catch
    assert loader.stats().slot_batches >= 1


def test_a_leaked_raw_view_of_a_one_off_segment_reads_the_pattern(poison):
    loader = _loader(Distinct(), slot_bytes=None)  # the first batch sizes the ring: a one-off
    it = iter(loader)
    batch = next(it)
    assert loader.stats().unsized_batches == 1
    raw = _leak_raw(batch)
    del batch
    gc.collect()
    assert raw.raw == PATTERN * len(raw.raw)
    del it


# ---------------------------------------------------------------------------- the lease attacked


def _ctypes_from_address(batch):
    return _leak_raw(batch), batch.shape


def _from_raw(kept):
    raw, shape = kept
    return torch.frombuffer(bytearray(raw.raw), dtype=torch.float64).reshape(shape)


def _queue_put(batch):
    queue = torch.multiprocessing.get_context(CONTEXT).Queue()
    queue.put(batch)  # pickled by the queue's thread, through torch's shared-memory reductions
    return queue


def _torch_save(view):
    file = io.BytesIO()
    torch.save(view, file)
    file.seek(0)
    return file


def _numpy(t):
    """A tensor copy of `t` (a tensor, or anything numpy reads)."""
    return t.clone() if isinstance(t, torch.Tensor) else torch.from_numpy(np.array(t))


def _view_of_a_view(b):
    return b.view(-1)[WIDTH:].view(-1, WIDTH)[::2]


def _with_storage(kept):
    storage, shape, stride = kept
    return torch.empty((0,), dtype=torch.float64).set_(storage, 0, shape, stride)


# name: (keep(batch) -> what the user keeps, read(kept) -> a tensor, what torch's batch gives)
WAYS = {
    "view": (lambda b: b[1:3], lambda k: k, lambda b: b[1:3]),
    "view of a view": (_view_of_a_view, lambda k: k, _view_of_a_view),
    "Tensor.numpy()": (lambda b: b.numpy(), _numpy, lambda b: b),
    "np.asarray": (np.asarray, _numpy, lambda b: b),
    "memoryview of numpy": (lambda b: memoryview(b.numpy()), _numpy, lambda b: b),
    "ctypes from_buffer": (
        lambda b: (ctypes.c_double * b.numel()).from_buffer(b.numpy()),
        lambda k: torch.tensor(list(k)).view(BATCH, WIDTH),
        lambda b: b,
    ),
    "numpy ctypes data_as": (
        lambda b: (b.numpy().ctypes.data_as(ctypes.POINTER(ctypes.c_double)), b.shape),
        lambda k: torch.as_tensor(np.ctypeslib.as_array(k[0], shape=k[1]).copy()),
        lambda b: b,
    ),
    "torch.from_dlpack": (torch.from_dlpack, lambda k: k, lambda b: b),
    "DLPack capsule": (torch.utils.dlpack.to_dlpack, torch.from_dlpack, lambda b: b),
    "np.from_dlpack": (np.from_dlpack, _numpy, lambda b: b),
    "torch.as_strided": (
        lambda b: torch.as_strided(b, (BATCH, 2), (WIDTH, 1), 5),
        lambda k: k,
        lambda b: torch.as_strided(b, (BATCH, 2), (WIDTH, 1), 5),
    ),
    "untyped_storage": (
        lambda b: (b.untyped_storage(), b.shape, b.stride()),
        _with_storage,
        lambda b: b,
    ),
    "share_memory_": (lambda b: b[1:].share_memory_(), lambda k: k, lambda b: b[1:]),
    "multiprocessing queue": (_queue_put, lambda q: q.get(timeout=60), lambda b: b),
    "pickle": (pickle.dumps, pickle.loads, lambda b: b),
    "torch.save of a view": (lambda b: _torch_save(b[2:]), torch.load, lambda b: b[2:]),
}
# The control: memory taken by address holds nothing, and must be caught.
BREACH = (_ctypes_from_address, _from_raw, lambda b: b)


def _run_base(keep, keep_at=2, epochs=2):
    """Epochs of 16 batches through 5 slots, batch `keep_at` kept by `keep`; returns what
    was kept and the loader (alive: its ring stays mapped)."""
    loader = _loader(Distinct())
    kept = None
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            if kept is None and i == keep_at:
                kept = keep(batch)
        del batch
    gc.collect()
    stats = loader.stats()
    assert stats.slot_batches >= 3 * stats.ring_slots, "the slots were not reused"
    return kept, loader


@pytest.mark.parametrize("way", WAYS)
def test_memory_kept_alive_keeps_its_batch(poison, way):
    keep, read, expect = WAYS[way]
    kept, loader = _run_base(keep)
    want = expect(_expected(Distinct())[2])
    assert torch.equal(read(kept), want), f"{way}: the kept memory changed as its slot was reused"


def test_memory_taken_by_address_is_caught(poison):
    """The control: the same run with memory that holds nothing reads something else."""
    keep, read, expect = BREACH
    kept, loader = _run_base(keep)
    assert not torch.equal(read(kept), expect(_expected(Distinct())[2]))


# ---------------------------------------------------------------------------- across the loader's life


# What the scenarios below keep: a way each, of a batch each (so each way alone holds its slot),
# and, the control, a raw view of the next batch, which holds nothing and must read otherwise.
KEEP = ["view", "np.asarray", "torch.from_dlpack", "untyped_storage", "share_memory_", "raw"]


def _keep_some(kept, i, batch, first):
    """Batch i from `first` on kept by the next of KEEP's ways."""
    if first <= i < first + len(KEEP):
        name = KEEP[i - first]
        keep = BREACH[0] if name == "raw" else WAYS[name][0]
        kept.append((name, i, keep(batch)))


def _check(kept, expected, ways=KEEP):
    """Every way kept its batch, and the control did not (read while its ring is mapped: the
    kept batches hold it)."""
    assert sorted(name for name, _, _ in kept) == sorted(ways)
    for name, i, k in kept:
        _, read, expect = BREACH if name == "raw" else WAYS[name]
        same = torch.equal(read(k), expect(expected[i]))
        assert same != (name == "raw"), f"{name}: batch {i} {'un' * same}changed"


def _epochs(loader, n, kept=None, first=2):
    """`n` epochs of `loader`, batches from `first` kept in the first; each epoch's batches
    checked against torch's."""
    expected = _expected(loader.dataset)
    for epoch in range(n):
        got = 0
        for i, batch in enumerate(loader):
            assert torch.equal(batch, expected[i]), (epoch, i)
            if epoch == 0 and kept is not None:
                _keep_some(kept, i, batch, first)
            got += 1
        del batch
        assert got == len(expected)
    gc.collect()
    return expected


def test_kept_across_load_state_dict(poison):
    loader = _loader(Distinct(), num_slots=8)
    expected = _expected(Distinct())
    kept = []
    for i, batch in enumerate(loader):
        if i == 1:
            state = loader.state_dict()
        _keep_some(kept, i, batch, 2)
        if i == 9:
            break
    del batch
    loader.load_state_dict(state)
    resumed = [b.clone() for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected[2:]))
    assert len(resumed) == len(expected) - 2
    _epochs(loader, 2)
    _check(kept, expected)


@pytest.mark.parametrize("prefetch", [False, True], ids=["persistent", "prefetch_next_epoch"])
def test_kept_across_a_persistent_epoch_boundary(poison, prefetch):
    """With persistent workers (and with the next epoch's batches prefetched into free slots
    while the last ones of this epoch are held) the kept batches are the last ones of the
    epoch."""
    loader = _loader(Distinct(), num_slots=8, persistent_workers=True, prefetch_next_epoch=prefetch)
    kept = []
    expected = _epochs(loader, 1, kept, first=16 - len(KEEP))
    _epochs(loader, 3)
    _check(kept, expected)
    if prefetch:
        assert loader.stats().prefetched_epochs >= 1


def test_kept_with_fetch_sample(poison):
    loader = _loader(Distinct(), num_slots=10, num_workers=2, fetch="sample")
    kept = []
    expected = _epochs(loader, 1, kept)
    _epochs(loader, 2)
    _check(kept, expected)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["spare ring", "persistent"])
def test_kept_after_the_loader_is_deleted(poison, persistent):
    loader = _loader(Distinct(), num_slots=8, persistent_workers=persistent)
    kept = []
    expected = _epochs(loader, 1, kept)
    del loader
    gc.collect()  # its ring retired: the free slots' pages go, the kept ones stay
    _check(kept, expected)
    _epochs(_loader(Distinct(), num_slots=8), 2)  # a new ring, in memory the old one gave back
    _check(kept, expected)
    kept = [k for k in kept if k[0] != "raw"]  # (read no more: its ring goes with the rest)
    while kept:  # each released into a retired ring: no crash, the others unchanged
        kept.pop()
        gc.collect()
        for name, i, k in kept:
            _, read, expect = WAYS[name]
            assert torch.equal(read(k), expect(expected[i]))


@pytest.mark.filterwarnings("ignore:shmloader. all 4 ring slots are in use")
def test_kept_one_off_batches(poison):
    """Every slot held: the later batches travel in one-off segments of their own."""
    loader = _loader(Distinct(), num_slots=4)
    held = []
    kept = []
    first = 16 - len(KEEP)
    for i, batch in enumerate(loader):
        held.append(batch)
        # (No control: a one-off segment's view stays mapped only a while after its release;
        # see test_a_leaked_raw_view_of_a_one_off_segment_reads_the_pattern.)
        if KEEP[i - first : i - first + 1] != ["raw"]:
            _keep_some(kept, i, batch, first)
    del batch
    assert loader.stats().ring_full_batches >= len(KEEP)
    expected = _expected(Distinct())
    held.clear()  # only the kept ways hold the one-off segments now
    gc.collect()
    _epochs(loader, 2)
    _check(kept, expected, [name for name in KEEP if name != "raw"])


def test_kept_numpy_leaves(poison):
    """A batch whose leaf is a numpy array viewing its slot, kept as a view, through a
    memoryview, as a tensor, and through DLPack."""
    ways = {
        "slice": lambda a: a[1:],
        "memoryview": memoryview,
        "torch.from_numpy": torch.from_numpy,
        "np.from_dlpack": np.from_dlpack,
    }
    loader = _loader(Distinct(), num_slots=8, collate_fn=numpy_collate)
    expected = _expected(Distinct(), numpy_collate)
    kept = {}
    for _ in range(3):
        for i, batch in enumerate(loader):
            assert isinstance(batch, np.ndarray)
            name = list(ways)[i - 2] if 2 <= i < 2 + len(ways) else None
            if name is not None and name not in kept:
                kept[name] = (i, ways[name](batch))
        del batch
    gc.collect()
    for name, (i, k) in kept.items():
        want = expected[i][1:] if name == "slice" else expected[i]
        assert torch.equal(_numpy(k), want), f"{name}: batch {i} changed"

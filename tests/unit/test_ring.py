"""The C ring through its Cython wrapper: states, checks, and a multi-process
stress run that verifies every payload."""

import errno
import fcntl
import multiprocessing as mp
import os
import pickle
import random
import zlib

import numpy as np
import pytest
import torch

from shmloader._shm import _ring
from shmloader._shm._ring import Ring


def _our_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("shmloader")}


@pytest.fixture(params=["memfd", "tmpfile"])
def ring(request):
    before = _our_names()
    if request.param == "memfd":
        r = Ring.create_memfd("shmloader-test", 4, 10000)
    else:
        r = Ring.create_in("/dev/shm", 4, 10000)
    assert _our_names() == before  # no name left behind
    return r


def test_geometry_is_page_aligned(ring):
    page = os.sysconf("SC_PAGESIZE")
    assert ring.nslots == 4
    assert ring.slot_bytes % page == 0 and ring.slot_bytes >= 10000
    assert ring.total_bytes >= 4 * ring.slot_bytes


def test_state_machine(ring):
    slot = ring.claim()
    assert ring.slot_state(slot) == _ring.CLAIMED
    ring.memory(slot).write(0, b"meta")
    ring.publish(slot, 42, 0, 4)
    assert ring.slot_state(slot) == _ring.READY
    lease = ring.acquire()
    assert (lease.slot, lease.seq, lease.meta()) == (slot, 42, b"meta")
    assert ring.slot_state(slot) == _ring.READING
    assert ring.acquire() is None
    lease.release()
    lease.release()  # idempotent
    assert ring.slot_state(slot) == _ring.FREE


def test_protocol_errors_are_exceptions(ring):
    with pytest.raises(OSError) as e:
        ring.publish(0, 1, 0, 0)  # not CLAIMED
    assert e.value.errno == errno.EBUSY and "slot 0" in str(e.value)
    with pytest.raises(OSError):
        ring.release(0)  # not READING
    slot = ring.claim()
    with pytest.raises(OSError) as e:
        ring.publish(slot, 1, ring.slot_bytes - 2, 10)  # metadata outside the slot
    assert e.value.errno == errno.ERANGE
    with pytest.raises(OSError):
        ring.publish(99, 1, 0, 0)


def test_a_refused_publish_leaves_the_published_batch_as_it_was(ring):
    """A publish out of turn (the slot READY already) is refused before it writes the
    batch's descriptor: the consumer still reads the batch as its producer published it."""
    slot = ring.claim()
    writer = Ring.attach(*ring.fds)
    writer.publish(slot, 1, 0, 10)
    with pytest.raises(OSError) as e:
        writer.publish(slot, 2, 100, 20)
    assert e.value.errno == errno.EBUSY
    lease = ring.acquire()
    assert (lease.seq, lease.meta_off, lease.meta_len) == (1, 0, 10)


def test_wait_takes_a_timeout_beyond_an_ints_milliseconds(ring):
    """torch's DataLoader takes any timeout (a month, inf): the wait sleeps in parts, and
    wakes at once for what it waits on."""
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        for timeout in (3e6, float("inf")):
            assert ring.wait(timeout, [r]) == [r]
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", range(1, 13))
def test_slots_copied_before_a_fork_are_those_still_held_when_garbage_is_collected(threshold):
    """privatize_held (run before every fork) lists the slots this process holds; a garbage
    collection while it copies them could release one of the listed leases.  That slot must
    not be copied: a later batch in it would be read from the stale private copy.  (Which
    allocation the collection comes at depends on the threshold: each one is tried.)"""
    import gc

    ring = Ring.create_in("/dev/shm", 2, 4096)
    writer = Ring.attach(*ring.fds)

    def produce(value, seq):
        slot = ring.claim()
        writer.memory(slot).write(0, bytes([value]) * 8)
        writer.publish(slot, seq, 0, 0)

    produce(1, 1)
    produce(2, 2)
    kept, dropped = ring.acquire(), ring.acquire()
    gc.disable()
    try:
        gc.collect()
        cycle = [dropped]  # a lease only the garbage collector frees
        cycle.append(cycle)
        del cycle, dropped
        gc.set_threshold(threshold)
        gc.enable()
        ring.privatize_held()
    finally:
        gc.set_threshold(700)
        gc.enable()
    gc.collect()
    produce(9, 3)
    assert ring.acquire().read(0, 8) == bytes([9]) * 8
    del kept


def test_claim_exhausts_then_none(ring):
    slots = [ring.claim() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert ring.claim() is None
    ring.abandon(slots[2])
    assert ring.claim() == slots[2]


def test_lease_lives_as_long_as_tensor_views(ring):
    slot = ring.claim()
    ring.publish(slot, 7, 0, 0)
    lease = ring.acquire()
    view = torch.frombuffer(lease, dtype=torch.uint8)[100:200]
    del lease
    assert ring.slot_state(slot) == _ring.READING
    view.fill_(3)
    del view
    assert ring.slot_state(slot) == _ring.FREE


def test_memory_bounds_checked(ring):
    mem = ring.memory(0)
    with pytest.raises(ValueError):
        mem.write(ring.slot_bytes - 1, b"xx")
    with pytest.raises(ValueError):
        mem.read(ring.slot_bytes, 1)
    with pytest.raises(IndexError):
        ring.memory(4)


def test_wait_times_out_and_wakes_on_fd(ring):
    assert ring.wait(0.05) is None
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        assert ring.wait(5, [r]) == [r]
    finally:
        os.close(r)
        os.close(w)


def test_wait_reports_fds_even_with_a_slot_ready(ring):
    """A READY slot ends the wait at once, but the fds are still looked at: a
    caller waiting for a pipe message (a failed row's error) must see it
    rather than spin on the READY slot."""
    slot = ring.claim()
    ring.publish(slot, 1, 0, 0)
    r, w = os.pipe()
    try:
        assert ring.wait(5, [r]) == []
        os.write(w, b"x")
        assert ring.wait(5, [r]) == [r]
    finally:
        os.close(r)
        os.close(w)


def test_a_memfd_rings_size_is_sealed_and_only_its_owner_may_map_it():
    """No process holding the fd can truncate the ring under the others (a SIGBUS in
    whoever touches the lost pages), nor grow it; only this user can open it."""
    ring = Ring.create_memfd("shmloader-test", 2, 4096)
    fd = ring.fds[0]
    assert (
        fcntl.fcntl(fd, fcntl.F_GET_SEALS) & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    )
    for size in (0, ring.total_bytes - 4096, ring.total_bytes + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    assert os.fstat(fd).st_mode & 0o777 == 0o600
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:shmloader-test")
    os.fchmod(fd, 0o640)
    with pytest.raises(PermissionError):
        Ring.attach(*ring.fds)


def test_create_too_large_fails_and_leaves_nothing():
    before = _our_names()
    with pytest.raises(OSError) as e:
        Ring.create_memfd("shmloader-test", 2, 1 << 50)
    assert e.value.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
    with pytest.raises(OSError) as e:
        Ring.create_in("/dev/shm", 2, 1 << 50)
    assert e.value.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)
    assert _our_names() == before


def test_bad_geometry_rejected():
    with pytest.raises(OSError) as e:
        Ring.create_in("/dev/shm", 0, 100)
    assert e.value.errno == errno.EINVAL


def test_attach_verifies_header(tmp_path):
    # A file of the right owner and mode that is not a ring.
    path = tmp_path / "not-a-ring"
    path.write_bytes(b"\0" * 8192)
    os.chmod(path, 0o600)
    fd = os.open(path, os.O_RDWR)
    efd = os.eventfd(0)
    try:
        with pytest.raises(OSError) as e:
            Ring.attach(fd, efd)
        assert e.value.errno == errno.EBADMSG
        os.chmod(path, 0o644)
        with pytest.raises(PermissionError):
            Ring.attach(fd, efd)
    finally:
        os.close(fd)
        os.close(efd)


def test_attach_sees_same_bytes(ring):
    fd, efd = ring.fds
    other = Ring.attach(fd, efd)
    slot = ring.claim()
    ring.memory(slot).write(8, b"shared")
    assert other.memory(slot).read(8, 6) == b"shared"
    assert other.slot_state(slot) == _ring.CLAIMED


# ---- stress: several producer processes, one consumer, checksummed payloads ----

ROUNDS = 20000
PRODUCERS = 3


def _payload(seq: int, size: int) -> bytes:
    return random.Random(seq).randbytes(size)


def _producer(fd, efd, tasks, seed):
    ring = Ring.attach(fd, efd)
    rnd = random.Random(seed)
    while True:
        task = tasks.recv()
        if task is None:
            return
        seq, slot = task
        size = rnd.randrange(1, 3000)
        data = _payload(seq, size)
        mem = ring.memory(slot)
        mem.write(0, data)
        header = f"{size}:{zlib.crc32(data)}".encode()
        mem.write(4096, header)
        if rnd.random() < 0.01:
            os.sched_yield()
        ring.publish(slot, seq, 4096, len(header))


@pytest.mark.slow
def test_stress_many_processes_every_payload_checked():
    ring = Ring.create_in("/dev/shm", 8, 8192)
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for i in range(PRODUCERS):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_producer, args=(*ring.fds, child, i), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    sent = received = 0
    outstanding = {}
    try:
        while received < ROUNDS:
            while sent < ROUNDS and (slot := ring.claim()) is not None:
                pipes[sent % PRODUCERS].send((sent, slot))
                outstanding[sent] = slot
                sent += 1
            lease = ring.acquire()
            if lease is None:
                assert ring.wait(30, [p.sentinel for p in procs]) == [], "a producer died"
                continue
            assert outstanding.pop(lease.seq) == lease.slot
            size, crc = map(int, lease.meta().split(b":"))
            data = lease.read(0, size)
            assert zlib.crc32(data) == crc
            assert data == _payload(lease.seq, size)
            lease.release()
            received += 1
        assert not outstanding
        assert all(ring.slot_state(i) == _ring.FREE for i in range(ring.nslots))
    finally:
        for pipe in pipes:
            pipe.send(None)
        for p in procs:
            p.join(60)  # (a bound on a hang: they exit at once, later on a loaded machine)
            assert p.exitcode == 0


# Header fields, at the offsets drawn in csrc/shmring.c: magic u64 @0, version u32 @8,
# nslots u32 @12, ..., owner_uid u32 @40.
@pytest.mark.parametrize(
    "offset,value,err",
    [
        (0, b"NOTARING", errno.EBADMSG),
        (8, (99).to_bytes(4, "little"), errno.EPROTO),
        (12, (5).to_bytes(4, "little"), errno.EBADMSG),
        (40, (os.geteuid() + 1).to_bytes(4, "little"), errno.EPERM),
    ],
)
def test_attach_rejects_tampered_header(offset, value, err):
    ring = Ring.create_in("/dev/shm", 4, 10000)
    fd, efd = ring.fds
    os.pwrite(fd, value, offset)
    with pytest.raises(OSError) as e:
        Ring.attach(fd, efd)
    assert e.value.errno == err


def test_slot_size_that_would_wrap_is_refused():
    with pytest.raises(OSError) as e:
        Ring.create_in("/dev/shm", 2, 2**64 - 1)
    assert e.value.errno == errno.EOVERFLOW


def test_segment_is_private_to_its_user(ring):
    st = os.fstat(ring.fds[0])
    assert st.st_uid == os.geteuid()
    assert st.st_mode & 0o777 == 0o600


def test_a_forked_child_dropping_a_lease_leaves_the_slot_to_its_owner():
    """A worker forked while the main process holds batches inherits copies of their
    leases; when the child drops them (exit, garbage collection) the parent's slot must
    stay taken, or the parent's batch could be overwritten."""
    import gc

    ring = Ring.create_in("/dev/shm", 2, 4096)
    slot = ring.claim()
    ring.publish(slot, 1, 0, 0)
    lease = ring.acquire()
    view = torch.frombuffer(lease, dtype=torch.uint8)
    pid = os.fork()
    if pid == 0:
        del view, lease
        gc.collect()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert ring.slot_state(slot) == _ring.READING
    del view, lease
    gc.collect()
    assert ring.slot_state(slot) == _ring.FREE


def test_misaligned_slot_reference_is_refused():
    """Found by the decoder fuzz: a complex128 view at an odd offset made torch's vector
    loads fault.  A reference off its dtype's alignment is an error, not a view."""
    from shmloader._shm import _layout

    ring = Ring.create_in("/dev/shm", 1, 4096)
    slot = ring.claim()
    ring.publish(slot, 1, 0, 0)
    lease = ring.acquire()
    bad = _layout.dumps(
        [torch.zeros(1, dtype=torch.complex128)],
        lambda leaves: [("t", 1, torch.complex128, (1,), (1,), 1, False, None)],
        1,
    )
    with pytest.raises(pickle.UnpicklingError, match="not aligned"):
        _layout.loads(bad, lease)
    good = _layout.dumps(
        [torch.zeros(1, dtype=torch.complex128)],
        lambda leaves: [("t", 64, torch.complex128, (1,), (1,), 1, False, None)],
        1,
    )
    assert _layout.loads(good, lease)[0][0].dtype == torch.complex128


def test_leaves_sharing_a_storage_reference_share_it_and_stay_inside_it():
    """References naming one (offset, size) storage decode to views of one storage object;
    a reference reaching past that storage, or before it, or a storage past the slot, is an
    error, not a read."""
    from shmloader._shm import _layout

    ring = Ring.create_in("/dev/shm", 1, 4096)
    slot = ring.claim()
    ring.publish(slot, 1, 0, 0)
    lease = ring.acquire()

    def decode(*refs):
        return _layout.loads(
            _layout.dumps(
                [torch.zeros(1) for _ in refs],
                lambda leaves: [
                    ("t", off, torch.float32, shape, (1,), shape[0], False, storage)
                    for off, shape, storage in refs
                ],
                1,
            ),
            lease,
        )[0]

    a, b = decode((64, (8,), (64, 32)), (80, (4,), (64, 32)))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert (a.untyped_storage().nbytes(), a.storage_offset(), b.storage_offset()) == (32, 0, 4)
    b.fill_(7)
    assert a[4:].tolist() == [7.0] * 4
    for refs in [[(80, (8,), (64, 32))], [(60, (1,), (64, 32))], [(4092, (1,), (4090, 8))]]:
        with pytest.raises((pickle.UnpicklingError, RuntimeError, ValueError)):
            decode(*refs)
    for storage in [[64, 32], {64: 32}, (64,), (64, -1), (64.0, 32)]:
        with pytest.raises(pickle.UnpicklingError, match="is not \\(offset, size\\)"):
            decode((64, (1,), storage))


@pytest.mark.parametrize("alone", [True, False], ids=["copy", "view"])
def test_small_leaf_reference_reads_only_its_slot(alone):
    """A small leaf alone on its bytes is copied out of its slot, and a leaf sharing them is
    a view: either holds the slot's bytes, and a reference reaching past the slot is an
    error, not a read."""
    from shmloader._shm import _layout

    ring = Ring.create_in("/dev/shm", 1, 4096)
    slot = ring.claim()
    ring.publish(slot, 1, 0, 0)
    lease = ring.acquire()
    np.frombuffer(lease, dtype=np.uint8)[:] = np.arange(4096) % 251

    def meta(offset):
        return _layout.dumps(
            [torch.zeros(1)],
            lambda leaves: [
                ("t", offset, torch.uint8, (2, 4), (1, 2), 8, False, None if alone else (offset, 8))
            ],
            1,
        )

    leaf = _layout.loads(meta(64), lease)[0][0]
    assert leaf.stride() == (1, 2)
    assert leaf.flatten().tolist() == [(64 + 2 * j + i) % 251 for i in range(2) for j in range(4)]
    start = ring.data_address
    assert (start <= leaf.data_ptr() < start + ring.data_bytes) == (not alone)
    with pytest.raises(ValueError):
        _layout.loads(meta(4090), lease)

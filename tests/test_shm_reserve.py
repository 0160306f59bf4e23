"""Ring memory is reserved slot by slot, by a slot's first writer: a new ring
reserves its header only (after checking that /dev/shm has room for all of
it), and a /dev/shm that fills up after that is a clear fallback or error,
never a SIGBUS."""
import os
import subprocess
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader, SharedMemoryError
from shmloader._ring import Ring
from tests.datasets_lifecycle import Images
from tests.procs import deadline

SLOT = 1 << 20


def _reserved_bytes(ring) -> int:
    return os.fstat(ring.fds[0]).st_blocks * 512


def test_new_ring_reserves_its_header_only_and_slots_on_request():
    ring = Ring.create_in("/dev/shm", 4, SLOT)
    header = _reserved_bytes(ring)
    assert header < SLOT
    ring.reserve(2)
    assert _reserved_bytes(ring) == header + SLOT
    ring.reserve(2)  # once per slot
    assert _reserved_bytes(ring) == header + SLOT
    ring.reserve_all()
    assert _reserved_bytes(ring) == header + 4 * SLOT
    with pytest.raises(OSError):
        ring.reserve(4)


def test_a_slot_reserved_in_one_process_is_reserved_for_all():
    ring = Ring.create_in("/dev/shm", 2, SLOT)
    other = Ring.attach(*ring.fds)
    other.reserve(1)
    header = _reserved_bytes(ring) - SLOT
    ring.reserve(1)  # seen as done: no second reservation
    ring.reserve(0)
    assert _reserved_bytes(ring) == header + 2 * SLOT


def test_loader_reserves_the_rest_of_its_ring_after_its_first_batches():
    """Before the first batch only the slots being written are reserved (at most
    the 2 batches in flight, of 24 slots); soon after the second, all of them, so
    that a loader made later sees what this one takes."""
    loader = DataLoader(Images(64, shape=(3, 64, 64)), batch_size=4, num_workers=1,
                        prefetch_factor=2, num_slots=24, slot_bytes=SLOT,
                        persistent_workers=True)
    it = iter(loader)
    assert _reserved_bytes(it._ring) <= 3 * SLOT
    assert [next(it)[0, 0, 0, 0].item() for _ in range(2)] == [0, 4]
    with deadline(30):
        while _reserved_bytes(it._ring) < 24 * SLOT:
            time.sleep(0.01)
    assert [b[0, 0, 0, 0].item() for b in it] == list(range(8, 64, 4))


@pytest.fixture(scope="module")
def no_room_preload(tmp_path_factory):
    """A library that makes every posix_fallocate fail with ENOSPC, as on a
    /dev/shm that filled up after the ring was made; preloaded into spawned
    workers only (the main process has made its ring already)."""
    folder = tmp_path_factory.mktemp("preload")
    source = folder / "no_room.c"
    source.write_text(
        "#include <errno.h>\n#include <sys/types.h>\n"
        "int posix_fallocate(int fd, off_t offset, off_t len) { return ENOSPC; }\n"
        "int posix_fallocate64(int fd, off_t offset, off_t len) { return ENOSPC; }\n")
    library = folder / "no_room.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return str(library)


@pytest.mark.parametrize("fetch", ["batch", "sample"])
def test_dev_shm_full_after_start_is_each_batch_error_and_loader_goes_on(monkeypatch,
                                                                       no_room_preload, fetch):
    """Like torch on a full /dev/shm (its transport needs it too): each batch
    raises, clearly, and the loader itself keeps working once there is room."""
    loader = DataLoader(Images(24), batch_size=4, num_workers=2, slot_bytes=SLOT, fetch=fetch,
                        multiprocessing_context="spawn")
    monkeypatch.setenv("LD_PRELOAD", no_room_preload)
    it = iter(loader)  # spawns the workers with it
    monkeypatch.delenv("LD_PRELOAD")
    with deadline(60):  # a failed row's errors once spun forever past a READY slot
        for _ in range(4):
            with pytest.raises(SharedMemoryError, match=r"could not reserve .*--shm-size"):
                next(it)
    del it
    want = list(tud.DataLoader(Images(24), batch_size=4))
    got = list(loader)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))

"""Ring memory is reserved slot by slot, by a slot's first writer: a new ring
reserves its header only (after checking that /dev/shm has room for all of
it), and a /dev/shm that fills up after that is a clear fallback or error,
never a SIGBUS."""

import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader, SharedMemoryError
from shmloader._shm._ring import Ring
from tests.helpers import ROOT
from tests.helpers.datasets import Images
from tests.helpers.procs import HANG_TIMEOUT_S, deadline, preload_library

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
    loader = DataLoader(
        Images(64, shape=(3, 64, 64)),
        batch_size=4,
        num_workers=1,
        prefetch_factor=2,
        num_slots=24,
        slot_bytes=SLOT,
        persistent_workers=True,
    )
    it = iter(loader)
    assert _reserved_bytes(it._ring) <= 3 * SLOT
    assert [next(it)[0, 0, 0, 0].item() for _ in range(2)] == [0, 4]
    with deadline(120):  # (a background thread's work: a bound on a hang)
        while _reserved_bytes(it._ring) < 24 * SLOT:
            time.sleep(0.01)
    assert [b[0, 0, 0, 0].item() for b in it] == list(range(8, 64, 4))


@pytest.fixture(scope="module")
def no_room_preload(tmp_path_factory):
    """A library that makes every posix_fallocate fail with ENOSPC, as on a
    /dev/shm that filled up after the ring was made; preloaded into spawned
    workers only (the main process has made its ring already)."""
    return preload_library(
        tmp_path_factory.mktemp("preload"),
        "no_room",
        "#include <errno.h>\n#include <sys/types.h>\n"
        "int posix_fallocate(int fd, off_t offset, off_t len) { return ENOSPC; }\n"
        "int posix_fallocate64(int fd, off_t offset, off_t len) { return ENOSPC; }\n",
    )


@pytest.mark.slow
@pytest.mark.parametrize("fetch", ["batch", "sample"])
def test_dev_shm_full_after_start_is_each_batch_error_and_loader_goes_on(
    monkeypatch, no_room_preload, fetch
):
    """Like torch on a full /dev/shm (its transport needs it too): each batch
    raises, clearly, and the loader itself keeps working once there is room."""
    loader = DataLoader(
        Images(24),
        batch_size=4,
        num_workers=2,
        slot_bytes=SLOT,
        fetch=fetch,
        multiprocessing_context="spawn",
    )
    monkeypatch.setenv("LD_PRELOAD", no_room_preload)
    it = iter(loader)  # spawns the workers with it
    monkeypatch.delenv("LD_PRELOAD")
    # A failed row's errors once spun forever past a READY slot.  (The bound includes the
    # spawned workers' start, which imports torch: long on a loaded machine.)
    with deadline(120):
        for _ in range(4):
            with pytest.raises(SharedMemoryError, match=r"could not reserve .*memory ran out"):
                next(it)
    del it
    want = list(tud.DataLoader(Images(24), batch_size=4))
    got = list(loader)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def _page_rounded(n):
    page = os.sysconf("SC_PAGESIZE")
    return -(-n // page) * page


def _epochs(loader, epochs=2):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.slow
@pytest.mark.parametrize("fetch", ["batch", "sample"])
def test_a_default_ring_short_of_memory_shrinks_and_every_batch_comes(monkeypatch, fetch):
    """Memory (here SHMLOADER_SHM_LIMIT) for 7 of the default ring's 8 slots (2 workers,
    prefetch 2): a ring of 7; it says so once, and the batches are torch's."""
    from shmloader._worker._state import STATE_BYTES  # (a slot's room for a worker's state)

    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(7 * _page_rounded(SLOT + STATE_BYTES)))
    kw = dict(batch_size=4, num_workers=2)
    want = _epochs(tud.DataLoader(Images(64), **kw))
    loader = DataLoader(Images(64), slot_bytes=SLOT, fetch=fetch, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _epochs(loader) == want
    messages = [str(w.message) for w in caught if "shmloader" in str(w.message)]
    assert len(messages) == 1 and "its ring has 7 of them" in messages[0], messages
    assert "SHMLOADER_SHM_LIMIT" in messages[0] and "num_slots=" in messages[0]
    stats = loader.stats()
    assert stats.ring_slots == 7 and stats.slot_batches > 0


@pytest.mark.parametrize(
    "slot_bytes, limit", [(None, 100_000), (SLOT, 3 * SLOT)], ids=["learned", "users"]
)
def test_memory_short_of_the_batches_in_flight_is_an_error_naming_the_bytes(
    monkeypatch, slot_bytes, limit
):
    """Memory for fewer slots than the batches in flight, the loop's and the one yielded:
    a SharedMemoryError when the ring would be made, naming the bytes needed and the room,
    and what to change; never a SIGBUS or an OOM kill later."""
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(limit))
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, slot_bytes=slot_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SharedMemoryError) as e:
            list(loader)
    assert re.search(
        r"needs \d+ bytes of shared memory for its ring \(8 slots x \d+ bytes\) "
        r"but SHMLOADER_SHM_LIMIT=\d+ caps a ring",
        str(e.value),
    ), str(e.value)
    assert "num_slots" in str(e.value)


def test_the_ring_full_warning_still_comes_after_an_epoch_short_of_memory(monkeypatch):
    """The smaller-ring warning stands in for the ring-full one only while the ring is
    smaller: a later whole ring that the loop fills says so."""
    from shmloader._worker._state import STATE_BYTES

    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(7 * _page_rounded(SLOT + STATE_BYTES)))
    loader = DataLoader(
        Images(64, shape=(3, 64, 64)), batch_size=4, num_workers=2, slot_bytes=SLOT
    )  # (batches too big to be copied out of their slots)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _epochs(loader, 1)
        monkeypatch.delenv("SHMLOADER_SHM_LIMIT")
        kept = list(loader)  # every batch kept: the whole ring fills
    messages = [str(w.message) for w in caught if "shmloader" in str(w.message)]
    assert len(messages) == 2 and "its ring has 7" in messages[0], messages
    assert "ring slots are in use" in messages[1]
    assert len(kept) == 16


def test_a_ring_of_the_users_slot_size_that_cannot_have_one_slot_is_an_error(monkeypatch):
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(SLOT // 2))
    with pytest.raises(SharedMemoryError, match="SHMLOADER_SHM_LIMIT"):
        iter(DataLoader(Images(8), batch_size=4, num_workers=2, slot_bytes=SLOT))


def test_memory_is_checked_against_the_memory_cgroup(monkeypatch, tmp_path):
    """The room is the tightest of MemAvailable and each memory cgroup's limit less its
    usage, read from a cgroup tree like the kernel's (v2 here, v1 in the next test); the
    page cache in that usage (file LRU lists, not shmem) counts as room."""
    from shmloader._shm import _memory

    group = tmp_path / "kubepods" / "pod1"
    group.mkdir(parents=True)
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "kubepods" / "memory.max").write_text("max\n")
    (tmp_path / "kubepods" / "memory.current").write_text("5000\n")
    (group / "memory.max").write_text(f"{300 << 20}\n")
    (group / "memory.current").write_text(f"{150 << 20}\n")
    (group / "memory.stat").write_text(
        f"anon {90 << 20}\nfile {60 << 20}\nshmem {10 << 20}\n"
        f"inactive_file {30 << 20}\nactive_file {20 << 20}\nunevictable 0\n"
    )
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(_memory, "_cgroup_lines", lambda: ["0::/kubepods/pod1"])
    room, words = _memory.available()
    assert room == 200 << 20 and str(group) in words and f"{300 << 20}" in words
    assert f"{50 << 20} of that page cache" in words
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, slot_bytes=64 << 20)
    with pytest.raises(SharedMemoryError, match=f"the memory cgroup {group} has {200 << 20} "):
        iter(loader)


def test_memory_is_checked_against_a_v1_memory_cgroup(monkeypatch, tmp_path):
    from shmloader._shm import _memory

    group = tmp_path / "memory" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (group / "memory.usage_in_bytes").write_text(f"{62 << 20}\n")
    (group / "memory.stat").write_text(
        f"cache {3 << 20}\ninactive_file {1 << 20}\ntotal_cache {3 << 20}\n"
        f"total_inactive_file {1 << 20}\ntotal_active_file {1 << 20}\n"
    )
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text("1\n")
    monkeypatch.setattr(_memory, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(_memory, "_cgroup_lines", lambda: ["4:memory:/docker/abc", "1:cpu:/x"])
    assert _memory.available()[0] == 4 << 20


@pytest.mark.parametrize("limit", ["-5", "abc", "1e6"])
def test_a_limit_that_is_not_a_number_of_bytes_is_an_error(monkeypatch, limit):
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", limit)
    with pytest.raises(
        ValueError, match=f"SHMLOADER_SHM_LIMIT should be a number of bytes.*{limit}"
    ):
        iter(DataLoader(Images(8), batch_size=4, num_workers=2, slot_bytes=SLOT))


SMALL_DEV_SHM_SCRIPT = """
import sys, warnings
import torch
from torch.utils.data import DataLoader as TorchLoader
from shmloader import DataLoader
from tests.helpers.datasets import Images

warnings.simplefilter("ignore")
# 4.7 MB batches in a 64 MB /dev/shm, as Docker's default: a training loader alive
# throughout (its ring kept between epochs), a validation loader after each epoch.
kw = dict(batch_size=32, num_workers=2, persistent_workers=PERSISTENT)
def loaders(make):
    return (make(Images(512, shape=(3, 224, 224)), shuffle=True,
                 generator=torch.Generator().manual_seed(0), **kw),
            make(Images(192, shape=(3, 224, 224)), **kw))
def sums(loader):
    return [b.sum().item() for b in loader]
def run(make):
    train, val = loaders(make)
    return [(sums(train), sums(val)) for epoch in range(3)], train
want, _ = run(TorchLoader)  # (first: torch's own batches need room too)
got, train = run(DataLoader)
ok = got == want
print("same as torch" if ok else "differs", train.stats().slot_batches, flush=True)
"""


NEW_LOADER_AFTER_TRAINING_SCRIPT = """
import torch
from shmloader import DataLoader
from tests.helpers.datasets import Images

# 9.6 MB batches in a 64 MB /dev/shm: after two epochs of training, a new loader (an
# evaluation) whose first batches travel outside the ring while its ring is sized.
train = DataLoader(Images(256, shape=(3, 224, 224)), batch_size=64, num_workers=2)
for epoch in range(2):
    for batch in train:
        pass
    del batch
test = DataLoader(Images(256, shape=(3, 224, 224)), batch_size=64, num_workers=2)
print(sum(b.sum().item() for b in test) == sum(Images(256, shape=(3, 224, 224))[i].sum().item()
                                          for i in range(256)))
"""


def _run_in_a_64_mb_dev_shm(script):
    """`python -c script` from the repository's root, in a private mount namespace with a
    64 MB /dev/shm (as Docker's default); the test skips where this machine does not
    allow that (not root, no unshare)."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip("needs `unshare -m` and mount (root) for a private 64 MB /dev/shm")
    command = f'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c "$0"'
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["non_persistent", "persistent"])
def test_train_and_validation_loaders_in_a_64_mb_dev_shm(persistent):
    """Docker's default /dev/shm, a training loader alive throughout and a validation
    loader after each epoch: the same batches as torch's, whose loaders run there too (the
    rings live in memfd memory, beside /dev/shm)."""
    out = _run_in_a_64_mb_dev_shm(SMALL_DEV_SHM_SCRIPT.replace("PERSISTENT", str(persistent)))
    assert out[:3] == ["same", "as", "torch"], out
    assert int(out[3]) > 0  # the training loader had a ring


@pytest.mark.slow
def test_a_new_loader_after_training_in_a_64_mb_dev_shm():
    """A loader made after another's epochs (an evaluation), in Docker's default
    /dev/shm: its first batches, which size its ring, need none of it."""
    assert _run_in_a_64_mb_dev_shm(NEW_LOADER_AFTER_TRAINING_SCRIPT) == ["True"]


REAL_CGROUP_SCRIPT = """
import os, sys
from shmloader import DataLoader
from shmloader._shm import _memory
from tests.helpers.datasets import Images

# Fill this cgroup to its limit with page cache: a dataset's files, read once.
block = os.urandom(1 << 20)
with open(sys.argv[1], "wb") as f:
    for _ in range(768):
        f.write(block)
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 20):
        pass
room, words = _memory.available()
loader = DataLoader(Images(64, shape=(3, 64, 64)), batch_size=8, num_workers=2,
                    slot_bytes=4 << 20, num_slots=8)
print(sum(int(b.sum()) for b in loader), room >> 20, words, flush=True)
"""


@pytest.mark.slow
def test_page_cache_in_a_real_memory_cgroup_leaves_room_for_the_ring(tmp_path):
    """A training process in a real memory cgroup (640 MB, as a container's) whose usage
    is mostly the page cache of the files it read still gets its 32 MB ring: the kernel
    drops that cache for it.  (Counted as used, the room was near 0: SharedMemoryError.)"""
    from shmloader._shm import _memory

    dirs = [(version, mount, path) for version, mount, path in _memory._cgroup_dirs()]
    if not dirs or os.geteuid() != 0:
        pytest.skip("needs root and a memory cgroup hierarchy")
    version, mount, path = dirs[0]
    group = os.path.join(mount, path, f"shmloader-test-{os.getpid()}")
    limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    try:
        os.mkdir(group)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        with open(os.path.join(group, limit_file), "w") as f:
            f.write(str(640 << 20))
        join = f'echo $$ > {os.path.join(group, "cgroup.procs")} && exec "$0" "$@"'
        out = subprocess.run(
            ["sh", "-c", join, sys.executable, "-c", REAL_CGROUP_SCRIPT, str(tmp_path / "data")],
            capture_output=True,
            text=True,
            timeout=HANG_TIMEOUT_S,
            cwd=ROOT,
        )
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
        total, room_mb, words = out.stdout.split(" ", 2)
        want = sum(
            int(b.sum())
            for b in torch.utils.data.DataLoader(Images(64, shape=(3, 64, 64)), batch_size=8)
        )
        assert int(total) == want and int(room_mb) >= 64, words
    finally:
        os.rmdir(group)


def test_two_iterators_of_a_loader_retire_the_ring_not_kept_as_spare():
    """Two live iterators of one non-persistent loader (it1 = iter(loader); it2 =
    iter(loader)) each make a ring, and the loader keeps one for its next iterator: the one
    whose slots the kept batches hold (its memory stays either way).  The other is retired:
    its free slots give their memory back (once, the second ring handed back replaced the
    first unretired, and batches kept from it held its whole reserved ring)."""
    loader = DataLoader(
        Images(64, shape=(3, 64, 64)), batch_size=4, num_workers=1, slot_bytes=SLOT
    )  # (batches too big to be copied out of their slots)
    for keep_from_first in (True, False):
        it1, it2 = iter(loader), iter(loader)
        rings = [it1._ring, it2._ring]
        assert rings[0] is not rings[1]
        kept = [next(it1 if keep_from_first else it2) for _ in range(2)]
        next(it2 if keep_from_first else it1)
        for ring in rings:
            ring.reserve_all()  # what the background reservation does after the first batches
            assert _reserved_bytes(ring) >= ring.nslots * SLOT
        del it1, it2
        holding, other = rings if keep_from_first else rings[::-1]
        assert loader._ring_handover.spare_ring is holding
        assert _reserved_bytes(other) < SLOT, "the ring not kept kept its memory"
        assert _reserved_bytes(holding) >= holding.nslots * SLOT
        assert [b[0, 0, 0, 0].item() for b in kept] == [0, 4]
        del kept, ring, rings, holding, other


def test_a_ring_made_smaller_for_want_of_memory_is_reused_while_memory_stays_short(monkeypatch):
    """Memory for 7 of the default ring's 8 slots: each epoch of a non-persistent loader
    takes the 7-slot ring the last one handed back, as it takes a whole ring, rather than
    retiring it and making (and prefaulting) the same again; once memory holds the whole
    ring, the next epoch makes it."""
    from shmloader._worker._state import STATE_BYTES

    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(7 * _page_rounded(SLOT + STATE_BYTES)))
    loader = DataLoader(Images(32, shape=(3, 64, 64)), batch_size=4, num_workers=2, slot_bytes=SLOT)
    want = [[b.sum().item() for b in tud.DataLoader(Images(32, shape=(3, 64, 64)), batch_size=4)]]
    rings = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the smaller ring's, once)
        for epoch in range(3):
            assert [[b.sum().item() for b in loader]] == want
            rings.append(loader._ring_handover.spare_ring)
        assert rings[0].nslots == 7
        assert rings[1] is rings[0] and rings[2] is rings[0], "a new ring each epoch"
        monkeypatch.delenv("SHMLOADER_SHM_LIMIT")
        assert [[b.sum().item() for b in loader]] == want
    assert loader._ring_handover.spare_ring.nslots == 8

"""Where training runs: a container's small /dev/shm (Docker's and Kubernetes' 64 MB
default, 1 MB, or a read-only one, as on AWS Lambda).  Each test runs a child process in
a private mount namespace whose /dev/shm is a real tmpfs of that kind; the ring lives in
memfd memory, so every batch that goes through it needs no byte of /dev/shm.  The tests
skip, saying why, where the namespace cannot be made (not root, no unshare)."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import alive, preload_library, wait_until

# What every script starts with: torch's batches to compare against (num_workers=0:
# torch's own loader needs no shared memory then), and a check that nothing of ours was
# left in /dev/shm.
PRELUDE = """
import os, sys
import torch
from torch.utils.data import DataLoader as TorchLoader
from shmloader import DataLoader
from tests.helpers.datasets import Images

def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

def done(ok, loader):
    stats = loader.stats()
    assert "memfd" in stats.ring_memory, stats.ring_memory
    if os.path.exists("/dev/shm"):
        assert os.listdir("/dev/shm") == [], os.listdir("/dev/shm")
    print("ok" if ok else "differs", stats.slot_batches, stats.batches, flush=True)
"""

# How each kind of /dev/shm is made, in the namespace, before the script runs: a small
# tmpfs, a read-only one, or none at all (a tmpfs over /dev holding the few devices
# Python uses, and no shm: AWS Lambda has none).
SHM_KINDS = {
    "1m": "mount -t tmpfs -o size=1m tmpfs /dev/shm",
    "read-only": "mount -t tmpfs -o ro,size=1m tmpfs /dev/shm",
    "missing": "mkdir -p /run/shmloader-dev && mount --bind /dev /run/shmloader-dev && "
    "mount -t tmpfs -o size=1m,mode=755 tmpfs /dev && "
    "for n in null zero full random urandom; do touch /dev/$n && "
    "mount --bind /run/shmloader-dev/$n /dev/$n || exit 1; done && "
    "ln -s /proc/self/fd /dev/fd && umount -l /run/shmloader-dev",
    "64m": "mount -t tmpfs -o size=64m tmpfs /dev/shm",
    "roomy": "mount -t tmpfs tmpfs /dev/shm",
}


def run_with_dev_shm(kind: str, script: str, timeout: float = 600, env=None):
    """`python -c PRELUDE + script` from the repository's root, in a private mount
    namespace whose /dev/shm is of `kind` (see SHM_KINDS), with environment `env`."""
    setup = SHM_KINDS[kind]
    probe = subprocess.run(["unshare", "-m", "sh", "-c", setup], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            f"needs `unshare -m` and mount (root) for a private /dev/shm "
            f"({probe.stderr.decode().strip()})"
        )
    command = f'{setup} && exec {sys.executable} -c "$0"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", command, PRELUDE + script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _output(done):
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


SMALL = ["1m", "read-only", "missing"]
LARGE = 3 * 224 * 224  # bytes of one uint8 image


@pytest.mark.slow
@pytest.mark.one_mode  # names its start method; where the ring's memory lives
@pytest.mark.parametrize("shm", SMALL)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_ring_batches_need_no_dev_shm(shm, context):
    """slot_bytes given: every batch, from the first, goes through the ring, so a 1 MB,
    read-only or missing /dev/shm changes nothing (torch's loader with workers fails in
    each)."""
    script = f"""
if __name__ == "__main__":
    data = Images(48, shape=(3, 224, 224))
    loader = DataLoader(data, batch_size=16, num_workers=2, slot_bytes=16 * {LARGE} + 65536,
                        persistent_workers=True, multiprocessing_context="{context}")
    want = list(TorchLoader(data, batch_size=16))
    ok = all(same([b.clone() for b in loader], want) for epoch in range(2))
    done(ok, loader)
"""
    assert _output(run_with_dev_shm(shm, script)) == ["ok", "6", "6"]


OUTSIDE_THE_RING_SCRIPT = """
import warnings
from tests.helpers.datasets import Buckets
warnings.simplefilter("ignore")
if __name__ == "__main__":
    data = Images(200, shape=(3, 64, 64))
    want = list(TorchLoader(data, batch_size=4))
    # slot_bytes=None: the first batches size the ring; then the loop keeps an epoch's 50
    # batches, beyond a ring of 6 slots.
    loader = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True,
                        num_slots=6, multiprocessing_context="CONTEXT")
    ok = same([b.clone() for b in loader], want)
    kept = list(loader)
    stats = loader.stats()
    assert stats.unsized_batches >= 1 and stats.ring_full_batches >= 50 - 6, stats
    # Slots for 4 samples: the buckets of 8 to 60 spill.
    buckets = DataLoader(data, batch_sampler=Buckets(), num_workers=2,
                         slot_bytes=4 * 3 * 64 * 64, multiprocessing_context="CONTEXT")
    ok = ok and same(kept, want) and same([b.clone() for b in buckets],
                                          list(TorchLoader(data, batch_sampler=Buckets())))
    assert buckets.stats().spilled_batches == 4, buckets.stats()
    done(ok, loader)
"""


@pytest.mark.parametrize(
    "shm, context", [("1m", "fork"), ("read-only", "forkserver"), ("missing", "spawn")]
)
@pytest.mark.slow
def test_batches_outside_the_ring_need_no_dev_shm(shm, context):
    """Batches before the ring is sized, larger than their slot, and while the loop holds
    every slot travel in one-off memfd segments: none of them needs /dev/shm."""
    out = _output(run_with_dev_shm(shm, OUTSIDE_THE_RING_SCRIPT.replace("CONTEXT", context)))
    assert out[0] == "ok" and out[2] == "100", out


@pytest.mark.slow
def test_large_batches_with_the_defaults_in_a_64_mb_dev_shm():
    """Docker's default /dev/shm and 38.5 MB batches (256 x uint8 3x224x224), as torch's
    loader fails there: with the defaults, three epochs of a persistent loader."""
    script = """
data = Images(768, shape=(3, 224, 224))
want = [b.sum().item() for b in TorchLoader(data, batch_size=256)]
loader = DataLoader(data, batch_size=256, num_workers=2, persistent_workers=True)
ok = all([b.sum().item() for b in loader] == want for epoch in range(3))
done(ok, loader)
"""
    out = _output(run_with_dev_shm("64m", script))
    assert out[0] == "ok" and out[2] == "9", out


@pytest.mark.slow
@pytest.mark.parametrize("shm", SMALL)
def test_sample_mode_resume_and_pinning_need_no_dev_shm(shm):
    """fetch="sample" sizes its ring from a probe, not from batches sent by torch's
    transport; a resumed loader and pin_memory=True (on the CPU: torch's own pinning) go
    through the ring alike."""
    script = """
import warnings
warnings.simplefilter("ignore")
data = Images(40, shape=(3, 64, 64))
want = list(TorchLoader(data, batch_size=4))
sample = DataLoader(data, batch_size=4, num_workers=2, fetch="sample")
assert same([b.clone() for b in sample], want), "fetch=sample"
first = DataLoader(data, batch_size=4, num_workers=2, slot_bytes=1 << 20)
it = iter(first)
[next(it) for _ in range(3)]
resumed = DataLoader(data, batch_size=4, num_workers=2, slot_bytes=1 << 20, pin_memory=True)
resumed.load_state_dict(first.state_dict())
del it
ok = same([b.clone() for b in resumed], want[3:])
done(ok, resumed)
"""
    assert _output(run_with_dev_shm(shm, script)) == ["ok", "7", "7"]


@pytest.mark.slow
def test_held_batches_beyond_the_ring_with_a_64_mb_dev_shm():
    """Docker's default: 9.6 MB batches with the defaults (the ring sized from the first
    batches, which torch's transport carries), three epochs of a persistent loader, and
    every batch of the last epoch kept: the slots fill, the rest come whole."""
    script = """
import warnings
warnings.simplefilter("ignore")
data = Images(320, shape=(3, 224, 224))
want = list(TorchLoader(data, batch_size=64))
loader = DataLoader(data, batch_size=64, num_workers=2, persistent_workers=True)
ok = all(same([b.clone() for b in loader], want) for epoch in range(2))
kept = list(loader)
done(ok and same(kept, want), loader)
"""
    out = _output(run_with_dev_shm("64m", script))
    assert out[0] == "ok" and int(out[1]) > 0 and out[2] == "15", out


KILLED_SCRIPT = f"""
if __name__ == "__main__":
    import time
    loader = DataLoader(Images(10_000, shape=(3, 224, 224)), batch_size=16, num_workers=2,
                        slot_bytes=16 * {LARGE} + 65536, persistent_workers=True)
    it = iter(loader)
    next(it)
    print(" ".join(str(p) for p in loader._iterator._pool.pids), flush=True)
    time.sleep(600)
"""


def _memfds(pid):
    """(st_dev, st_ino) of each shmloader memfd that process `pid` holds."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:shmloader"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                found.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_nothing_is_left_after_the_main_process_is_killed():
    """SIGKILL of the training process in a 1 MB /dev/shm: its workers exit, and no process
    keeps the ring's memfd alive (its memory goes with the last fd)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", SHM_KINDS["1m"]], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs `unshare -m` and mount (root) for a private /dev/shm")
    command = f'{SHM_KINDS["1m"]} && exec {sys.executable} -c "$0"'
    child = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", command, PRELUDE + KILLED_SCRIPT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [int(p) for p in child.stdout.readline().split()]
        ring = _memfds(child.pid)
        assert len(workers) == 2 and len(ring) == 1
        wait_until(
            lambda: all(_memfds(p) == ring for p in workers), 60, "every worker holds the ring"
        )
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        wait_until(lambda: not any(alive(p) for p in workers), 60, "the workers exited")
        holders = [p for p in os.listdir("/proc") if p.isdigit() and _memfds(p) & ring]
        assert holders == [], f"processes {holders} keep the killed loader's ring alive"
    finally:
        child.kill()
        child.wait()


@pytest.fixture(scope="module")
def memfd_refused(tmp_path_factory):
    """A library under which memfd_create fails as a seccomp filter or a kernel older
    than 3.17 makes it fail (ENOSYS)."""
    return preload_library(
        tmp_path_factory.mktemp("preload"),
        "no_memfd",
        "#include <errno.h>\n"
        "int memfd_create(const char *name, unsigned int flags) "
        "{ errno = ENOSYS; return -1; }\n",
    )


@pytest.mark.slow
def test_where_memfd_create_is_refused_rings_live_in_dev_shm(memfd_refused):
    """The fallback, in a /dev/shm of its own: rings and one-off segments in /dev/shm
    (unnamed: nothing left behind), batches equal to torch's, and stats() saying where
    and why."""
    script = """
data = Images(40, shape=(3, 32, 32))
loader = DataLoader(data, batch_size=4, num_workers=2, num_slots=6)
ok = all(torch.equal(a, b) for a, b in zip(list(loader), list(TorchLoader(data, batch_size=4))))
stats = loader.stats()
assert stats.ring_memory.startswith("/dev/shm (memfd_create refused: "), stats.ring_memory
assert stats.unsized_batches and stats.slot_batches, stats
print("ok" if ok else "differs", os.listdir("/dev/shm"))
"""
    out = _output(
        run_with_dev_shm("roomy", script, env={**os.environ, "LD_PRELOAD": memfd_refused})
    )
    assert out == ["ok", "[]"]

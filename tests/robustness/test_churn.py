"""Churn (docs/design.md, contract 5, "nothing leaks"): creating and dropping many
iterators, many loaders, and running many epochs of a persistent loader leaves the
main process where it started.

Watched, after gc.collect(), at regular samples over each run: open fds of this
process (/proc/self/fd), its live child processes (from /proc, less
multiprocessing's helpers), entries of ours in /dev/shm ("shmloader*"), mappings of
/dev/shm files in this process (a ring is an unnamed /dev/shm file: one leaked would
stay mapped even after its fds are closed), and RSS.  Tolerances: fds within +-2 of
the baseline, children back to the baseline, no /dev/shm entry, /dev/shm mappings
within +-1, RSS growth under 50 MB over the run.  The persistent-workers run
also checks that slots come back: with one batch held, no batch may find the ring
full (stats().ring_full_batches == 0).  The baseline is taken after a
short warm-up (the first iterators size the loader's ring and let torch and the
allocator settle).

fork and tiny datasets keep it short: an iterator with 2 workers costs ~30-50 ms
here (fork, worker start, shutdown and join), so the 1,000 iterators run with 2
workers (~50 s on 2 loaded cores); 200 loaders ~10 s; 100 epochs ~1 s.
"""

import gc
import os
import random
import time

import pytest

from shmloader import DataLoader
from tests.helpers.datasets import Images
from tests.helpers.procs import our_segments, own_children, rearm_hang_guard, wait_gone

# Slots coming back while a batch is held is part of what is watched: small leaves stay
# views.
pytestmark = pytest.mark.usefixtures("views_only")

PAGE = os.sysconf("SC_PAGE_SIZE")
FD_SLACK = 2
MAPS_SLACK = 1
RSS_GROWTH_MAX = 50 << 20


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _shm_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if " /dev/shm/" in line)


def _snapshot(children_baseline=None):
    gc.collect()
    if children_baseline is not None:
        # Shutdown joins its workers; allow anything slower the time a loaded machine takes.
        wait_gone(set(own_children()) - set(children_baseline), 60.0)
    return {
        "fds": _fds(),
        "children": own_children(),
        "segments": our_segments(),
        "shm_maps": _shm_maps(),
        "rss": _rss(),
    }


class _Watch:
    """Samples during a run, judged against the baseline at the end."""

    def __init__(self, what):
        self.what = what
        self.base = _snapshot()
        self.samples = []
        self.started = time.monotonic()

    def sample(self, step):
        rearm_hang_guard()  # the guard bounds each stretch between samples, not the whole run
        snap = _snapshot(self.base["children"])
        snap["step"] = step
        self.samples.append(snap)

    def check(self):
        base, problems = self.base, []
        for s in self.samples:
            where = f"after {s['step']} {self.what}"
            if abs(s["fds"] - base["fds"]) > FD_SLACK:
                problems.append(f"{where}: {s['fds']} fds, baseline {base['fds']}")
            if s["children"] != base["children"]:
                problems.append(f"{where}: children {s['children']}, baseline {base['children']}")
            if s["segments"]:
                problems.append(f"{where}: in /dev/shm: {s['segments']}")
            if abs(s["shm_maps"] - base["shm_maps"]) > MAPS_SLACK:
                problems.append(
                    f"{where}: {s['shm_maps']} /dev/shm mappings, baseline {base['shm_maps']}"
                )
        growth = self.samples[-1]["rss"] - base["rss"]
        if growth > RSS_GROWTH_MAX:
            problems.append(f"RSS grew by {growth / 2**20:.1f} MB")
        series = ", ".join(
            f"{s['step']}: fds {s['fds']} rss {(s['rss'] - base['rss']) / 2**20:+.1f} MB "
            f"maps {s['shm_maps']}"
            for s in self.samples
        )
        print(
            f"\n{self.what}: {time.monotonic() - self.started:.1f} s; baseline fds "
            f"{base['fds']} rss {base['rss'] / 2**20:.1f} MB maps {base['shm_maps']}; {series}"
        )
        assert not problems, "; ".join(problems[:10]) + f" ({len(problems)} problems) [{series}]"


@pytest.mark.slow
@pytest.mark.one_mode  # fork, and its batches dropped unread
def test_many_iterators_partly_consumed_and_dropped():
    loader = DataLoader(Images(64), batch_size=4, num_workers=2, multiprocessing_context="fork")
    rng = random.Random(1)

    def one():
        it = iter(loader)
        for _ in range(rng.randint(0, 3)):
            next(it)  # the batch is dropped at once

    for _ in range(10):  # warm-up: the first iterator sizes the ring the loader keeps
        one()
    watch = _Watch("iterators")
    for i in range(1, 1001):
        one()
        if i % 100 == 0:
            watch.sample(i)
    watch.check()


@pytest.mark.slow
@pytest.mark.one_mode  # fork, and its batches dropped unread
def test_many_loaders_partly_iterated_and_deleted():
    rng = random.Random(2)

    def one():
        loader = DataLoader(Images(64), batch_size=4, num_workers=2, multiprocessing_context="fork")
        it = iter(loader)
        for _ in range(rng.randint(0, 3)):
            next(it)
        del it, loader

    for _ in range(5):
        one()
    watch = _Watch("loaders")
    for i in range(1, 201):
        one()
        if i % 20 == 0:
            watch.sample(i)
    watch.check()


@pytest.mark.slow
def test_many_epochs_of_persistent_workers():
    loader = DataLoader(
        Images(64),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    rng = random.Random(3)
    for _ in loader:  # warm-up epoch: starts the workers and sizes the ring
        pass
    watch = _Watch("epochs")
    watch.base["children"] = own_children()  # the persistent workers, which must stay
    pids = list(loader._iterator._pool.pids)
    for epoch in range(1, 101):
        # Every other epoch is broken off after 0-3 batches, with tasks in flight.
        it = iter(loader)
        if epoch % 2:
            for _ in it:  # the last batch stays referenced, as a loop variable does
                pass
        else:
            for _ in range(rng.randint(0, 3)):
                next(it)
        del it
        if epoch % 10 == 0:
            watch.sample(epoch)
    assert loader._iterator._pool.pids == pids, "the persistent workers were replaced"
    watch.check()
    # The user never held more than one batch: every batch should have had a slot
    # (8 slots: 4 in flight + 4 spare).  Batches of an abandoned epoch must give
    # their slots back before the next epoch dispatches.
    stats = loader.stats()
    del loader, _
    gc.collect()
    wait_gone(own_children(), 60.0)
    assert own_children() == [], "workers left after the loader was deleted"
    assert stats.ring_full_batches == 0, (
        f"{stats.ring_full_batches} batches found the ring full although the loop held at "
        f"most one batch: {stats}"
    )

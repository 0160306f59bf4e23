"""Memory of the process tree (the main process and its workers) while a loader runs.

psutil comes with the bench extra; without it peak_memory() returns None and the rest of
the measuring code still runs.
"""

import threading
from typing import Any, Callable

from .measure import Spec, timed_epoch

try:
    import psutil
except ImportError:  # optional: see the module's docstring
    psutil = None

# Often enough to see the batches in flight (a large batch lives for tens of ms), seldom
# enough that reading every process's PSS does not slow the epoch it measures much.
MEMORY_SAMPLE_INTERVAL_S = 0.05


def tree_memory() -> tuple[int, int]:
    """Summed (PSS, RSS) of this process and its descendants. PSS counts a shared page
    once across the tree (forked pages, shared-memory batches); RSS counts it once per
    process that maps it, so it over-states a tree of forked workers."""
    pss = rss = 0
    root = psutil.Process()
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_full_info()
        except psutil.NoSuchProcess:  # a worker that exited after being listed
            continue
        pss += info.pss
        rss += info.rss
    return pss, rss


class PeakSampler:
    """Takes a sample (_take) in a thread while the `with` block runs, every
    `interval_s`, keeping what a subclass keeps (its peaks). The thread costs main-process
    CPU, so it never runs during a timed epoch."""

    def __init__(self, interval_s: float = MEMORY_SAMPLE_INTERVAL_S):
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self._interval_s):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


class PeakTreeMemory(PeakSampler):
    """The peaks of tree_memory() while the `with` block runs."""

    def __init__(self):
        super().__init__()
        self.peak_pss = self.peak_rss = 0

    def _take(self) -> None:
        pss, rss = tree_memory()
        self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)


def peak_memory(
    make_loader: Callable[[], Any],
    spec: Spec | None,
    epochs: int,
    max_batches: int | None = None,
    step_s: float = 0.0,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Memory of the process tree over `epochs` epochs of a fresh loader (run as
    timed_epoch runs them, its timing unused): its peak over all of them, sampled by a
    thread, the tree's memory before the loader existed, and its memory between epochs
    (the loader idle, persistent workers alive) after each one, which stays flat unless
    an epoch leaves memory behind; None without psutil. Run it when no other loader's
    workers are alive: they would count as part of the tree."""
    if psutil is None:
        return None
    baseline_pss, baseline_rss = tree_memory()
    loader = make_loader()
    idle_pss = []
    with PeakTreeMemory() as peak:
        for _ in range(epochs):
            timed_epoch(loader, spec, max_batches, step_s, on_batch)
            idle_pss.append(tree_memory()[0])
    return {
        "baseline_pss_bytes": baseline_pss,
        "peak_pss_bytes": peak.peak_pss,
        "added_pss_bytes": peak.peak_pss - baseline_pss,
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": peak.peak_rss,
        "idle_pss_bytes": idle_pss,
        # After the last epoch less after the second: the first makes what stays (with
        # slot_bytes=None the ring is sized by the first batches and its slots reserved as
        # they are first used, partly in the second epoch; a worker's caches), and memory
        # an epoch leaves behind (a leak) adds up from then on.
        "growth_pss_bytes": idle_pss[-1] - idle_pss[1] if len(idle_pss) > 2 else None,
    }

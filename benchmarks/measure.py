"""What the benchmark measures on one loader, and the equality check between loaders.

Every function takes a loader (or a zero-argument function that builds a fresh one) and
the batch layout that the reference loader yielded, so they are the same for torch's
DataLoader and shmloader's.
"""
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch

try:
    import psutil
except ImportError:  # memory figures are optional; everything else runs without psutil
    psutil = None

# A batch's layout: (path, shape, dtype) of every tensor leaf, in traversal order.
Spec = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

# Often enough to see the batches in flight (a large batch lives for tens of ms), seldom
# enough that reading every process's PSS does not slow the epoch it measures much.
MEMORY_SAMPLE_INTERVAL_S = 0.05

Result = TypeVar("Result")


class BenchmarkError(RuntimeError):
    """A loader yielded something other than what the reference loader yielded, or a
    worker of the transport-free limit failed."""


def tensor_leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from tensor_leaves(value, f"{path}[{i}]")


def batch_spec(batch: Any) -> Spec:
    return tuple((path, tuple(t.shape), t.dtype) for path, t in tensor_leaves(batch))


def consume(batch: Any, spec: Spec) -> tuple[int, int]:
    """Do what a training loop does before handing a batch to the GPU: check its layout
    and read one element of each tensor. Reading every byte would time the consumer,
    not the loader. Returns (samples, bytes) of the batch."""
    leaves = list(tensor_leaves(batch))
    layout = tuple((path, tuple(t.shape), t.dtype) for path, t in leaves)
    if layout != spec:
        raise BenchmarkError(f"batch layout {layout} differs from the reference layout {spec}")
    for _, t in leaves:
        t[(0,) * t.dim()].item()
    return leaves[0][1].shape[0], sum(t.nbytes for _, t in leaves)


def first_difference(ref: Any, got: Any, path: str) -> str | None:
    """Where and how `got` differs from `ref` (structure, types and values), or None."""
    if type(ref) is not type(got):
        return f"{path}: {type(got).__name__} where the reference has {type(ref).__name__}"
    if isinstance(ref, torch.Tensor):
        if ref.shape != got.shape or ref.dtype != got.dtype:
            return f"{path}: {got.dtype} {tuple(got.shape)} where the reference has {ref.dtype} {tuple(ref.shape)}"
        if not torch.equal(ref, got):
            return f"{path}: {int((ref != got).sum())} of {ref.numel()} elements differ"
        return None
    if isinstance(ref, dict):
        if list(ref) != list(got):
            return f"{path}: keys {list(got)} where the reference has {list(ref)}"
        pairs = [(ref[k], got[k], f"{path}[{k!r}]") for k in ref]
    elif isinstance(ref, (list, tuple)):
        if len(ref) != len(got):
            return f"{path}: {len(got)} items where the reference has {len(ref)}"
        pairs = [(r, g, f"{path}[{i}]") for i, (r, g) in enumerate(zip(ref, got))]
    else:
        return None if ref == got else f"{path}: {got!r} where the reference has {ref!r}"
    return next((d for d in (first_difference(*p) for p in pairs) if d is not None), None)


def checked_warm_up(loaders: dict[str, Any]) -> tuple[Spec, int]:
    """Run every loader's first, unmeasured epoch side by side, batch by batch, and fail
    unless every loader yields exactly the batches that the first one (the reference)
    yields. Comparing in lock-step keeps one batch per loader in memory instead of an
    epoch. Returns the reference's batch layout and the number of batches compared."""
    names = list(loaders)
    iterators = [iter(loader) for loader in loaders.values()]
    end = object()
    spec = None
    count = 0
    while True:
        batches = [next(it, end) for it in iterators]
        ended = [name for name, batch in zip(names, batches) if batch is end]
        if len(ended) == len(names):
            return spec, count
        if ended:
            raise BenchmarkError(f"{', '.join(ended)} ended after {count} batches while the other loaders went on")
        if spec is None:
            spec = batch_spec(batches[0])
        for name, batch in zip(names[1:], batches[1:]):
            difference = first_difference(batches[0], batch, "batch")
            if difference is not None:
                raise BenchmarkError(f"{name} batch {count} differs from {names[0]}'s: {difference}")
        count += 1


def interleaved(runners: dict[str, Callable[[], Result]], reps: int, progress: Callable[[str], None],
                what: str) -> dict[str, list[Result]]:
    """Every runner's results over `reps` repetitions, run in turn, the order reversed
    every other repetition (a, b, c, c, b, a, ...) so that machine noise, and what the
    run before leaves in the caches, hit them alike; `what` names a repetition in the
    progress line."""
    results = {name: [] for name in runners}
    for rep in range(reps):
        order = list(runners.items())
        for name, run in (order if rep % 2 == 0 else order[::-1]):
            progress(f"{name}: {what} {rep + 1}/{reps}")
            results[name].append(run())
    return results


@dataclass(frozen=True)
class Epoch:
    wall_s: float
    cpu_s: float  # CPU time of the whole main process (all its threads)
    batches: int
    samples: int
    bytes: int
    # Of cpu_s, the consumer's own (consume(), the training loop's work, not the
    # loader's): cpu_s - consumer_cpu_s is what the loop loses to the loader.
    consumer_cpu_s: float = 0.0

    @property
    def loader_cpu_s(self) -> float:
        return self.cpu_s - self.consumer_cpu_s


def timed_epoch(loader: Any, spec: Spec) -> Epoch:
    batches = samples = nbytes = 0
    consumer_cpu_s = 0.0
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    for batch in loader:
        consumer_start = time.thread_time()
        batch_samples, batch_bytes = consume(batch, spec)
        consumer_cpu_s += time.thread_time() - consumer_start
        batches += 1
        samples += batch_samples
        nbytes += batch_bytes
    wall_s = time.perf_counter() - wall_start
    return Epoch(wall_s, time.process_time() - cpu_start, batches, samples, nbytes, consumer_cpu_s)


def first_batch_s(make_loader: Callable[[], Any], spec: Spec) -> float:
    """Seconds from building a loader to holding its first batch: construction, worker
    start and the first batch, which is what a non-persistent loader pays every epoch."""
    start = time.perf_counter()
    iterator = iter(make_loader())
    consume(next(iterator), spec)
    elapsed = time.perf_counter() - start
    del iterator  # shut the workers down before the next measurement starts
    return elapsed


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


class PeakTreeMemory:
    """Samples tree_memory() in a thread while the `with` block runs and keeps the peaks.
    The thread costs main-process CPU, so it never runs during a timed epoch."""

    def __init__(self):
        self.peak_pss = self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            pss, rss = tree_memory()
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            if self._stop.wait(MEMORY_SAMPLE_INTERVAL_S):
                return

    def __enter__(self) -> "PeakTreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()


def peak_memory(make_loader: Callable[[], Any], spec: Spec, epochs: int) -> dict[str, Any] | None:
    """Memory of the process tree over `epochs` epochs of a fresh loader (made persistent
    by the caller): its peak over all of them, sampled by a thread, the tree's memory
    before the loader existed, and its memory between epochs (the loader idle, its
    workers alive) after each one, which stays flat unless an epoch leaves memory behind;
    None without psutil. Run it when no other loader's workers are alive: they would
    count as part of the tree."""
    if psutil is None:
        return None
    baseline_pss, baseline_rss = tree_memory()
    loader = make_loader()
    idle_pss = []
    with PeakTreeMemory() as peak:
        for _ in range(epochs):
            for batch in loader:
                consume(batch, spec)
            batch = None  # not held across the reading
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

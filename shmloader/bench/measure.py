"""What one loader does, measured: an epoch, and the first batch of a new loader.

Every function takes a loader (or a zero-argument function that builds a fresh one), so
they are the same for torch's DataLoader and shmloader's. Where a batch layout (`Spec`)
is given, every batch must have it: the benchmarks' batches all have the reference
loader's; a user's may not (a smaller last batch, padded sequences), so they pass None.
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar

import numpy as np
import torch

from .errors import BenchmarkError

# A batch's layout: (path, shape, dtype) of every tensor leaf, in traversal order.
Spec = tuple[tuple[str, tuple[int, ...], Any], ...]
Array = torch.Tensor | np.ndarray

Result = TypeVar("Result")
_END = object()  # next()'s default: the iterator is exhausted


def tensor_leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Array]]:
    """(path, array) of every tensor and numpy array in the batch's dicts, lists and tuples."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from tensor_leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from tensor_leaves(value, f"{path}[{i}]")


def batch_spec(batch: Any) -> Spec:
    return tuple((path, tuple(t.shape), t.dtype) for path, t in tensor_leaves(batch))


def consume(batch: Any, spec: Spec | None) -> tuple[int, int]:
    """Do what a training loop does before handing a batch to the GPU: check its layout
    (unless spec is None) and read one element of each tensor. Reading every byte would
    time the consumer, not the loader. Returns (samples, bytes) of the batch: samples
    are the first leaf's rows, bytes those of every leaf."""
    leaves = list(tensor_leaves(batch))
    if spec is not None:
        layout = tuple((path, tuple(t.shape), t.dtype) for path, t in leaves)
        if layout != spec:
            raise BenchmarkError(f"batch layout {layout} differs from the reference layout {spec}")
    for _, t in leaves:
        if t.nbytes:  # an empty leaf has no element to read
            t[(0,) * t.ndim].item()
    first = leaves[0][1] if leaves else None
    samples = first.shape[0] if first is not None and first.ndim else 1
    return samples, sum(t.nbytes for _, t in leaves)


def interleaved(
    runners: Mapping[str, Callable[[], Result]],
    reps: int,
    progress: Callable[[str], None],
    what: str,
) -> dict[str, list[Result]]:
    """Every runner's results over `reps` repetitions, run in turn, the order reversed
    every other repetition (a, b, c, c, b, a, ...) so that machine noise, and what the
    run before leaves in the caches, hit them alike; `what` names a repetition in the
    progress line."""
    results: dict[str, list[Result]] = {name: [] for name in runners}
    for rep in range(reps):
        order = list(runners.items())
        for name, run in order if rep % 2 == 0 else order[::-1]:
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
    # Of wall_s, the time the loop was blocked in iter() and next(): waiting for data.
    wait_s: float = 0.0

    @property
    def loader_cpu_s(self) -> float:
        return self.cpu_s - self.consumer_cpu_s


def timed_epoch(
    loader: Any,
    spec: Spec | None,
    max_batches: int | None = None,
    step_s: float = 0.0,
    on_batch: Callable[[], None] | None = None,
) -> Epoch:
    """One epoch of `loader` (its first max_batches batches, if given), each batch
    consumed, then `step_s` slept in place of a training step (a GPU step leaves the CPU
    free) and on_batch called (a progress bar): the loop's own work, timed as the
    consumer's."""
    batches = samples = nbytes = 0
    consumer_cpu_s = 0.0
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    iterator = iter(loader)  # starts the workers of a non-persistent loader: waiting, too
    wait_s = time.perf_counter() - wall_start
    while max_batches is None or batches < max_batches:
        asked = time.perf_counter()
        batch = next(iterator, _END)
        wait_s += time.perf_counter() - asked
        if batch is _END:
            break
        consumer_start = time.thread_time()
        batch_samples, batch_bytes = consume(batch, spec)
        if step_s:
            time.sleep(step_s)
        if on_batch is not None:
            on_batch()
        consumer_cpu_s += time.thread_time() - consumer_start
        batches += 1
        samples += batch_samples
        nbytes += batch_bytes
    # An epoch cut short shuts a non-persistent loader's workers down here, as breaking
    # out of a training loop does: the loop pays for it.
    batch = iterator = None
    wall_s = time.perf_counter() - wall_start
    return Epoch(
        wall_s, time.process_time() - cpu_start, batches, samples, nbytes, consumer_cpu_s, wait_s
    )


def first_batch_s(make_loader: Callable[[], Any], spec: Spec | None) -> float:
    """Seconds from building a loader to holding its first batch: construction, worker
    start and the first batch, which is what a non-persistent loader pays every epoch."""
    start = time.perf_counter()
    iterator = iter(make_loader())
    consume(next(iterator), spec)
    elapsed = time.perf_counter() - start
    del iterator  # shut the workers down before the next measurement starts
    return elapsed

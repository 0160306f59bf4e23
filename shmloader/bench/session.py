"""The whole measurement of a set of loaders over the same dataset, in the order that keeps
one loader from disturbing another's figures:

1. the first epoch of every loader side by side, their batches compared (check.py);
2. timed epochs of the same loaders, interleaved (torch, shmloader, shmloader, torch, ...)
   so that machine noise hits all alike; with the transport-free limit among them where
   asked (limit.py);
3. time to first batch, each repetition on a new loader, interleaved;
4. memory, over a few epochs of a new loader, one loader alive at a time (memory.py).

benchmarks/bench.py and `python -m shmloader.compare` both run this sequence; they differ
in the loaders they build and in the Plan.
"""

import functools
import gc
from dataclasses import dataclass
from typing import Any, Callable

from .check import EXACT, Check, first_epoch_check
from .errors import BenchmarkError
from .limit import LIMIT, TransportFreeLimit
from .measure import Epoch, first_batch_s, interleaved, timed_epoch
from .memory import peak_memory


@dataclass(frozen=True)
class Makers:
    """How to build one loader for each step: each call returns a new loader."""

    timed: Callable[[], Any]  # checked, then timed over the epochs
    fresh: Callable[[], Any]  # timed to its first batch, one per repetition
    memory: Callable[[], Any]  # its memory measured over a few epochs


@dataclass(frozen=True)
class Plan:
    reps: int  # timed epochs per loader
    first_batch_reps: int
    memory_epochs: int  # 0: memory is not measured
    max_batches: int | None = None  # per epoch; None: whole epochs
    step_s: float = 0.0  # a training step after each batch (slept)
    check: str = EXACT  # how the first epochs are compared (see check.py)
    fail_on_mismatch: bool = True  # else the mismatch is kept in Measurement.check
    limit: bool = False  # time the transport-free limit beside the loaders
    # Every batch has the first batch's layout (tensor shapes and dtypes): checked as
    # each batch is consumed. A user's last batch may be smaller: then False.
    fixed_layout: bool = True


@dataclass(frozen=True)
class Measurement:
    check: Check
    epochs: dict[str, list[Epoch]]  # by loader name, and LIMIT where the limit ran
    stats: dict[str, Any]  # a loader's stats() (shmloader's), else None
    first_batch_s: dict[str, list[float]]
    memory: dict[str, dict[str, Any] | None]  # None: not measured


def measure(
    makers: dict[str, Makers],
    plan: Plan,
    progress: Callable[[str], None],
    on_batch: Callable[[], None] | None = None,
) -> Measurement:
    """Every step of the module's docstring, the first loader named being the reference;
    progress() is told each step as it starts, on_batch() each batch a loader yields."""
    check, epochs, stats = _timed(makers, plan, progress, on_batch)
    gc.collect()  # so that no timed loader's workers are alive in the steps that follow
    spec = check.spec if plan.fixed_layout else None
    first = interleaved(
        {
            name: functools.partial(_first_batch, make.fresh, spec, on_batch)
            for name, make in makers.items()
        },
        plan.first_batch_reps,
        progress,
        "first batch",
    )
    memory = {}
    for name, make in makers.items():
        if plan.memory_epochs:
            progress(f"{name}: {plan.memory_epochs} memory epochs")
        gc.collect()  # so that no earlier loader's workers count in the process tree
        memory[name] = (
            peak_memory(
                make.memory, spec, plan.memory_epochs, plan.max_batches, plan.step_s, on_batch
            )
            if plan.memory_epochs
            else None
        )
    return Measurement(check, epochs, stats, first, memory)


def _timed(
    makers: dict[str, Makers],
    plan: Plan,
    progress: Callable[[str], None],
    on_batch: Callable[[], None] | None,
) -> tuple[Check, dict[str, list[Epoch]], dict[str, Any]]:
    """Steps 1 and 2. The loaders and the limit live only in this function, so their
    workers are shut down when it returns."""
    loaders = {name: make.timed() for name, make in makers.items()}
    how = "equal" if plan.check == EXACT else "alike in structure"
    progress(f"first epoch of {' and '.join(loaders)}, checking that their batches are {how}")
    check = first_epoch_check(loaders, plan.check, plan.max_batches, on_batch)
    if check.mismatch is not None and plan.fail_on_mismatch:
        raise BenchmarkError(check.mismatch)
    spec = check.spec if plan.fixed_layout else None
    runners = {
        name: functools.partial(timed_epoch, loader, spec, plan.max_batches, plan.step_s, on_batch)
        for name, loader in loaders.items()
    }
    if not plan.limit:
        epochs = interleaved(runners, plan.reps, progress, "timed epoch")
    else:
        # The limit does the reference loader's work: its dataset, its batches, its workers.
        reference = next(iter(loaders.values()))
        batches = list(reference.batch_sampler)[: plan.max_batches]
        progress("start of the transport-free limit and its warm-up epoch")
        # Its buffers have the reference's batch layout: benchmarks/bench.py, which runs
        # the limit, measures presets whose datasets are never empty.
        assert check.spec is not None
        with TransportFreeLimit(
            reference.dataset, batches, reference.num_workers, check.spec
        ) as limit:
            limit.epoch()
            epochs = interleaved(
                {**runners, LIMIT: limit.epoch}, plan.reps, progress, "timed epoch"
            )
    # Only shmloader has stats(); they cover the first epoch and every timed one.
    stats = {
        name: loader.stats() if hasattr(loader, "stats") else None
        for name, loader in loaders.items()
    }
    return check, epochs, stats


def _first_batch(make: Callable[[], Any], spec: Any, on_batch: Callable[[], None] | None) -> float:
    elapsed = first_batch_s(make, spec)
    if on_batch is not None:
        on_batch()
    return elapsed

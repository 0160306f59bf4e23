"""The first epoch of several loaders, side by side: do they yield the same batches?

Exactly the same values is the check wherever the batches are reproducible, which they
are when both loaders draw the same seeds (see compare's loaders: one seeded generator
each). A dataset whose random augmentations draw from a source no loader seeds (a fresh
numpy Generator, os.urandom, the clock) yields other values on every call; its batches
can only be compared by structure: the same containers, keys, lengths, tensor shapes
and dtypes, and non-tensor leaves of the same types.
"""

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from .errors import BenchmarkError
from .measure import Spec, batch_spec

EXACT = "exact"
STRUCTURE = "structure"
_END = object()  # next()'s default: the iterator is exhausted
_Array = TypeVar("_Array", torch.Tensor, np.ndarray)


@dataclass(frozen=True)
class Check:
    """What the first epoch's comparison found."""

    mode: str  # EXACT or STRUCTURE
    reference: str  # the loader every other one is compared with
    compared: tuple[str, ...]
    batches: int  # batches of the reference compared (all of them when nothing differs)
    spec: Spec | None  # the layout of the reference's first batch (None: it yielded none)
    mismatch: str | None  # the first difference, where one was found


def first_difference(ref: Any, got: Any, path: str, values: bool = True) -> str | None:
    """Where and how `got` differs from `ref`, or None: structure and types always, the
    values of tensors, arrays and other leaves only where `values` is True."""
    if type(ref) is not type(got):
        return f"{path}: {type(got).__name__} where the reference has {type(ref).__name__}"
    if isinstance(ref, (torch.Tensor, np.ndarray)):
        if ref.shape != got.shape or ref.dtype != got.dtype:
            return f"{path}: {got.dtype} {tuple(got.shape)} where the reference has {ref.dtype} {tuple(ref.shape)}"
        if values and not _equal(ref, got):
            elements = ref.size if isinstance(ref, np.ndarray) else ref.numel()
            return f"{path}: {int((ref != got).sum())} of {elements} elements differ"
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
        return (
            None if not values or ref == got else f"{path}: {got!r} where the reference has {ref!r}"
        )
    return next((d for d in (first_difference(*p, values) for p in pairs) if d is not None), None)


def _equal(ref: _Array, got: _Array) -> bool:
    """Equal values, NaN equal to NaN (a NaN in a sample is data, not a difference)."""
    if isinstance(ref, np.ndarray):
        return np.array_equal(ref, got, equal_nan=ref.dtype.kind in "fc")
    if torch.equal(ref, got):
        return True
    return (ref.is_floating_point() or ref.is_complex()) and torch.allclose(
        ref, got, rtol=0, atol=0, equal_nan=True
    )


def first_epoch_check(
    loaders: dict[str, Any],
    mode: str = EXACT,
    max_batches: int | None = None,
    on_batch: Callable[[], None] | None = None,
) -> Check:
    """Run every loader's first, unmeasured epoch (its first max_batches batches, if
    given) side by side, batch by batch, comparing each loader's batch with the first
    loader's (the reference's). Comparing in lock-step keeps one batch per loader in
    memory instead of an epoch. The first difference ends the comparison, not the epoch:
    every loader runs its epoch out, a warm-up for what follows. on_batch is called
    for every batch of every loader (a progress bar)."""
    names = list(loaders)
    iterators = [iter(loader) for loader in loaders.values()]
    spec = mismatch = None
    step = compared = 0
    while max_batches is None or step < max_batches:
        batches = [_END if it is None else next(it, _END) for it in iterators]
        live = [batch is not _END for batch in batches]
        if not any(live):
            break
        iterators = [it if alive else None for it, alive in zip(iterators, live)]
        if mismatch is None:
            mismatch = _difference(names, batches, step, mode)
            compared += mismatch is None
        if spec is None and live[0]:
            spec = batch_spec(batches[0])
        if on_batch is not None:
            for _ in range(sum(live)):
                on_batch()
        step += 1
    return Check(mode, names[0], tuple(names[1:]), compared, spec, mismatch)


def _difference(names: list[str], batches: list[Any], step: int, mode: str) -> str | None:
    """The first way in which batch `step` of a loader differs from the reference's."""
    ended = [name for name, batch in zip(names, batches) if batch is _END]
    if ended:
        return f"{', '.join(ended)} ended after {step} batches while the other loaders went on"
    for name, batch in zip(names[1:], batches[1:]):
        difference = first_difference(batches[0], batch, "batch", values=mode == EXACT)
        if difference is not None:
            return f"{name} batch {step} differs from {names[0]}'s: {difference}"
    return None


def checked_warm_up(loaders: dict[str, Any]) -> tuple[Spec | None, int]:
    """The first epoch of every loader, side by side, which must yield exactly the
    batches that the first loader yields (else BenchmarkError). Returns the batch layout
    (None where the loaders yielded no batch) and the number of batches compared."""
    check = first_epoch_check(loaders)
    if check.mismatch is not None:
        raise BenchmarkError(check.mismatch)
    return check.spec, check.batches

"""compare's checks of a user's dataset in the main process, before any loader starts: a
mistake is then one clear error, not a traceback from inside a worker.

The first batch is fetched and collated here, as a worker would, which also tells how to
compare the loaders' first epochs: a dataset that returns the same batch twice under the
same seeds is compared exactly; one that does not draws random numbers from a source no
loader seeds, and is compared by structure (check.py).
"""

import contextlib
import itertools
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from .check import EXACT, STRUCTURE, first_difference
from .errors import InputError, user_trace
from .measure import tensor_leaves


def check_kind(dataset: Any, shuffle: bool) -> None:
    """The options that need a map-style dataset, and a map-style dataset's length."""
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise InputError(
                "--shuffle needs a map-style dataset (samples fetched by index, which a sampler "
                f"shuffles), but the factory returned an IterableDataset ({type(dataset).__name__}), "
                "whose samples come in the order its __iter__ yields them: drop --shuffle (shuffle "
                "inside __iter__, or with a shuffle buffer)"
            )
        return
    try:
        length = len(dataset)
    except TypeError as error:
        raise InputError(
            f"the dataset ({type(dataset).__name__}) has no length ({error}): a map-style dataset "
            "needs __len__ for its sampler; define it, or make the dataset an IterableDataset"
        ) from None
    if length == 0:
        raise InputError(
            f"the dataset ({type(dataset).__name__}) is empty (len 0): there is nothing to load"
        )


def first_batch(dataset: Any, batch_size: int, collate_fn: Callable[[list], Any] | None) -> Any:
    """The first batch, fetched and collated in this process; InputError where the
    dataset fails, its samples cannot be batched, or the batch holds no tensor."""
    samples = _first_samples(dataset, batch_size)
    if not samples:
        raise InputError(
            f"the dataset ({type(dataset).__name__}) yielded no sample: there is nothing to load"
        )
    collate = collate_fn or default_collate
    try:
        batch = collate(samples)
    except Exception as error:
        how = "--collate-fn" if collate_fn else "torch's default_collate"
        raise InputError(
            f"the dataset's samples cannot be batched: {how} raised {type(error).__name__} on the first "
            f"{len(samples)}: {error}. Return tensors, numpy arrays or numbers of one shape per field from the "
            "dataset (convert images to tensors; resize, crop or pad them to one size), or pass "
            "--collate-fn module:callable that batches them",
            user_trace(),
        ) from None
    if next(tensor_leaves(batch), None) is None:
        raise InputError(
            f"the batches hold no tensor or numpy array ({type(batch).__name__} of "
            f"{type(samples[0]).__name__}): shmloader moves tensors, there is nothing to compare"
        )
    return batch


def _first_samples(dataset: Any, batch_size: int) -> list[Any]:
    try:
        if isinstance(dataset, IterableDataset):
            return list(itertools.islice(iter(dataset), batch_size))
        return [dataset[i] for i in range(min(batch_size, len(dataset)))]
    except Exception as error:
        raise InputError(
            f"fetching the first {batch_size} samples in this process raised {type(error).__name__}: "
            f"{error}; fix the dataset (the traceback above shows where)",
            user_trace(),
        ) from None


def check_mode(
    dataset: Any, batch_size: int, collate_fn: Callable[[list], Any] | None, seed: int
) -> tuple[str, str]:
    """(EXACT or STRUCTURE, why): the first batch, fetched twice under the same seeds."""
    with seeded(seed):
        once = first_batch(dataset, batch_size, collate_fn)
    with seeded(seed):
        again = first_batch(dataset, batch_size, collate_fn)
    difference = first_difference(once, again, "batch")
    if difference is None:
        return EXACT, "the dataset returns the same batch under the same seeds"
    return STRUCTURE, (
        f"the dataset returned another first batch under the same seeds ({difference}): its random "
        "numbers come from a source that neither loader seeds"
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """random, numpy and torch seeded with `seed`, as a loader's worker seeds them; their
    states put back after."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])

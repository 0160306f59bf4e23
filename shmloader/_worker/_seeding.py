"""seed_per_sample=True: every sample's random state is a function of where
it is in the run, not of which worker fetched it or what that worker did
before, so random augmentations are the same whatever num_workers, fetch or
assignment is."""

from __future__ import annotations

import random

import numpy as np
import torch

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: neighbouring inputs give unrelated outputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def sample_seed(base_seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for the sample at `position` (0-based, in sampler order)
    of epoch `epoch` of a run whose iterator drew `base_seed`."""
    x = _mix((base_seed & _MASK) ^ 0x9E3779B97F4A7C15)
    x = _mix(x ^ epoch)
    return _mix(x ^ position) >> 1


def seed_sample(base_seed: int, epoch: int, position: int) -> None:
    """Seed random, torch's CPU generator and numpy (the three torch's workers
    seed) for one sample.  torch.manual_seed would also reseed every
    accelerator's generators, at 40x the cost; a worker's samples are made on
    the CPU.  numpy's legacy seeding takes 32 bits (a list of words costs 5x)."""
    seed = sample_seed(base_seed, epoch, position)
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    np.random.seed(seed >> 31)


def countable(index, auto_collation: bool):
    """A batch_sampler's batch that is an iterator (torch's fetcher only
    iterates it) as a list, whose length counts sample positions and rows."""
    if (
        auto_collation
        and type(index) is not list
        and not hasattr(index, "__len__")
        and hasattr(index, "__iter__")
    ):
        return list(index)
    return index


def positions_in(index, auto_collation: bool) -> int:
    """The sample positions a batch takes: its length, or 0 for a
    batch_sampler's "batch" that has none (an int), on which the fetcher
    then fails as torch's does."""
    if not auto_collation:
        return 1
    return len(index) if hasattr(index, "__len__") else 0


class Samples:
    """Fetches single samples of a map-style dataset, each seeded by
    seed_sample first where there is a base seed (seed_per_sample)."""

    def __init__(self, dataset, auto_collation: bool, collate_fn, base_seed: int | None):
        self._dataset = dataset
        self._auto_collation = auto_collation
        self._collate_fn = collate_fn
        self._base_seed = base_seed

    def get(self, index, epoch, position):
        if self._base_seed is not None:
            seed_sample(self._base_seed, epoch, position)
        return self._dataset[index]

    def batch(self, index, epoch, position):
        """A batch fetched sample by sample (never __getitems__: each sample
        is seeded on its own)."""
        if not self._auto_collation:
            return self._collate_fn(self.get(index, epoch, position))
        return self._collate_fn([self.get(i, epoch, position + k) for k, i in enumerate(index)])

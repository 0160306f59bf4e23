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

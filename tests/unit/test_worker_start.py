"""A worker's start around an epoch boundary (issue 38): what a waiting worker does
before its config must leave no trace."""

import multiprocessing as mp
import random

import numpy as np
import torch

from shmloader._worker._loop import _warm_up_while_waiting


def test_a_waiting_workers_warm_up_leaves_every_generator_as_it_was():
    """_warm_up_while_waiting seeds torch, numpy and random, then puts each back: what a
    dataset draws as it is unpickled, before the worker's own seeding, is what it
    would have drawn."""
    waiting, _main_end = mp.Pipe()  # (nothing to read: the worker waits)
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    before = torch.get_rng_state(), np.random.get_state(), random.getstate()
    expected = torch.rand(3), np.random.rand(3), random.random()
    torch.set_rng_state(before[0])
    np.random.set_state(before[1])
    random.setstate(before[2])

    _warm_up_while_waiting(waiting)

    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]

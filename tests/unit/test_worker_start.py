"""A worker's start and end around an epoch boundary (issue 38): what a waiting
worker does before its config must leave no trace, and a worker told to LEAVE
gives the cores up before it exits."""

import multiprocessing as mp
import os
import random

import numpy as np
import pytest
import torch

from shmloader._worker._channels import Inbox
from shmloader._worker._loop import _warm_up_while_waiting
from shmloader._worker._protocol import EXIT, LEAVE


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


def _policies_after(report) -> None:
    """In a child: the message an Inbox reads, and the scheduling policy of each
    of this process's threads then."""
    report["main_end"].close()
    got = Inbox(report["tasks"], None, os.getppid()).next()
    policies = {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
    report["out"].send((got, policies))


@pytest.mark.parametrize("message", [LEAVE, EXIT], ids=["LEAVE", "EXIT"])
def test_a_worker_told_to_leave_runs_only_in_the_cores_idle_time(message):
    """LEAVE (a non-persistent epoch's end, where nobody waits for the workers):
    every thread of the worker at SCHED_IDLE before it exits.  EXIT (a shutdown
    that joins them): left as it was."""
    ctx = mp.get_context("fork")
    tasks, main_end = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    child = ctx.Process(
        target=_policies_after, args=({"tasks": tasks, "main_end": main_end, "out": out_w},)
    )
    child.start()
    tasks.close()
    out_w.close()
    main_end.send(message)
    got, policies = out_r.recv()
    main_end.close()
    child.join(10)
    assert got is EXIT  # (LEAVE is an exit to the worker's loop)
    assert policies == ({os.SCHED_IDLE} if message is LEAVE else {os.sched_getscheduler(0)})

"""Start turns: where a pool has more workers than the cores it may run on
less one, worker k begins its set-up (unpickling, seeding, worker_init_fn)
once worker k - first has answered its first task, or a bound after it got
its config, whichever comes first (first and the bound: the main process's,
_main/_pool.py's _first_turn and TURN_WAIT_S).

NOTE [worker: start turns]
At an epoch boundary every new worker sets up at once (~3 ms of CPU each
here, before its first sample), and the scheduler shares the cores fairly
among them and the training process: with 4 workers on 2 cores, worker 0,
whose batch the training loop waits for, got half a core or less, and the
training process, to take that batch, waited its turn too.  Turns give
one core to each of the first workers and leave one to the training
process; each later worker starts as one of them has a batch out, when
those later batches are not needed yet.  The wait is bounded: a first batch
that waits on I/O (the cores idle) holds the next workers back 20 ms at
most, once an iterator; a worker that dies before its first answer, the
same.  Only for workers configured after start (spawn, forkserver: the
pool's _configure): under fork the main process forks its workers one by
one at iter(), which staggers them already.  Each pair shares one eventfd,
made by the main process and sent with the config; turns are optional, and
where no fd is left for them the workers start at once, as without them.
"""

from __future__ import annotations

import os
import select


def wait_for_turn(fd: int | None, longest_s: float) -> None:
    """Until the worker before this one in its turn has answered its first
    task, or longest_s (fd: None where this worker has no turn to wait)."""
    if fd is None:
        return
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        poll.poll(longest_s * 1000)
    finally:
        os.close(fd)


def pass_turn(fd: int) -> None:
    """This worker has answered its first task: the worker waiting on `fd` starts."""
    try:
        os.eventfd_write(fd, 1)
    finally:
        os.close(fd)

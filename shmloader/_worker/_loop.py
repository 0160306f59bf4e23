"""The worker process: torch's worker loop, with batches written into slots.

Seeding, WorkerInfo, worker_init_fn, fetchers and exception wrapping are
torch's own (torch/utils/data/_utils/worker.py), so datasets see exactly what
they see under torch's DataLoader.  What differs is the transport: a task that
comes with a slot is collated into it and published on the ring; everything
else (no slot, a batch that outgrew its slot, errors, end of an iterable) goes
to the main process through this worker's result pipe: a batch in a one-off
memfd segment of its own (see _one_off.py), anything else pickled by torch.

This module starts the worker and runs its loop; the rest of the worker side
(this package, shmloader/_worker/):

    _config.py    what a worker is started with (WorkerConfig)
    _exit.py      how it leaves when it cannot return from the loop
    _watch.py     whether the main process still lives
    _channels.py  its inbox (the task pipe) and send (the result socket)
    _slots.py     the ring as it mapped it, and its counters
    _turns.py     when it begins its set-up, where workers outnumber cores
    _tasks.py     what its tasks share (TaskContext)
    _batch.py     a whole batch
    _rows.py      fetch="sample": a batch's rows, the first batch's probe
    _state.py     the worker's state each batch carries (resuming)
    _fresh_*_generator.py  fresh global generators in each worker forked from
                  some of shmloader's servers (imported by those only)

The messages both ways, and what each field holds: see _protocol.py.  Worker
code imports nothing of the main process's side (shmloader/_main/,
dataloader.py) nor of the features (shmloader/_features/): what both sides
need lives here or below (shmloader/_shm/, _errors.py); tests/unit/test_layers.py
checks it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import numpy as np
import numpy.random  # noqa: F401  here, once: else every forked worker imports it (~9 ms) to seed
import torch
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.collate import default_collate

from ._batch import batch
from ._channels import Inbox, receive_config, send
from ._config import WorkerConfig
from ._exit import NoRingFds, NoRingMapping, orphaned, set_exit_handlers, without_ring
from ._malloc import keep_freed_memory
from ._protocol import EXIT, FINISH, FINISHED, ErrorReply
from ._rows import probe, rows
from ._slots import MappedRing
from ._tasks import TaskContext, reseeded
from ._turns import pass_turn, wait_for_turn
from ._watch import start_watchdog


def worker_loop(cfg: WorkerConfig) -> None:
    """A worker started with its config (fork)."""
    _leaving_as_torch(cfg.manager_pid, lambda: cfg)


def configured_worker_loop(tasks, results, manager_pid: int) -> None:
    """A worker started before its config was known (spawn and forkserver:
    NOTE [pool: configured after start]): the config is its first message."""

    def config() -> WorkerConfig | None:
        _warm_up_while_waiting(tasks)
        return receive_config(tasks, results)

    _leaving_as_torch(manager_pid, config)


def _warm_up_while_waiting(tasks) -> None:
    """What every worker's start does whatever its config, done once while
    this one waits for its config (a loader's spare workers wait an epoch:
    _main/_spare.py): a seeding, and default_collate of two small tensors.
    The first run of each in a process forked from a server copies some 600
    of the server's pages on write, ~2 ms of CPU a worker; at an epoch
    boundary every worker pays it at once, on the cores that make the first
    batch.  Every generator is put back as it was, so that what runs before
    the real seeding (the dataset's unpickling) draws what it would have.
    Skipped where the config is here already (nothing to hide it behind)."""
    if tasks.poll(0):
        return
    generators = torch.get_rng_state(), np.random.get_state(), random.getstate()
    _seed(0, 0)
    torch.set_rng_state(generators[0])
    np.random.set_state(generators[1])
    random.setstate(generators[2])
    default_collate([torch.zeros(3, dtype=torch.int64)] * 2)


def _leaving_as_torch(manager_pid: int, config: Callable[[], WorkerConfig | None]) -> None:
    cfg = None
    try:
        set_exit_handlers()  # first: the watchdog may leave at once, knowing whose temp dir is whose
        start_watchdog(manager_pid)
        cfg = config()
        if cfg is not None:  # (else told to exit before it had one)
            _run(cfg)
    except KeyboardInterrupt:
        pass  # the main process raises KeyboardInterrupt itself
    except (BrokenPipeError, ConnectionError, EOFError):
        orphaned()
    except (NoRingFds, NoRingMapping) as e:
        assert cfg is not None  # (raised only once it has its config)
        without_ring(cfg.worker_id, e)


def _run(cfg: WorkerConfig) -> None:
    wait_for_turn(cfg.turn_wait, cfg.turn_wait_s)
    if cfg.shared is not None:
        # Before the seeding, as torch's workers unpickle their dataset.
        cfg = dataclasses.replace(cfg, **cfg.shared.load(), shared=None)
    seed = _set_up_process(cfg)
    dataset = reseeded(cfg.dataset, cfg.shared_seed)
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=cfg.worker_id, num_workers=cfg.num_workers, seed=seed, dataset=dataset
    )
    ctx = TaskContext(cfg, dataset)
    ctx.start()
    inbox = Inbox(cfg.tasks, cfg.results, cfg.manager_pid)
    turn = cfg.turn_pass  # signalled once its first task (or resume) is answered
    while True:
        msg = inbox.next()
        if msg is EXIT:
            if inbox.manager_gone:
                orphaned()
            break
        if msg is FINISH:
            cfg.results.send(FINISHED)
            break
        kind = msg.kind
        if kind == "ring":
            ctx.mapped = MappedRing(inbox.ring_fds)
            inbox.ring_fds = None
        elif kind == "layout":
            ctx.layout = msg.layout
        else:
            if kind == "resume":
                cfg.results.send(ctx.resume(msg))
            else:
                _answer(ctx, msg, stale=ctx.iteration_end or inbox.superseded())
            if turn is not None:  # (a resume is answered before any task is sent)
                pass_turn(turn)
                turn = None


def _set_up_process(cfg: WorkerConfig) -> int:
    """This process set up as torch's workers set theirs up; returns the
    worker's seed."""
    torch.multiprocessing._set_thread_name("pt_data_worker")
    torch.set_num_threads(1)
    keep_freed_memory()
    return _seed(cfg.base_seed, cfg.worker_id)


def _seed(base_seed: int, worker_id: int) -> int:
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def _answer(ctx: TaskContext, task, stale: bool) -> None:
    """Do a task (Task, Rows or Probe), or only let go of what a stale one
    holds, and send the reply, if there is one."""
    if not stale:
        ctx.enter_epoch(task.epoch)
    kind = task.kind
    if kind == "rows":
        reply = rows(ctx, task, stale=stale, error=ctx.fetcher_error)
    elif kind == "probe":
        reply = None if stale else probe(ctx, task, error=ctx.fetcher_error)
    elif stale:
        reply = ctx.give_back(task.slot)
    elif ctx.fetcher is None:
        ctx.give_back(task.slot)
        reply = ErrorReply.wire(task.task_id, ctx.fetcher_error, None)
    else:
        reply = batch(ctx, ctx.fetcher, task)
    if isinstance(reply, bytes):
        ctx.cfg.results.send_bytes(reply)
    elif reply is not None:
        send(ctx.cfg.results, reply)

"""Worker processes of one iterator: start, talk to, watch, and stop them.

Each worker gets a task pipe (main -> worker: every message) and a result
socket (worker -> main; main -> worker it carries only the fds that follow a
Configure or a RingFds message) of its own, so no lock is shared and a dead
worker can never leave a half-written message in a channel that others use.
The tasks go over a pipe because a task is sent per batch, on the training
thread, and waking a worker costs that thread ~12 us less through a pipe
than through a socket here (the write with a sleeping reader: ~33 us against
~45, caches cold after a model step).  Process sentinels are polled together
with the result sockets (and the ring's eventfd), so a worker's death wakes
the main process at once.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import resource
import signal
import socket
import struct
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from pickle import PicklingError
from typing import NoReturn

from torch.utils.data._utils import signal_handling

from .._errors import WorkerDied
from .._shm._segment import address_space_limit
from .._worker import _one_off
from .._worker._config import WorkerConfig
from .._worker._loop import configured_worker_loop, worker_loop
from .._worker._protocol import (
    EXIT,
    FINISH,
    LEAVE,
    NO_RING_FDS_EXIT,
    NO_RING_MAPPING_EXIT,
    Configure,
    RingFds,
    from_worker,
)
from .._worker._shared_objects import SharedObjects
from . import _torch_api
from ._forkserver import children_of_a_server
from ._open_files import check_room_for_workers, too_many_open_files
from ._warn import warn_as_torch_worker_start

# Like torch's MP_STATUS_CHECK_INTERVAL: how long shutdown waits for workers
# to exit on their own before terminating them.
JOIN_TIMEOUT = 5.0
# multiprocessing.Connection's framing: a 4-byte big-endian length, then the bytes.
_FRAME_HEADER = struct.Struct("!i")
# Above this, Connection writes header and payload apart; leave such messages to it.
_ONE_WRITE_BYTES = 16384
# The most a pipe is grown to (/proc/sys/fs/pipe-max-size's default: the most
# an unprivileged process may ask for).
_PIPE_MAX_BYTES = 1 << 20


def _out_of_fds(error: Exception) -> bool:
    """Whether receiving a message failed for want of file descriptors: a batch
    of torch's transport brings its storages' fds (multiprocessing's recvfds
    says "received 0 items of ancdata" when the kernel dropped them)."""
    if isinstance(error, OSError):
        return error.errno in (errno.EMFILE, errno.ENFILE)
    return isinstance(error, RuntimeError) and "items of ancdata" in str(error)


def _exit_description(process) -> str:
    """What became of a dead worker, in torch's words where torch has them
    (its SIGCHLD handler's, which code and people match: "is killed by
    signal: Killed." for an out-of-memory kill)."""
    code = process.exitcode
    if code == NO_RING_FDS_EXIT:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return (
            f"could not receive the ring's file descriptors: it had as many open files as "
            f"its limit allows (RLIMIT_NOFILE, `ulimit -n`: {soft} here; a shmloader "
            "worker holds 2-4 more files than torch's: the ring's and its wake-ups'). "
            "Raise that limit, or keep fewer batches of loaders that are gone (each keeps "
            "one open)."
        )
    if code == NO_RING_MAPPING_EXIT:
        return (
            f"could not map the ring: no address space was left for it "
            f"({address_space_limit()}). Raise that limit, or lower num_slots, "
            "slot_bytes or the batch size."
        )
    if code is not None and code < 0:
        text = f"is killed by signal: {signal.strsignal(-code)}."
        if -code == signal.SIGBUS:
            text += (
                " It is possible that dataloader's workers are out of shared memory. "
                "Please try to raise your shared memory limit."
            )
        return text
    if code == 0:  # torch's SIGCHLD handler passes it over; its watchdog's words
        return "exited unexpectedly"
    return (
        f"exited unexpectedly with exit code {code}. Details are lost due to "
        "multiprocessing. Rerunning with num_workers=0 may give better error trace."
    )


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _signal_name(code) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _MainEnd(Connection):
    """The main process's end of a worker's pipe.  multiprocessing's __del__
    closes the fd but keeps its number; the garbage collector may run it
    before the iterator's __del__ (both in one reference cycle, as a re-raised
    worker error's traceback makes), whose shutdown would then write to, and
    close, that number: by then another file's.  Closed through close(), the
    end forgets its number, and the shutdown finds it closed."""

    def __del__(self):
        self.close()


# What every worker gets alike: under spawn and forkserver, pickled once for
# all of them (see _worker/_shared_objects.py).
_SHARED_FIELDS = ("dataset", "collate_fn", "init_fn")


def _raise_unpicklable(
    e: TypeError | AttributeError | PicklingError, ctx, worker_id: int
) -> NoReturn:
    """A worker's objects could not be pickled: torch's warning, word for
    word and at its line, then an error saying what to do."""
    if _torch_api.PICKLE_ERROR_WARNING is not None:
        warn_as_torch_worker_start(_torch_api.PICKLE_ERROR_WARNING)
    method = ctx.get_start_method()
    advice = (
        f"shmloader could not start DataLoader worker {worker_id} with "
        f"multiprocessing_context={method!r}: the dataset, collate_fn or "
        f"worker_init_fn cannot be pickled ({e}). Define them at module level "
        "(no lambdas, local classes or open handles), or use "
        "multiprocessing_context='fork'."
    )
    try:
        error = type(e)(advice)
    except Exception:  # an exception class that takes other arguments
        error = None
    if error is None:
        # (add_note is Python 3.11's; before it, PEP 678's __notes__ by hand)
        e.__notes__ = [*getattr(e, "__notes__", ()), advice]  # type: ignore[union-attr]
        raise e  # e itself, as torch raises it
    raise error from e


# NOTE [pool: configured after start]
# Under spawn and forkserver a worker starts with its connections only
# (configured_worker_loop) and gets its config as its first message
# (Configure): the fields each worker has of its own, then the fds of what
# all share (SharedObjects: the dataset, collate_fn, worker_init_fn, pickled
# once).  So the process can start before its iterator exists: a
# non-persistent loader starts its next iterator's workers while the current
# epoch runs (_spare.py), and what remains at iter() is the pickling, each
# worker's unpickling, its seeding and worker_init_fn, all done then as
# torch's workers do them (the dataset as it is at iter(), the seeds drawn
# then).  Under fork a worker is its parent's memory at the fork: one forked
# early would see the dataset as it was then, so fork workers are started at
# iter() with their config.


# NOTE [pool: finished workers]
# Once a non-persistent iterator's sampler has run out (every task of the
# epoch sent), each worker is told FINISH as soon as the last batch it made
# has been unpacked in the main process (ShmLoaderIter._finish_workers):
# it says FINISHED and exits while the training loop still takes the
# epoch's last batches.  Else they would all exit at the epoch's end, the
# moment the next epoch's workers start on the same cores: tearing down a
# process forked from a server with torch in it takes some 3-4 ms of CPU,
# and the exits share the kernel's locks on the server's memory with the
# new workers' first writes to it (at SCHED_IDLE, LEAVE, an exit holding
# such a lock was seen to stall a new worker's seeding for 12 ms).  Not
# before the unpacking: a batch that carries tensors by torch's transport
# (fallback leaves) fetches their fds from the worker that sent them, which
# must still be there.  A finishing worker is watched as any other until
# its FINISHED arrives (so its death before that is reported); from then
# on it is as one told to exit, and what is sent to it after FINISH (a ring
# made meanwhile) is never read, so it is not sent.


class WorkerPool:
    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.owner_pid = os.getpid()
        self.processes: list = []
        self.pids: list[int] = []
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        self._exiting: set[int] = set()
        self._finishing: set[int] = set()  # told FINISH: what is sent after it is never read
        self._leaving_by = 0.0  # (leave_idle: when those not gone are killed)
        self._reaped: set[int] = set()  # (leave_idle: those closed since)
        self._conn_of_fd: dict[int, int] = {}
        self._sentinels: dict[int, int] = {}
        self.wait_fds: list[int] = []

    @classmethod
    def start(cls, ctx, configs, spare: WorkerPool | None = None) -> WorkerPool:
        """One worker per partial config (a dict of WorkerConfig fields but
        the connections): forked with it, or started and then sent it (see
        the NOTE), the workers of `spare` (unconfigured()'s) if given."""
        # Before new workers start, the last epoch's that have exited are reaped
        # (here, in the training thread: spare workers start in another); those
        # that are this process's children are waited for (they exited long
        # ago where anything ran between epochs), else they would linger as
        # zombies beside the new ones (a server's are its own: _forkserver.py).
        reap_leaving(wait=not children_of_a_server(ctx))
        if ctx.get_start_method() == "fork":
            pool = cls(ctx)
            pool._start_all(ctx, configs)
        else:
            pool = spare if spare is not None else cls.unconfigured(ctx, len(configs))
            pool._configure(ctx, configs)
        # As torch's iterator does: a SIGCHLD handler of torch's (it reports
        # no death here, since no pids are registered with it) replaces an
        # ignored SIGCHLD, under which exited workers could not be reaped.
        signal_handling._set_SIGCHLD_handler()
        pool._conn_of_fd = {c.fileno(): i for i, c in enumerate(pool._results)}
        pool._sentinels = {p.sentinel: i for i, p in enumerate(pool.processes)}
        pool._update_wait_fds()
        return pool

    @classmethod
    def unconfigured(cls, ctx, count: int) -> WorkerPool:
        """`count` workers waiting for their configs (spawn, forkserver)."""
        pool = cls(ctx)
        pool._start_all(ctx, [None] * count)
        return pool

    def alive(self) -> bool:
        """Whether every worker runs: one that died is gone at once here,
        where under forkserver is_alive() says so only once the server has
        reaped it and told this process."""
        return all(p.is_alive() and _running(p.pid) for p in self.processes)

    def _start_all(self, ctx, configs) -> None:
        check_room_for_workers(len(configs))
        try:
            for fields in configs:
                self._start(ctx, fields)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, ctx, fields):
        worker_tasks, main_tasks = ctx.Pipe(duplex=False)
        # (A socket: fds go over it, both ways; see the module's docstring.)
        main_results, worker_results = ctx.Pipe(duplex=True)
        main_tasks.__class__ = main_results.__class__ = _MainEnd
        if fields is None:
            target, args = configured_worker_loop, (worker_tasks, worker_results, os.getpid())
        else:
            target = worker_loop
            args = (WorkerConfig(tasks=worker_tasks, results=worker_results, **fields),)
        process = ctx.Process(target=target, args=args, daemon=True)
        try:
            process.start()
        except BaseException:
            main_tasks.close()
            main_results.close()
            raise
        finally:
            worker_tasks.close()
            worker_results.close()
        self.processes.append(process)
        self.pids.append(process.pid)
        self._tasks.append(main_tasks)
        self._results.append(main_results)

    def _configure(self, ctx, configs) -> None:
        """Send each waiting worker its config (see the NOTE)."""
        try:
            try:
                shared = SharedObjects.dump({name: configs[0][name] for name in _SHARED_FIELDS})
            except (TypeError, AttributeError, PicklingError) as e:
                _raise_unpicklable(e, ctx, configs[0]["worker_id"])
            first = _first_turn()
            turns = _turn_fds(len(configs), first)
            try:
                for i, fields in enumerate(configs):
                    own = {k: v for k, v in fields.items() if k not in _SHARED_FIELDS}
                    # Its turn fds go first (see NOTE [worker: start turns]).
                    wait, passes = turns.get(i), turns.get(i + first)
                    own["turn_wait"], own["turn_pass"] = wait is not None, passes is not None
                    own["turn_wait_s"] = TURN_WAIT_S
                    fds = [fd for fd in (wait, passes) if fd is not None] + shared.fds
                    self.send(i, Configure.wire(own, len(fds)))
                    self._send_fds(i, fds)
            finally:
                shared.close()  # (each worker has its own fds now)
                for fd in turns.values():
                    os.close(fd)
        except BaseException:
            self.shutdown()
            raise

    def _update_wait_fds(self):
        # Workers told to exit are left out: their closed pipe and fired
        # sentinel would otherwise wake every later wait at once.
        self.wait_fds = [
            fd
            for fds in (self._conn_of_fd, self._sentinels)
            for fd, i in fds.items()
            if i not in self._exiting
        ]

    def send(self, worker_id: int, msg) -> None:
        self.send_pickled(worker_id, pickled(msg))

    def send_pickled(self, worker_id: int, data: bytes) -> None:
        try:
            send_bytes(self._tasks[worker_id], data)
        except OSError as e:
            self._raise_if_gone(worker_id, e)
            raise

    def broadcast(self, msg) -> None:
        """Send one message to every worker not told to exit or finish (pickled once)."""
        self.broadcast_pickled(pickled(msg))

    def broadcast_pickled(self, data: bytes) -> None:
        for i, conn in enumerate(self._tasks):
            if i not in self._exiting and i not in self._finishing:
                try:
                    send_bytes(conn, data)
                except OSError as e:
                    self._raise_if_gone(i, e)
                    raise

    def send_ring(self, ring) -> None:
        """Hand the ring's fds to every worker (SCM_RIGHTS over its result socket)."""
        for i in range(len(self._tasks)):
            if i in self._exiting or i in self._finishing:
                continue  # (its tasks were sent before the ring was made: none needs it)
            self.send(i, RingFds.wire())
            self._send_fds(i, list(ring.fds))

    def _send_fds(self, worker_id: int, fds: list[int]) -> None:
        """The fds of the message just sent, over the worker's result socket
        (SCM_RIGHTS): the worker takes them as it reads that message."""
        conn = self._results[worker_id]
        try:
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                sendfds(s, fds)
        except OSError as e:
            self._raise_if_gone(worker_id, e)
            raise

    def stop(self, worker_id: int) -> None:
        """Tell one worker to exit (its IterableDataset is exhausted)."""
        self._stopped(worker_id)
        try:
            self._tasks[worker_id].send(EXIT)
        except OSError:
            pass

    def finish(self, worker_id: int) -> None:
        """Tell worker_id to exit, saying FINISHED first, once it has answered
        the tasks it was sent (see NOTE [pool: finished workers])."""
        if worker_id not in self._exiting and worker_id not in self._finishing:
            self.send(worker_id, FINISH)
            self._finishing.add(worker_id)

    def _stopped(self, worker_id: int) -> None:
        """worker_id is leaving: its exit is no death, its pipe no news."""
        self._exiting.add(worker_id)
        self._update_wait_fds()

    def receive(self, fired_fds):
        """(worker_id, message) for each result pipe among `fired_fds`; raises
        WorkerDied when a sentinel fired for a worker that was not told to
        exit."""
        messages = []
        for fd in fired_fds:
            worker_id = self._conn_of_fd.get(fd)
            if worker_id is not None:
                kind = None
                try:
                    msg = from_worker(self._results[worker_id].recv())
                    kind = msg.kind
                    if kind == "finished":
                        self._stopped(worker_id)
                        continue
                    if kind == "segment":  # its fds follow in the stream
                        msg = msg._replace(lease=_one_off.receive(self._results[worker_id]))
                    messages.append((worker_id, msg))
                except (EOFError, OSError, RuntimeError) as e:
                    if _out_of_fds(e) and kind == "segment":  # shmloader's own: its words
                        raise RuntimeError(
                            too_many_open_files(f"receiving a batch from worker {worker_id}")
                        ) from None
                    if _out_of_fds(e):  # a batch of torch's transport: torch's words
                        raise RuntimeError(_torch_api.TOO_MANY_FILES) from None
                    if isinstance(e, RuntimeError):
                        raise
                    self._raise_if_gone(worker_id, e)
                    raise
        if messages:
            # A worker's last words (its error, say) go first; its sentinel
            # stays readable, so the next wait reports the death.
            return messages
        for fd in fired_fds:
            if fd in self._sentinels and self._sentinels[fd] not in self._exiting:
                # A sentinel can fire a moment before the exit can be reaped.
                self.processes[self._sentinels[fd]].join(1.0)
                self.raise_if_dead()
        return messages

    def _raise_if_gone(self, worker_id: int, error: BaseException) -> None:
        """WorkerDied if worker_id died, where talking to it failed with
        `error`.  A pipe breaks (EPIPE, EOF) as the worker's process ends, and
        its exit shows a little later: a forkserver's or spawn server's
        worker's once that server has reaped it and sent its status, which a
        loaded machine delays.  So a broken pipe waits for that exit (bounded,
        in case the worker closed its pipe and lives on); another error (out
        of files) does not."""
        if isinstance(error, (EOFError, ConnectionError)):  # (BrokenPipeError is one)
            self.processes[worker_id].join(JOIN_TIMEOUT)
        self.raise_if_dead()

    def raise_if_dead(self) -> None:
        dead = [
            (i, p)
            for i, p in enumerate(self.processes)
            if i not in self._exiting and not p.is_alive()
        ]
        if dead:
            details = " ".join(
                f"DataLoader worker (pid {p.pid}) {_exit_description(p)}" for _, p in dead
            )
            which = ", ".join(
                f"worker {i}" + (f" by {_signal_name(p.exitcode)}" if (p.exitcode or 0) < 0 else "")
                for i, p in dead
            )
            killed = any(p.exitcode == -signal.SIGKILL for _, p in dead)
            raise WorkerDied(
                f"{details} ({which}; shmloader stopped the other workers"
                + ("; a worker killed by SIGKILL may have run out of memory)" if killed else ")")
            )

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every worker to exit, wait a little, then terminate stragglers;
        with graceful=False (a worker died: the rest is abandoned) terminate
        at once."""
        try:
            told = self._tell_exit()
            deadline = time.monotonic() + (JOIN_TIMEOUT if graceful else 0.0)
            for p in told:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            # Also when the wait is interrupted (Ctrl-C): as torch's shutdown,
            # whatever happened, no worker outlives it.
            self._end_processes()

    def leave_idle(self, awaited: bool = False) -> None:
        """Ask every worker to exit at its epoch's end, without waiting: they
        are reaped as they exit, by the next pool's start, so that an epoch's
        end does not wait for processes.  (A worker may still give back a
        slot of a task it was sent and never answered, its IterableDataset
        having run out first: then whoever reuses or retires the ring waits
        for them first, reap(wait=True), see ShmLoaderIter._shutdown_workers.)
        A server's workers that nobody waits for (`awaited`: the ring's next
        user will) are told LEAVE: they leave in the cores' idle time
        (_exit.step_aside), not on the cores that start the next epoch's
        workers.  This process's own children (fork) are waited for by the
        next pool's start (reap_leaving)."""
        self._leaving_by = time.monotonic() + JOIN_TIMEOUT
        quietly = children_of_a_server(self.ctx) and not awaited
        self._tell_exit(LEAVE if quietly else EXIT)
        for conn in self._tasks + self._results:
            conn.close()
        self._exiting = set(range(len(self.processes)))
        _leaving.append(self)

    def reap(self, wait: bool) -> bool:
        """After leave_idle: close the workers that have exited (with wait,
        once all have, as a shutdown waits), killing those still there past
        their time; whether all are gone."""
        for i, p in enumerate(self.processes):
            if i in self._reaped:
                continue
            if wait:
                p.join(max(0.0, self._leaving_by - time.monotonic()))
            if p.is_alive():
                if time.monotonic() < self._leaving_by:
                    continue
                p.kill()
                p.join()
            p.close()
            self._reaped.add(i)
        return len(self._reaped) == len(self.processes)

    def _tell_exit(self, message=EXIT) -> list:
        """Send every worker EXIT (or LEAVE); those it reached."""
        told = []
        for p, conn in zip(self.processes, self._tasks):
            try:
                conn.send(message)
                told.append(p)
            except OSError:
                pass  # gone, or its pipe end finalized already: nothing to wait for
        return told

    def _end_processes(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        try:
            for p in self.processes:
                if p.is_alive():
                    p.join(1.0)
        finally:  # (Ctrl-C again: a worker that ignores SIGTERM goes all the same)
            for p in self.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
                if not p.is_alive():  # else unreapable: SIGCHLD ignored, from another thread
                    p.close()  # its sentinel fds
            for conn in self._tasks + self._results:
                conn.close()
            self._exiting = set(range(len(self.processes)))


# Pools left at their epochs' ends (WorkerPool.leave_idle), until all their
# workers are reaped.
_leaving: list[WorkerPool] = []


def reap_leaving(wait: bool = False) -> None:
    """Reap the workers left at epochs' ends that have exited (with wait:
    all of them, as a shutdown waits for its workers)."""
    # Each pool is taken off the list (list.pop, atomic under the GIL) by one
    # caller alone: loaders may start in several threads at once (a
    # validation loader in a thread of its own), and a worker reaped twice
    # fails ("process object is closed").  No lock: a loader's finalizer may
    # run this from inside another call of it (the GC), where one would
    # deadlock.
    taken = []
    while _leaving:
        try:
            taken.append(_leaving.pop())
        except IndexError:  # (another thread took the last one)
            break
    for pool in taken:
        # (a forked child's copy of the list: its parent's workers)
        if pool.owner_pid == os.getpid() and not pool.reap(wait):
            _leaving.append(pool)


# The longest a worker waits for its turn to set up (NOTE [worker: start
# turns] in _worker/_turns.py); sent in its config.
TURN_WAIT_S = 0.02


def _first_turn() -> int:
    """How many workers set up at once (NOTE [worker: start turns]): one
    per core this process (and so each worker) may run on, less the one the
    training process itself runs on."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _turn_fds(count: int, first: int) -> dict[int, int]:
    """The eventfd of each worker that waits for its turn, by worker id:
    worker k waits on it, worker k - first (_first_turn()) signals it.
    Empty where no fd is left: turns are optional."""
    turns: dict[int, int] = {}
    try:
        for worker_id in range(first, count):
            turns[worker_id] = os.eventfd(0, os.EFD_CLOEXEC)
    except OSError:
        for fd in turns.values():
            os.close(fd)
        return {}
    return turns


def pickled(msg) -> bytes:
    """A message for the workers, as send_pickled() takes it.  Plain pickle: a
    task holds indices, never tensors to share, and this skips
    ForkingPickler's per-call setup on the per-batch path."""
    return pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)


def send_bytes(conn, data: bytes) -> None:
    """conn.send_bytes(data), in one os.write for a small message: a task is
    sent per batch, and Connection's checks and copies cost more than the
    write itself.  The worker reads it with its Connection as usual."""
    if len(data) > _ONE_WRITE_BYTES:
        _make_room(conn.fileno(), 2 * (len(data) + _FRAME_HEADER.size))
        conn.send_bytes(data)
        return
    frame = _FRAME_HEADER.pack(len(data)) + data
    fd = conn.fileno()
    written = os.write(fd, frame)
    while written < len(frame):  # a signal may cut a write short
        written += os.write(fd, memoryview(frame)[written:])


def _make_room(pipe_fd: int, nbytes: int) -> None:
    """Grow a task pipe to hold nbytes (up to _PIPE_MAX_BYTES).  A pipe holds
    64 KiB (the socket the tasks went over before held ~200 KiB): the tasks of
    batches of tens of thousands of indices could fill it while its worker
    computes a batch, and the training thread would wait for the worker to
    read.  Only pipes that carry such messages grow: each counts against the
    user's pipe quota (past it, the pipe stays as it is)."""
    try:
        if fcntl.fcntl(pipe_fd, fcntl.F_GETPIPE_SZ) < nbytes:
            fcntl.fcntl(pipe_fd, fcntl.F_SETPIPE_SZ, min(nbytes, _PIPE_MAX_BYTES))
    except OSError:
        pass  # EPERM: past the quota

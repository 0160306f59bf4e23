"""A worker's two channels: its inbox, which reads the task pipe (tasks, the
ring, exit) and takes the fds that follow a message over the result socket,
and send, which writes replies into that socket.  The messages on both: see
_protocol.py; why a pipe and a socket: _main/_pool.py."""

from __future__ import annotations

import collections
import copy
import errno
import socket
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler, recvfds

from torch._utils import ExceptionWrapper

from ._config import WorkerConfig
from ._exit import NoRingFds, step_aside, without_ring
from ._protocol import EXIT, FINISH, LEAVE, RingFds, from_main
from ._shared_objects import SharedObjects
from ._watch import WATCHDOG_INTERVAL, is_alive, open_pidfd

# What Inbox.next() returns when a ring's fds came: they are in Inbox.ring_fds.
RING_FDS = RingFds._make(RingFds.wire())


def receive_config(tasks, results) -> WorkerConfig | None:
    """A worker's config, its first message (Configure); None when it is told
    to exit first (a loader's spare workers, see _main/_pool.py)."""
    msg = from_main(tasks.recv())
    if msg is EXIT:
        return None
    try:
        fds = _receive_fds(results, msg.nfds)
    except NoRingFds as e:  # (its first fds: only a limit of a handful of files does that)
        without_ring(msg.fields["worker_id"], e)
    fields = dict(msg.fields)
    # Its turn fds first (see _turns.py), as the fields say it has them.
    for name in ("turn_wait", "turn_pass"):
        if fields[name]:
            fields[name] = fds.pop(0)
        else:
            fields[name] = None
    return WorkerConfig(
        tasks=tasks,
        results=results,
        dataset=None,  # (these three in `shared`)
        collate_fn=None,
        init_fn=None,
        shared=SharedObjects.received(fds),
        **fields,
    )


def _receive_fds(conn, count: int) -> list[int]:
    """The `count` fds of the message just read, from the result socket
    `conn`; NoRingFds when no fd was left to take them."""
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            return recvfds(s, count)
    except (RuntimeError, AssertionError, OSError) as e:
        # No fd left for the socket's dup, or the kernel dropped the fds.
        if isinstance(e, OSError) and e.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise NoRingFds(str(e)) from e


class Inbox:
    """Messages from the main process, read ahead so that tasks made stale by
    a later exit are skipped instead of computed.  (Tasks made stale by a
    new epoch of persistent workers are computed and dropped, as torch's
    workers do: what they draw from the RNGs is part of the next epoch's
    augmentations.)

    Waiting also watches the main process itself (NOTE [worker: two
    watchers of the main process])."""

    def __init__(self, conn, results, manager_pid):
        self._conn = conn
        self._results = results  # (the fds that follow a message come over it)
        self._pending = collections.deque()
        self._manager_pid = manager_pid
        self.manager_gone = False
        self._manager_fd = None
        try:
            self._manager_fd = open_pidfd(manager_pid)
        except ProcessLookupError:
            self.manager_gone = True
        self.ring_fds = None

    def _read_available(self, timeout):
        while self._conn.poll(timeout):
            msg = from_main(self._conn.recv())
            if msg is LEAVE:
                # At once: the main process closes the pipe behind it, and
                # reading its end (EOFError) is this worker's way out.
                step_aside()
                msg = EXIT
            if msg is not EXIT and msg is not FINISH and msg.kind == "ring":
                # The fds follow the message: take them now.
                self.ring_fds = _receive_fds(self._results, 2)
            else:
                self._pending.append(msg)
            timeout = 0

    def _sleep(self) -> None:
        """Until a message comes or the main process is gone."""
        if self._manager_fd is not None:
            fired = wait([self._conn, self._manager_fd])
            self.manager_gone = fired == [self._manager_fd]
        elif not wait([self._conn], WATCHDOG_INTERVAL):
            self.manager_gone = not is_alive(self._manager_pid)

    def next(self):
        """The next message (RING_FDS for a ring's fds), or None when told to
        exit or the main process is gone.  Sleeps in the kernel until one of
        those happens."""
        while not self._pending and self.ring_fds is None:
            if self.manager_gone:
                return None
            self._sleep()
            self._read_available(0)
        self._read_available(0)
        if self.ring_fds is not None:
            return RING_FDS
        return self._pending.popleft()

    def superseded(self) -> bool:
        """True when an exit is already queued behind the current task."""
        return any(m is EXIT for m in self._pending)


def send(results, reply: tuple) -> None:
    """results.send(reply), where an error in the reply whose exception class
    cannot be pickled (one made at run time, as boto3 makes its clients'
    errors) goes as a RuntimeError carrying that error's traceback: sending it
    as it is would kill the worker (torch's feeder thread drops it and the
    loader waits for its timeout)."""
    try:
        results.send(reply)  # pickled whole before a byte is written
    except Exception:
        if not any(isinstance(part, ExceptionWrapper) for part in reply):
            raise
        results.send(
            tuple(
                _picklable(part) if isinstance(part, ExceptionWrapper) else part for part in reply
            )
        )


def _picklable(wrapper: ExceptionWrapper) -> ExceptionWrapper:
    try:
        ForkingPickler.dumps(wrapper.exc_type)
        return wrapper
    except Exception as e:
        substitute = copy.copy(wrapper)
        substitute.exc_type = RuntimeError
        substitute.where = (
            f"{wrapper.where}, as a RuntimeError: its "
            f"{wrapper.exc_type.__qualname__} could not be pickled ({e})"
        )
        return substitute

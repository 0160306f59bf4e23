"""Whether a worker's main process still lives: the one check both watchers
use.

NOTE [worker: two watchers of the main process]
A worker watches its main process twice, with the same check: its inbox
(_worker_channels.Inbox) while it waits for a task, so that a worker with
nothing to do leaves as soon as the main process is gone; and a watchdog
thread (start_watchdog), the backstop that ends it wherever its main thread
is blocked then (in a sample, a message half sent by a dying main process, a
full pipe, a lock).  Both wait on a pidfd, readable once the process has
exited, where the kernel has them, and else ask every WATCHDOG_INTERVAL
(is_alive).  The pid comes from the main process (WorkerConfig.manager_pid),
not getppid() here, which would already name a reaper if the main process
died before this worker got this far.  (contract 5)
"""

from __future__ import annotations

import os
import select
import threading
import time

from ._exit import orphaned

# Without pidfds: how often a worker checks that its main process lives.
WATCHDOG_INTERVAL = 1.0


def open_pidfd(pid: int) -> int | None:
    """A pidfd of `pid`, readable once that process has exited, or None
    where the kernel has none (then poll is_alive).  ProcessLookupError
    where it is gone already."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):
        return None


def is_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's does: it is not
    ours to signal, but it lives)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def start_watchdog(manager_pid: int) -> None:
    """Start the thread that ends this worker as soon as its main process is
    gone (see NOTE [worker: two watchers of the main process])."""

    def watch():
        try:
            fd = open_pidfd(manager_pid)
        except ProcessLookupError:
            orphaned()
        if fd is not None:
            # poll, not select: the fd may be above select's limit of 1024
            # (a training process with many files open forks this worker).
            gone = select.poll()
            gone.register(fd, select.POLLIN)
            gone.poll()
            orphaned()
        while True:
            time.sleep(WATCHDOG_INTERVAL)
            if not is_alive(manager_pid):
                orphaned()

    threading.Thread(target=watch, name="shmloader-watchdog", daemon=True).start()

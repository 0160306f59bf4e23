"""A non-persistent loader's spare workers: started while one of its epochs
runs, configured by its next iterator (NOTE [pool: configured after start]
in _pool.py), so that the next epoch does not wait for processes to start.

Only from the loader's second iterator on: a loader iterated once (a final
test pass, a quick check) starts none, and one iterated again and again (a
training or validation loader, every epoch) has them from its second epoch's
end on."""

from __future__ import annotations

import os
import threading

from ._pool import WorkerPool


class SpareWorkers:
    """At most one set of unconfigured workers, for the loader's next iterator."""

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None
        self._starting: threading.Thread | None = None
        self._owner_pid = os.getpid()  # (whose thread _starting is)
        self._iterators = 0  # the loader's iterators so far (take() is asked by each)

    def __reduce__(self):
        # A copy of the loader (pickle, deepcopy) has none of its own yet.
        return (SpareWorkers, ())

    def start(self, ctx, count: int) -> None:
        """Start `count` workers for the next iterator (spawn and forkserver),
        unless some are waiting already.  In a thread: a start waits for the
        new process (forkserver: ~25 ms each here for the server's fork), and
        the training thread goes on meanwhile.  A start that fails leaves
        none: the next iterator starts its own, and says what failed."""
        if ctx.get_start_method() == "fork" or self._iterators < 2 or self._own() is not None:
            return
        self._starting = threading.Thread(
            target=self._start, args=(ctx, count), name="shmloader-spare-workers", daemon=True
        )
        self._owner_pid = os.getpid()
        self._starting.start()

    def _start(self, ctx, count: int) -> None:
        try:
            self._pool = WorkerPool.unconfigured(ctx, count)
        except OSError:
            pass

    def take(self, ctx, count: int) -> WorkerPool | None:
        """The waiting workers, if they are `count`, alive and started as
        `ctx` starts them; else None (and those that wait are stopped)."""
        self._iterators += 1
        pool, self._pool = self._own(), None
        if pool is None:
            return None
        if (
            pool.ctx is ctx  # (so its processes are named as ctx names them)
            and len(pool.pids) == count
            and pool.alive()
        ):
            return pool
        pool.shutdown()
        return None

    def stop(self) -> None:
        """The loader is gone (or will not use them): the waiting workers exit."""
        pool, self._pool = self._own(), None
        if pool is not None:
            pool.shutdown()

    def _own(self) -> WorkerPool | None:
        """The waiting workers, once started; None in a forked child's copy of
        the loader (they are its parent's, not its own to configure or stop)."""
        if self._starting is not None:
            if self._owner_pid != os.getpid():
                self._starting = self._pool = None
                return None
            self._starting.join()
            self._starting = None
        if self._pool is not None and self._pool.owner_pid != os.getpid():
            self._pool = None
        return self._pool

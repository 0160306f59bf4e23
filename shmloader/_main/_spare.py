"""A non-persistent loader's spare workers: started while one of its epochs
runs, configured by its next iterator (NOTE [pool: configured after start]
in _pool.py), so that the next epoch does not wait for processes to start."""

from __future__ import annotations

import os

from ._pool import WorkerPool


class SpareWorkers:
    """At most one set of unconfigured workers, for the loader's next iterator."""

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None

    def __reduce__(self):
        # A copy of the loader (pickle, deepcopy) has none of its own yet.
        return (SpareWorkers, ())

    def start(self, ctx, count: int) -> None:
        """Start `count` workers for the next iterator (spawn and forkserver),
        unless some are waiting already.  A start that fails leaves none: the
        next iterator starts its own, and says what failed."""
        if ctx.get_start_method() == "fork" or self._own() is not None:
            return
        try:
            self._pool = WorkerPool.unconfigured(ctx, count)
        except OSError:
            self._pool = None

    def take(self, ctx, count: int) -> WorkerPool | None:
        """The waiting workers, if they are `count`, alive and started as
        `ctx` starts them; else None (and those that wait are stopped)."""
        pool, self._pool = self._own(), None
        if pool is None:
            return None
        if pool.start_method == ctx.get_start_method() and len(pool.pids) == count and pool.alive():
            return pool
        pool.shutdown()
        return None

    def stop(self) -> None:
        """The loader is gone (or will not use them): the waiting workers exit."""
        pool, self._pool = self._own(), None
        if pool is not None:
            pool.shutdown()

    def _own(self) -> WorkerPool | None:
        # (A forked child's copy of the loader holds its parent's workers:
        # not its own to configure or stop.)
        if self._pool is not None and self._pool.owner_pid != os.getpid():
            self._pool = None
        return self._pool

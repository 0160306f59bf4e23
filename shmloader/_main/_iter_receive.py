"""The receiver: results from every worker, by ring slot or by pipe, in each
worker's order (see collect), kept until the iterator takes them; the
errors of fetch="sample" rows, joined to their slot."""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import wait as wait_fds
from typing import TYPE_CHECKING, Any

from .._shm._ring import SlotLease
from .._worker._protocol import ErrorReply

if TYPE_CHECKING:
    from .._worker._protocol import RowErrorReply
    from ._iter_ring import RingKeeper
    from ._pool import WorkerPool
    from ._stats import Counters

# An arrival: (task id, result), or (None, a worker's Resumed answer).
Arrival = tuple[int | None, Any]


class Receiver:
    """Arrived results, in the order the iterator may take them: see this
    module's docstring."""

    def __init__(
        self,
        *,
        ring_keeper: RingKeeper,
        pool: WorkerPool,
        counters: Counters,
        timeout: float,
        in_order: bool,
    ) -> None:
        self._keeper = ring_keeper
        self._pool = pool
        self.counters = counters  # the loader's (a copy.copy of it may take over)
        self._timeout = timeout
        self._in_order = in_order
        self._arrivals: deque[Arrival] = deque()
        self._row_errors: dict[int, dict[int, RowErrorReply]] = {}  # task id -> {row: its error}

    def next(self) -> Arrival:
        """The next result from any worker; sleeps until one comes, a worker
        dies, or the timeout passes."""
        while not self._arrivals:
            self._collect()
        return self._arrivals.popleft()

    def next_of_epoch(self, epoch_base: int) -> tuple[int, Any]:
        """(epoch index, result) of the next result of the epoch whose first
        task is `epoch_base`; an earlier epoch's are dropped."""
        while True:
            task_id, payload = self.next()
            if task_id is not None and task_id >= epoch_base:
                return task_id - epoch_base, payload
            discard(payload)

    def take(self, task_id: int) -> Any:
        """The result of task_id, once it arrives; those that come before it
        (results of tasks sent earlier) are taken first again later."""
        earlier: list[Arrival] = []
        while True:
            arrived, payload = self.next()
            if arrived == task_id:
                self._arrivals.extendleft(reversed(earlier))
                return payload
            earlier.append((arrived, payload))

    def drop_earlier(self, count: int, epoch_base: int) -> None:
        """Wait for `count` results of tasks before epoch_base (an epoch
        broken off) and drop them; the later ones that come meanwhile are
        taken first again later."""
        kept = []
        while count:
            task_id, payload = self.next()
            if task_id is not None and task_id < epoch_base:
                discard(payload)
                count -= 1
            else:
                kept.append((task_id, payload))
        self._arrivals.extendleft(reversed(kept))

    def resumed(self, num_workers: int) -> list[tuple[int, Any]]:
        """(worker_id, RNG state) of each worker's answer to a ResumeWorker,
        dropping the old epoch's results (a worker computes the old tasks
        still queued before the resume, as torch's do, so that the RNG draws
        match).  Every worker published or gave up its old tasks before it
        answered: what is left arrived with the answers and is stale too,
        and is dropped, so that its slots are free before the new epoch
        claims any."""
        answers: list[tuple[int, Any]] = []
        while len(answers) < num_workers:
            task_id, payload = self.next()
            if task_id is None:
                answers.append((payload.worker_id, payload.rng_state))
            else:
                discard(payload)
        self.drop_all()
        return answers

    def drop_all(self) -> None:
        """Drop every result that arrived and was not taken."""
        while self._arrivals:
            discard(self._arrivals.popleft()[1])

    def _collect(self) -> None:
        """Move every result that has arrived, by ring or by pipe, into
        _arrivals, sorted by task id.

        A worker answers its tasks in order, some in slots and some on its
        pipe; whatever it sent before a result we see is visible too (it
        wrote its pipe before publishing a later slot, and published before
        writing a later message).  So taking the slots, then the pipes, and
        sorting by task id keeps every worker's results in its own order,
        which in_order=False yields as they come; but the slots taken after
        reading messages (to include those published before them) may hold
        one published after a message not read yet, which then overtakes it.
        (So a resume's replay knows batches by their task numbers, not their
        order: see ShmLoaderIter._resume_epoch.)  in_order=True puts results
        in task order anyway: there the pipes are read only when no slot is
        ready, as the sleep finds them, sparing a poll() per batch; a
        message a slot overtook is read once its task is the one waited
        for, as no slot is ready then for long (no task is sent meanwhile)."""
        ring = self._keeper.ring
        leases = self._acquire_all()
        fired: list[Any] | None
        if ring is not None and leases:
            # At most a look at the pipes (one poll()), no sleep.
            fired = [] if self._in_order else ring.wait(0, self._pool.wait_fds) or []
        else:
            timeout = self._timeout if self._timeout > 0 else None
            started = time.perf_counter()
            if ring is not None:
                fired = ring.wait(timeout, self._pool.wait_fds)
            else:
                fired = _wait_fds(self._pool.wait_fds, timeout) or None
            self.counters.wait_seconds += time.perf_counter() - started
            if fired is None:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            leases = self._acquire_all()  # what the sleep ended for
            if ring is not None and leases and not self._in_order:
                fired = ring.wait(0, self._pool.wait_fds) or []
        messages = self._pool.receive(fired)
        arrivals: list[Arrival | None] = [(lease.seq, lease) for lease in leases]
        for worker_id, msg in messages:
            arrivals.append(self._accept(worker_id, msg))
        if messages:  # slots published before those messages
            arrivals.extend((lease.seq, lease) for lease in self._acquire_all())
        more: list[Arrival] = []  # messages read while waiting for row errors
        # Only a fetch="sample" slot with failed rows needs more than passing on.
        complete = [
            self._with_row_errors(a, more) if kind(a[1]) == "slot" and a[1].failed_rows else a
            for a in arrivals
            if a is not None
        ]
        complete += more
        complete.sort(key=lambda a: -1 if a[0] is None else a[0])
        self._arrivals.extend(complete)

    def _with_row_errors(self, arrival: Arrival, more: list[Arrival]) -> Arrival:
        """A fetch="sample" slot with failed rows becomes the error of its
        first failed row, a failed fetch before a failed write (torch fetches
        every sample before it collates).  Each row's error was sent before
        that row counted as done, so all of them are in the pipes by now."""
        task_id, payload = arrival
        assert task_id is not None  # (a slot's)
        errors = self._row_errors.setdefault(task_id, {})
        while len(errors) < payload.failed_rows:
            # The pipes only: the ring would wake this at once for any READY slot.
            fired = wait_fds(self._pool.wait_fds, 1.0)
            for worker_id, msg in self._pool.receive(fired):
                other = self._accept(worker_id, msg)
                if other is not None:
                    more.append(other)
        del self._row_errors[task_id]
        payload.release()
        first = min(errors, key=lambda row: (errors[row].collating, row))
        return task_id, ErrorReply._make(ErrorReply.wire(task_id, errors[first].wrapper, None))

    def _acquire_all(self) -> list[SlotLease]:
        leases = []
        ring = self._keeper.ring
        if ring is not None:
            while (lease := ring.acquire()) is not None:
                leases.append(lease)
        return leases

    def _accept(self, worker_id: int, msg: Any) -> Arrival | None:
        """The arrival for a worker's pipe message (a record of
        _protocol.py), or None for a row's error (kept until its slot
        arrives)."""
        msg_kind = msg.kind
        if msg_kind == "resumed":
            return None, msg
        if msg_kind == "row_error":
            self._row_errors.setdefault(msg.task_id, {})[msg.row] = msg
            return None
        if msg_kind == "batch" or msg_kind == "segment":
            if msg.slot_bytes_needed:
                self._keeper.measured(msg.slot_bytes_needed)
        return msg.task_id, msg


# poll() takes milliseconds in a C int: a longer timeout is slept in parts.
_LONGEST_POLL_S = (2**31 - 1) / 1000


def _wait_fds(fds, timeout):
    """multiprocessing.connection.wait(fds, timeout) for any timeout (torch's
    timeout= takes a month; the ring's wait does too)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        part = (
            None
            if deadline is None
            else max(0.0, min(deadline - time.monotonic(), _LONGEST_POLL_S))
        )
        fired = wait_fds(fds, part)
        if fired or part is None or part < _LONGEST_POLL_S:
            return fired


def kind(payload: Any) -> str:
    """A result is a worker's message, a record of _protocol.py (Batch,
    ErrorReply, Stop, ...), or, for a batch in the ring, the SlotLease of its slot."""
    return "slot" if isinstance(payload, SlotLease) else payload.kind


def discard(payload: Any) -> None:
    """Drop a result nobody will see; a slot goes straight back to the ring."""
    if kind(payload) == "slot":
        payload.release()

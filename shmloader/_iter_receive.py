"""Receiving: results from every worker, by ring slot or by pipe, in each
worker's order (see _collect); a batch unpacked from its slot into tensor
views, or from a one-off segment; pinning as torch's pin thread does.  A
mixin of ShmLoaderIter (_iterator.py), whose state it shares."""

from __future__ import annotations

import time
from multiprocessing.connection import wait as wait_fds
from typing import Any

from torch._utils import ExceptionWrapper
from torch.utils.data import _utils

from . import _layout
from ._iter_state import IterState
from ._protocol import NO_RING, RING_FULL, Error
from ._ring import SlotLease
from ._ring_memory import reserve_in_background


class Receiving(IterState):
    """ShmLoaderIter's results: see this module's docstring."""

    def _next_arrival(self):
        """(task_id, payload) of the next result from any worker, or
        (None, Resumed); sleeps until one comes, a worker dies, or the
        timeout passes."""
        while not self._arrivals:
            self._collect()
        return self._arrivals.popleft()

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
        order: see _resume_epoch.  in_order=True puts results in task order
        anyway: there the pipes are read as the sleep found them, sparing a
        poll() per batch.)"""
        ring = self._ring
        leases = self._acquire_all()
        fired: list[Any] | None
        if ring is not None and leases:
            # Only a look at the pipes (one poll()), no sleep.
            fired = ring.wait(0, self._pool.wait_fds) or []
        else:
            timeout = self._timeout if self._timeout > 0 else None
            started = time.perf_counter()
            if ring is not None:
                fired = ring.wait(timeout, self._pool.wait_fds)
            else:
                fired = _wait_fds(self._pool.wait_fds, timeout) or None
            self._counters.wait_seconds += time.perf_counter() - started
            if fired is None:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            leases = self._acquire_all()  # what the sleep ended for
            if ring is not None and leases and not self._in_order:
                fired = ring.wait(0, self._pool.wait_fds) or []
        messages = self._pool.receive(fired)
        arrivals = [(lease.seq, lease) for lease in leases]
        for worker_id, msg in messages:
            arrivals.append(self._accept(worker_id, msg))
        if messages:  # slots published before those messages
            arrivals.extend((lease.seq, lease) for lease in self._acquire_all())
        more: list[tuple[int | None, Any]] = []  # messages read while waiting for row errors
        # Only a fetch="sample" slot with failed rows needs more than passing on.
        arrivals = [
            self._with_row_errors(a, more) if _kind(a[1]) == "slot" and a[1].failed_rows else a
            for a in arrivals
            if a is not None
        ]
        arrivals += more
        arrivals.sort(key=lambda a: -1 if a[0] is None else a[0])
        self._arrivals.extend(arrivals)

    def _with_row_errors(self, arrival, more):
        """A fetch="sample" slot with failed rows becomes the error of its
        first failed row, a failed fetch before a failed write (torch fetches
        every sample before it collates).  Each row's error was sent before
        that row counted as done, so all of them are in the pipes by now."""
        task_id, payload = arrival
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
        return task_id, Error._make(Error.wire(task_id, errors[first].wrapper, None))

    def _acquire_all(self):
        leases = []
        if self._ring is not None:
            while (lease := self._ring.acquire()) is not None:
                leases.append(lease)
        return leases

    def _accept(self, worker_id, msg):
        """The arrival (task_id or None, msg) for a worker's pipe message (a
        record of _protocol.py), or None for a row's error (kept until its
        slot arrives)."""
        kind = msg.kind
        if kind == "resumed":
            return None, msg
        if kind == "row_error":
            self._row_errors.setdefault(msg.task_id, {})[msg.row] = msg
            return None
        needed = msg.slot_bytes_needed if kind == "batch" or kind == "segment" else 0
        if needed:  # measured: only with slot_bytes=None (see WorkerConfig)
            # The first batch sizes the ring, with headroom for batches that
            # vary a little.  The ring is made at the next next() call, so
            # that its prefaulting does not delay this batch; until then the
            # largest batch that arrived counts (a later batch may arrive
            # before the first one, and be smaller).  A batch that does not
            # fit the ring made since (it spilled, or was sent before the ring
            # was made) makes the slots larger when the next epoch starts
            # (see _reset), where memory holds all of them (else an outsized
            # batch would cost the ring, not just itself).
            handover = self._handover
            learned = needed + needed // 16 + 65536
            if self._ring is None:
                if learned > (handover.learned_slot_bytes or 0):
                    handover.learned_slot_bytes = learned
            elif needed > self._ring.slot_bytes - self._state_bytes:
                self._grow_for(learned)
        return msg.task_id, msg

    def _get_data(self):
        """(epoch index, data) of the next result of this epoch."""
        while True:
            task_id, payload = self._next_arrival()
            if task_id is not None and task_id >= self._epoch_base:
                return task_id - self._epoch_base, payload
            _discard(payload)

    def _first_in_turn(self, indices):
        """The first of these arrived results whose worker has answered every
        earlier task of its own, or None.  With in_order=False a slot can
        overtake its worker's earlier answer on the pipe (see _collect); torch
        never yields a worker's results out of that worker's order (a resumed
        IterableDataset relies on it), so such a result waits its turn.
        (fetch="sample" tasks belong to no one worker.)"""
        for idx in sorted(indices):
            worker_id = self._task_info[idx][0]
            if self._fetch != "batch" or not any(
                j < idx and len(info) == 1 and info[0] == worker_id
                for j, info in self._task_info.items()
            ):
                return idx
        return None

    def _unpack(self, data):
        counters = self._counters
        counters.batches += 1
        kind = _kind(data)
        if kind == "slot":
            lease = data
            counters.slot_batches += 1
            if self._reserve_rest_in:
                self._reserve_rest_in -= 1
                if not self._reserve_rest_in:
                    reserve_in_background(self._ring)
        elif kind == "segment":
            lease = data.lease  # a one-off segment's (see _one_off.py)
        else:  # "batch": pickled by torch
            counters.samples += data.samples
            self._count_outside_ring(data.reason, data.state)
            return data.data, data.state
        if lease.meta_len == 0:  # filled row by row (fetch="sample")
            meta = self._handover.sample_layout.meta(lease.rows)
        else:
            meta = lease.meta()
        batch, fallback_leaves, samples, worker_state = _layout.loads(
            meta, lease, kind == "segment" or not self._registered
        )
        counters.fallback_leaves += fallback_leaves
        counters.samples += samples
        if kind == "segment":
            self._count_outside_ring(data.reason, worker_state)
        return batch, worker_state

    def _count_outside_ring(self, reason: str, worker_state) -> None:
        """Count a batch that came outside the ring, and why."""
        counters = self._counters
        if reason == NO_RING:
            counters.unsized_batches += 1
        elif reason == RING_FULL:
            counters.ring_full_batches += 1
        else:
            counters.spilled_batches += 1
            self._warn_spill(worker_state)

    def _warn_spill(self, worker_state) -> None:
        if not self._counters.warned_spill:
            assert self._ring is not None  # (a batch spills from a slot of it)
            self._counters.warned_spill = True
            state_bytes = len(worker_state) if worker_state is not None else 0
            state = (
                f" (with the worker's state, {state_bytes} bytes: the dataset's "
                "state_dict() and the RNGs)"
                if state_bytes > self._state_bytes
                else ""
            )
            sized = (
                f"slot_bytes={self._slot_bytes}, rounded up to a page"
                if self._slot_bytes
                else "sized from the loader's first batches"
            )
            self._warn(
                f"shmloader: a batch{state} did not fit its slot "
                f"({self._ring.slot_bytes - self._state_bytes} bytes for a batch: {sized}) and was "
                "delivered whole in shared memory of its own (slower); later ones that do not fit "
                "will be too"
                + (
                    ". Pass slot_bytes= to size slots for your largest batch."
                    if self._slot_bytes
                    else " until the next epoch starts, whose ring has slots made to fit the "
                    "largest batch seen. Pass slot_bytes= to size slots for your largest batch "
                    "from the start."
                ),
                "warned_spill",
            )

    def _pin(self, batch):
        """torch's pin-memory thread's step: its errors come as that thread's."""
        try:
            return _utils.pin_memory.pin_memory(batch, self._pin_memory_device)
        except Exception:
            ExceptionWrapper(
                where=f"in pin memory thread for device {self._pin_device_id}"
            ).reraise()


# What _process_data returns for a batch fetched again after a resume and dropped.
_REPLAYED = object()


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


def _kind(payload: Any) -> str:
    """A result is a worker's message, a record of _protocol.py (Batch,
    Error, Stop, ...), or, for a batch in the ring, the SlotLease of its slot."""
    return "slot" if isinstance(payload, SlotLease) else payload.kind


def _discard(payload) -> None:
    """Drop a result nobody will see; a slot goes straight back to the ring."""
    if _kind(payload) == "slot":
        payload.release()

"""The dispatch record: one epoch's tasks, as torch's iterator keeps them
(_send_idx, _rcvd_idx, _task_info, _workers_status, ...): which were sent to
which worker, which arrived and wait for their turn, which worker takes the
next one.  Made fresh for each epoch (task ids go on from the last epoch's,
so that a late result of it is known), and shifted when a prefetched next
epoch becomes the current one."""

from __future__ import annotations

import itertools
from typing import Any


class Sent:
    """A task sent and not yet yielded: its worker, and its result once it
    arrived (None before)."""

    __slots__ = ("worker_id", "result")

    def __init__(self, worker_id: int, result: Any = None) -> None:
        self.worker_id = worker_id
        self.result = result


class DispatchRecord:
    """See this module's docstring.  Indices are epoch indices (a task's id
    less epoch_base)."""

    def __init__(self, num_workers: int, iterable: bool, epoch_base: int = 0) -> None:
        self.num_workers = num_workers
        self._iterable = iterable
        self.epoch_base = epoch_base  # task id of this epoch's first task
        self.position = 0  # epoch position of the next sample to dispatch
        self.send_idx = 0  # epoch index of the next task to send
        self.rcvd_idx = 0  # epoch index of the next batch to yield
        self.tasks: dict[int, Sent] = {}
        self.waiting: set[int] = set()  # in_order=False: results waiting for their worker's turn
        self.outstanding = 0  # tasks sent whose results have not arrived
        self.workers_status = [True] * num_workers  # False: ran out (IterableDataset)
        self.workers_num_tasks = [0] * num_workers  # sent and not yet yielded, per worker
        # IterableDataset: each task's number among its worker's, and how many
        # each worker was sent (see Progress.batch_yielded).
        self.task_numbers: dict[int, int] | None = {} if iterable else None
        self.tasks_sent = [0] * num_workers
        self._worker_cycle = itertools.cycle(range(num_workers))
        # prefetch_next_epoch: epoch index of the next epoch's first task.
        self.next_epoch_at: int | None = None

    def fresh(self) -> DispatchRecord:
        """The next epoch's record: its task ids follow this epoch's."""
        return DispatchRecord(self.num_workers, self._iterable, self.epoch_base + self.send_idx)

    @property
    def next_task_id(self) -> int:
        return self.epoch_base + self.send_idx

    @property
    def end(self) -> int:
        """The epoch index past this epoch's last task sent."""
        return self.send_idx if self.next_epoch_at is None else self.next_epoch_at

    def pass_over(self, samples: int) -> None:
        """A batch drawn and not sent (a resume yielded it already): it takes
        its place in the epoch and its worker's turn, as if it had been."""
        self.position += samples
        next(self._worker_cycle)
        self.send_idx += 1

    def next_worker(self, max_tasks: int, cap_each: bool) -> int | None:
        """The worker whose turn the next task is, as torch's round-robin
        picks it (skipping those that ran out; with cap_each, those with
        their share of max_tasks in flight), or None if none can take it."""
        for _ in range(self.num_workers):
            worker_id = next(self._worker_cycle)
            if self.workers_status[worker_id]:
                if not cap_each:
                    return worker_id
                if self.workers_num_tasks[worker_id] < max_tasks // sum(self.workers_status):
                    return worker_id
        return None

    def take_position(self, samples: int) -> int:
        """The epoch position of a batch about to be sent."""
        position = self.position
        self.position += samples
        return position

    def sent(self, worker_id: int, result: Any) -> None:
        """The next task went to worker_id (its result is known already
        where `result` is not None)."""
        self.workers_num_tasks[worker_id] += 1
        if self.task_numbers is not None:
            self.task_numbers[self.send_idx] = self.tasks_sent[worker_id]
            self.tasks_sent[worker_id] += 1
        if result is None:
            self.outstanding += 1
        self.tasks[self.send_idx] = Sent(worker_id, result)
        self.send_idx += 1

    def yielded(self, idx: int) -> tuple[int, Any, int | None]:
        """(worker, result, its number among the worker's tasks) of the
        arrived task idx, which is being yielded."""
        sent = self.tasks.pop(idx)
        self.waiting.discard(idx)
        self.workers_num_tasks[sent.worker_id] -= 1
        number = self.task_numbers.pop(idx) if self.task_numbers is not None else None
        return sent.worker_id, sent.result, number

    def next_in_line(self) -> int | None:
        """The epoch index of the next task to yield, past tasks of workers
        that ran out without an answer; None once the epoch has none left."""
        end = self.end
        while self.rcvd_idx < end:
            sent = self.tasks.get(self.rcvd_idx)
            if sent is not None:
                if sent.result is not None or self.workers_status[sent.worker_id]:
                    return self.rcvd_idx
                del self.tasks[self.rcvd_idx]
            self.rcvd_idx += 1
        return None

    def first_in_turn(self, indices: Any, per_worker: bool) -> int | None:
        """The first of these arrived results whose worker has answered every
        earlier task of its own, or None.  With in_order=False a slot can
        overtake its worker's earlier answer on the pipe (see
        Receiver._collect); torch never yields a worker's results out of that
        worker's order (a resumed IterableDataset relies on it), so such a
        result waits its turn.  (per_worker False: fetch="sample" tasks
        belong to no one worker.)"""
        for idx in sorted(indices):
            worker_id = self.tasks[idx].worker_id
            if not per_worker or not any(
                j < idx and sent.result is None and sent.worker_id == worker_id
                for j, sent in self.tasks.items()
            ):
                return idx
        return None

    def start_next_epoch(self) -> None:
        """prefetch_next_epoch: the tasks sent from now on are the next
        epoch's, dealt from worker 0 as a new epoch's are."""
        self.next_epoch_at = self.send_idx
        self.position = 0
        self._worker_cycle = itertools.cycle(range(self.num_workers))

    def adopt_next_epoch(self) -> tuple[int, list[Any]]:
        """The prefetched next epoch becomes the current one: its tasks are
        renumbered from 0, and everything about them (in flight, arrived)
        is kept.  Returns how many tasks of the epoch broken off are still in
        flight, and the results of it that arrived, for the caller to wait
        for and drop."""
        shift = self.next_epoch_at
        assert shift is not None  # (only a record with a next epoch)
        self.epoch_base += shift
        self.send_idx -= shift
        self.rcvd_idx = 0
        self.tasks = {i - shift: sent for i, sent in self.tasks.items()}
        stale, arrived = 0, []
        for idx in [i for i in self.tasks if i < 0]:
            sent = self.tasks.pop(idx)
            self.workers_num_tasks[sent.worker_id] -= 1
            if sent.result is None:
                self.outstanding -= 1
                stale += 1
            else:
                arrived.append(sent.result)
        self.waiting = set()  # (the broken-off epoch's)
        self.next_epoch_at = None
        return stale, arrived

    def arrived_results(self) -> list[Any]:
        """Results that arrived and were not yielded; forgotten here."""
        results = [sent.result for sent in self.tasks.values() if sent.result is not None]
        self.tasks, self.waiting = {}, set()
        return results

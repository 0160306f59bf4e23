"""What a worker process is started with: one WorkerConfig, made by the main
process (_main/_pool.py) and passed to worker_loop (_loop.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ._shared_objects import SharedObjects


@dataclass(frozen=True)
class WorkerConfig:
    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Callable | None  # the loader's, called as torch calls it (None too)
    slot_collate: bool  # SlotCollate in its place (it is default_collate)
    drop_last: bool
    base_seed: int
    init_fn: Callable | None
    worker_id: int
    num_workers: int
    shared_seed: int | None
    seed_per_sample: bool  # seed random/torch/numpy before each sample
    assignment: str  # fetch="sample": "interleaved" or "dynamic"
    measures_spills: bool  # slot_bytes=None: the slots grow to fit a spilled batch
    resume_state: dict | None  # plain worker state to start from (load_state_dict)
    manager_pid: int  # the main process: workers exit when it is gone
    tasks: Any  # Connection (a pipe: every message from the main process)
    results: Any  # Connection (a socket: it also brings the fds of those messages)
    # spawn and forkserver: dataset, collate_fn and init_fn, pickled once for
    # all workers (then None above); see _shared_objects.py.
    shared: SharedObjects | None = None
    # Start turns (_turns.py; spawn and forkserver): the eventfd this worker
    # waits on before its set-up (turn_wait_s at most), and the one it
    # signals once it has answered its first task; None where it has none.
    turn_wait: int | None = None
    turn_pass: int | None = None
    turn_wait_s: float = 0.0

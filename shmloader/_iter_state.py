"""The state ShmLoaderIter's parts share, declared for the type checker.

ShmLoaderIter (_iterator.py) is torch's _BaseDataLoaderIter plus mixins, one
job each: RingKeeping (_iter_ring.py), EpochPlanning (_iter_epochs.py),
Receiving (_iter_receive.py), WarnsBetweenBatches (_warn.py).  Each reads
attributes that ShmLoaderIter.__init__ or torch's __init__ set, and calls
methods another part defines.  IterState declares them, so that mypy checks
each mixin against one description of that state.  Only mypy sees it: at run
time it is `object`, so the iterator's classes and their order (MRO) are the
same with or without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import weakref
    from collections import deque
    from collections.abc import Iterator
    from typing import Any

    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from ._cuda import DeviceStage
    from ._next_epoch import PrefetchedEpoch
    from ._pool import WorkerPool
    from ._protocol import RowError
    from ._resume import Progress, Resume
    from ._ring import Ring
    from ._ring_memory import RingHandover
    from ._stats import Counters

    class IterState(_BaseDataLoaderIter):
        # -- set once, by ShmLoaderIter.__init__ and RingKeeping._init_ring
        _prefetch_factor: int
        _base_seed: int  # (torch's is the int of a tensor's item())
        _in_order: bool
        _fetch: str  # "batch" or "sample"
        _prefetch_next_epoch: bool
        _batch_size: int | None
        _counters: Counters  # the loader's: stats, once-only warning flags
        _handover: RingHandover  # the loader's: spare ring, learned slot size, layout
        _loader_ref: weakref.ReferenceType[Any]
        _pool: WorkerPool
        _progress: Progress  # what state_dict() saves
        _pin_device_id: int | None
        _slot_bytes: int | None  # the user's slot_bytes
        _sized_by_user: bool  # num_slots was given
        _nslots: int
        _state_bytes: int  # slot room for the worker state a batch carries
        _device_stage: DeviceStage | None
        _register: bool  # whether the ring is to be pinned with CUDA
        # -- the ring
        _ring: Ring | None
        _registered: bool
        _reserve_rest_in: int  # batches until the rest of a new ring is reserved
        # -- the epoch (see EpochPlanning._new_epoch_bookkeeping)
        _resume: Resume | None
        _pending_first_draw: Resume | None
        _replay: list[tuple[int, set[int]]] | None
        _skip: set[int]
        _died: str | None
        _interrupted: str | None
        _epoch: int
        _epoch_started: float
        _epoch_base: int
        _position: int
        _send_idx: int
        _rcvd_idx: int
        _task_info: dict[int, tuple[Any, ...]]  # (worker_id,) or (worker_id, data)
        _held: set[int]
        _tasks_outstanding: int
        _workers_status: list[bool]
        _workers_num_tasks: list[int]
        _task_numbers: dict[int, int] | None
        _tasks_sent: list[int]
        _worker_queue_idx_cycle: Iterator[int]
        _next_epoch_at: int | None
        _next_epoch_start: Progress
        _prefetched: PrefetchedEpoch | None
        # -- results
        _arrivals: deque[tuple[int | None, Any]]
        _row_errors: dict[int, dict[int, RowError]]

        # -- methods one part calls and another defines
        def _next_index(self) -> Any: ...
        def _try_put_index(self) -> None: ...
        def _shutdown_workers(self, graceful: bool = True) -> None: ...
        def _warn(self, message: str, flag: str | None = None) -> None: ...
        def _forget_deferred_warnings(self) -> None: ...
        def _known_slot_bytes(self) -> int | None: ...
        def _outgrown(self) -> int | None: ...
        def _start_ring(self, slot_bytes: int) -> None: ...
        def _retire_ring(self) -> None: ...
        def _grow_for(self, learned: int) -> None: ...
        def _next_arrival(self) -> tuple[int | None, Any]: ...

else:
    IterState = object

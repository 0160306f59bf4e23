"""The parts of one ShmLoaderIter (_iterator.py), made from its loader and
from the state torch's _BaseDataLoaderIter.__init__ gave the iterator (its
dataset, collate_fn, seeds, pin settings): each part is given what it needs
here, explicitly, and holds no reference to the iterator."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from torch.utils.data import _utils
from torch.utils.data.dataloader import (
    IterDataPipe,
    MapDataPipe,
    _DatasetKind,
    _sharding_worker_init_fn,
)

from .._features import _cuda
from .._worker._state import STATE_BYTES, carries_state
from . import _torch_api
from ._dispatch_record import DispatchRecord
from ._forkserver import for_workers
from ._iter_deliver import Delivery
from ._iter_epochs import EpochPlanner
from ._iter_receive import Receiver
from ._iter_ring import RingKeeper
from ._pool import WorkerPool
from ._warn import DeferredWarnings


@dataclasses.dataclass(frozen=True)
class Parts:
    deferred_warnings: DeferredWarnings
    epochs: EpochPlanner
    ring_keeper: RingKeeper
    pool: WorkerPool
    receiver: Receiver
    delivery: Delivery
    record: DispatchRecord


def build_parts(it, loader, resume) -> Parts:
    """An iterator's parts, its workers started (after its ring is known,
    before its first epoch): see the module's docstring."""
    counters = loader._counters
    deferred_warnings = DeferredWarnings(counters)
    warn = deferred_warnings.warn
    epochs = EpochPlanner(
        loader=loader,
        resume=resume,
        base_seed=it._base_seed,
        num_workers=it._num_workers,
        auto_collation=it._auto_collation,
        warn=warn,
    )
    device = loader.device
    ring_keeper = RingKeeper(
        handover=loader._ring_handover,
        counters=counters,
        warn=warn,
        num_workers=it._num_workers,
        prefetch_factor=it._prefetch_factor,
        fetch=loader.fetch,
        slot_bytes=loader.slot_bytes,
        num_slots=loader.num_slots,
        state_bytes=STATE_BYTES if carries_state(it._dataset_kind, loader.seed_per_sample) else 0,
        # Pin the ring itself (once) where batches go to a CUDA device.
        register=torch.cuda.is_available()
        and (_torch_api.pins_to_cuda(it) or (device is not None and device.type == "cuda")),
    )
    # The device torch's iterator gives its pin-memory thread (shmloader pins
    # in the training thread), looked up as the installed torch does, so that
    # a pin_memory_device with no such device fails as torch's does; before
    # the workers start, so that none is left behind then.
    pin_device_id = _torch_api.pin_thread_device(it) if it._pin_memory else None
    ctx = for_workers(loader.multiprocessing_context or torch.multiprocessing)
    try:
        pool = WorkerPool.start(
            ctx,
            _worker_fields(it, loader, resume),
            spare=loader._spare_workers.take(ctx, it._num_workers),
        )
    except BaseException:
        ring_keeper.hand_back(loader_alive=True)  # (a spare ring taken stays the loader's)
        raise
    return Parts(
        deferred_warnings=deferred_warnings,
        epochs=epochs,
        ring_keeper=ring_keeper,
        pool=pool,
        receiver=Receiver(
            ring_keeper=ring_keeper,
            pool=pool,
            counters=counters,
            timeout=it._timeout,
            in_order=loader.in_order,
        ),
        delivery=Delivery(
            ring_keeper=ring_keeper,
            counters=counters,
            warn=warn,
            pin_memory=it._pin_memory,
            pin_memory_device=it._pin_memory_device,
            pin_device_id=pin_device_id,
            device_stage=_cuda.DeviceStage(device) if device is not None else None,
        ),
        record=DispatchRecord(it._num_workers, it._dataset_kind == _DatasetKind.Iterable),
    )


def _worker_fields(it, loader, resume) -> list[dict]:
    """Per worker, what torch gives its workers, plus shmloader's options
    and (resuming) its state: WorkerConfig's fields but the connections."""
    init_fn = loader.worker_init_fn
    if isinstance(it._dataset, (IterDataPipe, MapDataPipe)):
        init_fn = functools.partial(_sharding_worker_init_fn, init_fn, it._world_size, it._rank)
    # Only batches are collated into slots: with batch_size=None torch calls
    # a default_collate passed explicitly on each sample (and its errors must
    # be torch's).
    slot_collate = it._auto_collation and it._collate_fn is _utils.collate.default_collate
    return [
        dict(
            dataset_kind=it._dataset_kind,
            dataset=it._dataset,
            auto_collation=it._auto_collation,
            collate_fn=it._collate_fn,
            slot_collate=slot_collate,
            drop_last=it._drop_last,
            base_seed=it._base_seed,
            init_fn=init_fn,
            worker_id=i,
            num_workers=it._num_workers,
            shared_seed=it._shared_seed,
            seed_per_sample=loader.seed_per_sample,
            assignment=loader.assignment,
            measures_spills=loader.slot_bytes is None,
            resume_state=resume.worker_state(i) if resume is not None else None,
            manager_pid=os.getpid(),
        )
        for i in range(it._num_workers)
    ]

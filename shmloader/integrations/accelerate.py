"""Hugging Face Accelerate with batches through shmloader's ring.

    loader = prepare_data_loader(accelerator, DataLoader(...))   # not accelerator.prepare(loader)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # (passed through)
    ...
    resumed = skip_first_batches(loader, step)     # not accelerator.skip_first_batches(loader, step)

Accelerate prepares the loader as it always does (its sharding of batches across
processes, even_batches, split_batches, device placement, gradient state,
save_state()/load_state()); only the torch DataLoader inside its result is
replaced by a shmloader DataLoader with the same arguments and the user's
shmloader options (NOTE [accelerate] in shmloader/dataloader.py).
"""

from __future__ import annotations

from typing import Any

import torch.utils.data
from accelerate.data_loader import DataLoaderAdapter
from accelerate.data_loader import skip_first_batches as _accelerate_skip_first_batches

from .._features._rebuild import options, torch_arguments
from ..dataloader import DataLoader, preparing_for_ring


def prepare_data_loader(accelerator, loader, device_placement: bool | None = None):
    """accelerator.prepare_data_loader(loader, device_placement), with the
    prepared loader's batches made by shmloader's workers in its ring, and
    loader's shmloader options kept.  `loader`: a shmloader DataLoader (a
    torch DataLoader is taken as one with the same arguments).  The result is
    Accelerate's own (DataLoaderShard or DataLoaderDispatcher), registered
    with the accelerator, and passes through accelerator.prepare()."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(
            f"prepare_data_loader expects a DataLoader, but got {type(loader).__name__}"
        )
    if isinstance(loader, DataLoaderAdapter):
        if isinstance(loader.base_dataloader, DataLoader):
            return accelerator.prepare_data_loader(loader)  # prepared here already
        raise ValueError(
            "this loader was prepared by Accelerate already, around a torch DataLoader; "
            "pass prepare_data_loader() the DataLoader you built, before "
            "accelerator.prepare() sees it."
        )
    if accelerator.distributed_type == "XLA":
        raise ValueError(
            "shmloader does not serve XLA devices (Accelerate wraps their loader in "
            "torch_xla's MpDeviceLoader); use accelerator.prepare(loader) with torch's "
            "DataLoader there."
        )
    token = preparing_for_ring.set(True)
    try:
        prepared = accelerator.prepare_data_loader(loader, device_placement=device_placement)
    finally:
        preparing_for_ring.reset(token)
    return _through_ring(prepared, options(loader))


def skip_first_batches(loader, num_batches: int = 0):
    """accelerate's skip_first_batches(loader, num_batches) (what
    Accelerator.skip_first_batches does), through shmloader's ring: for a
    loader from prepare_data_loader(), or a shmloader DataLoader."""
    base = loader.base_dataloader if isinstance(loader, DataLoaderAdapter) else loader
    if not isinstance(base, DataLoader):
        raise TypeError(
            "skip_first_batches expects a loader made by shmloader's prepare_data_loader() "
            f"or a shmloader DataLoader, but got {type(base).__name__}"
        )
    return _through_ring(_accelerate_skip_first_batches(loader, num_batches), options(base))


def _through_ring(prepared, shm_options: dict[str, Any]):
    """`prepared` (what Accelerate made) with a shmloader DataLoader where it
    has a torch one."""
    if not isinstance(prepared, DataLoaderAdapter):  # a plain loader (an unprepared one skipped)
        return DataLoader(**torch_arguments(prepared), **shm_options)
    base = prepared.base_dataloader
    # Batches placed on a CUDA device by Accelerate: shmloader's device= copies them
    # there from the pinned ring itself (send_to_device then moves nothing).
    device = getattr(prepared, "device", None)
    if shm_options.get("device") is None and device is not None:
        if torch.device(device).type == "cuda":
            shm_options = {**shm_options, "device": device}
    prepared.base_dataloader = DataLoader(**torch_arguments(base), **shm_options)
    prepared.dl_state_dict = prepared.base_dataloader.state_dict()
    prepared._is_accelerate_prepared = True
    return prepared

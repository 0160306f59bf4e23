"""A DataLoader's constructor arguments, read back from its attributes.

Frameworks that rebuild a user's loader (Accelerate, transformers' Trainer)
read torch's arguments back from its attributes and make a torch DataLoader
with them; shmloader's integrations make a shmloader DataLoader with the same
arguments instead, adding shmloader's own options.
"""

from __future__ import annotations

import torch.utils.data
from torch.utils.data import _DatasetKind

# shmloader's options beyond torch's, in DataLoader.__init__'s order.
OPTIONS = (
    "slot_bytes",
    "num_slots",
    "fetch",
    "assignment",
    "seed_per_sample",
    "prefetch_next_epoch",
    "device",
)


def torch_arguments(loader: torch.utils.data.DataLoader) -> dict:
    """The arguments that make a loader like `loader`: the same dataset,
    batching, sampling, workers and transport settings."""
    arguments = {
        "dataset": loader.dataset,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }
    # torch keeps a batch size only where it made the batch sampler itself
    # (from batch_size, drop_last and the sampler); an IterableDataset takes
    # neither sampler.
    if loader._dataset_kind == _DatasetKind.Iterable:
        arguments.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is None and loader.batch_sampler is not None:
        arguments["batch_sampler"] = loader.batch_sampler
    else:
        arguments.update(
            batch_size=loader.batch_size, drop_last=loader.drop_last, sampler=loader.sampler
        )
    return arguments


def options(loader) -> dict:
    """shmloader's options of `loader` (none for a torch DataLoader)."""
    return {name: getattr(loader, name) for name in OPTIONS if hasattr(loader, name)}

"""transformers' Trainer with its loaders made by shmloader.

    class MyTrainer(ShmloaderTrainerMixin, Trainer): ...        # or ShmloaderTrainer
    trainer = MyTrainer(model=model, args=args, train_dataset=train_set,
                        shmloader_options={"seed_per_sample": True})

The Trainer builds its loaders as it always does (TrainingArguments' workers,
pin_memory, persistent_workers, prefetch_factor, its sampler, collator and
worker seeding) and prepares them with Accelerate; each is made a shmloader
DataLoader with the same arguments plus `shmloader_options`, prepared through
shmloader.integrations.accelerate.  Resuming from a checkpoint skips the
epoch's trained batches with that module's skip_first_batches, so the rest of
the epoch stays in the ring too.  Distributed samplers get set_epoch() exactly
as the Trainer gives its own loaders (the prepared loader is Accelerate's, with
the Trainer's sampler inside).
"""

from __future__ import annotations

import contextlib

import torch.utils.data
import transformers

from .._features._rebuild import OPTIONS, torch_arguments
from ..dataloader import DataLoader
from .accelerate import prepare_data_loader, skip_first_batches

__all__ = ["ShmloaderTrainer", "ShmloaderTrainerMixin"]


class ShmloaderTrainerMixin:
    """Put before transformers.Trainer (or a subclass of it) in the bases."""

    def __init__(self, *args, shmloader_options: dict | None = None, **kwargs):
        unknown = sorted(set(shmloader_options or {}) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"shmloader_options has {', '.join(map(repr, unknown))}, which "
                f"shmloader's DataLoader does not take; its options are {', '.join(OPTIONS)}"
            )
        if not hasattr(transformers.Trainer, "get_resumed_dataloader"):
            raise RuntimeError(
                f"ShmloaderTrainerMixin needs a transformers whose Trainer has "
                f"get_resumed_dataloader() (5.x); this is transformers {transformers.__version__}"
            )
        self.shmloader_options = dict(shmloader_options or {})
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self):
        with self._loaders_through_ring():
            return super().get_train_dataloader()  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset=None):
        with self._loaders_through_ring():
            return super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset):
        with self._loaders_through_ring():
            return super().get_test_dataloader(test_dataset)  # type: ignore[misc]

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        return skip_first_batches(dataloader, num_batches)

    @contextlib.contextmanager
    def _loaders_through_ring(self):
        """While the Trainer builds a loader, its accelerator prepares a torch
        DataLoader as a shmloader one with the same arguments."""
        accelerator = self.accelerator  # type: ignore[attr-defined]
        prepare = accelerator.prepare
        options = self.shmloader_options

        def prepare_through_ring(*args, device_placement=None):
            if len(args) == 1 and type(args[0]) is torch.utils.data.DataLoader:
                shm = DataLoader(**torch_arguments(args[0]), **options)
                placement = device_placement[0] if device_placement else None
                return prepare_data_loader(accelerator, shm, device_placement=placement)
            return prepare(*args, device_placement=device_placement)

        own = vars(accelerator).get("prepare")  # (an attribute of the instance's, if any)
        accelerator.prepare = prepare_through_ring
        try:
            yield
        finally:
            if own is None:
                del accelerator.prepare  # the class's method again
            else:
                accelerator.prepare = own


class ShmloaderTrainer(ShmloaderTrainerMixin, transformers.Trainer):
    """transformers.Trainer with its loaders made by shmloader."""

"""Runs under `torchrun` (or alone): the same scenarios through Accelerate's own
prepared loader (a torch DataLoader inside) and through shmloader's
prepare_data_loader, writing what each rank saw to <out>/rank<R>.json.

    python -m tests.helpers.accelerate_driver OUT          # one process
    torchrun --nproc_per_node=2 -m tests.helpers.accelerate_driver OUT
"""

import json
import os
import sys
import tempfile

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from shmloader import DataLoader
from shmloader.integrations.accelerate import prepare_data_loader, skip_first_batches

N = 37  # not a multiple of batch size x processes: even_batches pads, or not
BATCH = 4
EPOCHS = 2
SLOT_BYTES = 1 << 16  # every batch in a ring slot from the first (stats then count them all)


class Augmented(Dataset):
    """Sample i, plus noise drawn in the worker from torch's RNG (an augmentation)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"x": torch.full((3, 4, 4), float(i)) + torch.rand(3, 4, 4), "index": i}


def _loader(cls, **options):
    return cls(
        Augmented(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
        **options,
    )


def _record(batch, device):
    # (Accelerate's several CPU processes are on "cpu:0": a CPU tensor is "cpu".)
    assert batch["x"].device.type == device.type, (batch["x"].device, device)
    return [batch["index"].tolist(), batch["x"].sum(dim=(1, 2, 3)).tolist()]


def _epochs(loader, device, epochs=EPOCHS):
    return [[_record(b, device) for b in loader] for _ in range(epochs)]


def sharding(config):
    """Accelerate's own loader and shmloader's, same seeds: batches per rank."""
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    torch.manual_seed(1)
    theirs = _epochs(accelerator.prepare(_loader(TorchDataLoader)), accelerator.device)
    torch.manual_seed(1)
    prepared = prepare_data_loader(accelerator, _loader(DataLoader, slot_bytes=SLOT_BYTES))
    # It passes through accelerator.prepare() as prepared.
    assert accelerator.prepare(prepared) is prepared
    ours = _epochs(prepared, accelerator.device)
    stats = prepared.stats()
    return {
        "theirs": theirs,
        "ours": ours,
        "class": type(prepared).__name__,
        "base": type(prepared.base_dataloader).__module__,
        "batches": stats.batches,
        "slot_batches": stats.slot_batches,
    }


def resume(steps):
    """save_state() after `steps` batches of epoch 1, load_state() in a new
    loader: the rest, against the uninterrupted run.  seed_per_sample=True:
    Accelerate writes one dl_state_dict.bin for all ranks (docs/integrations.md)."""
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    options = {"slot_bytes": SLOT_BYTES, "seed_per_sample": True}
    torch.manual_seed(2)
    loader = prepare_data_loader(accelerator, _loader(DataLoader, **options))
    uninterrupted = _epochs(loader, accelerator.device, 3)
    # (save_state() numbers an accelerator's loaders: this one is its loader 0.)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(2)
    loader = prepare_data_loader(accelerator, _loader(DataLoader, **options))
    _epochs(loader, accelerator.device, 1)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    folder = os.path.join(sys.argv[1], "state")
    accelerator.save_state(folder)
    del it
    accelerator.wait_for_everyone()
    torch.manual_seed(99)  # the resumed program's RNG is not the saved one's
    fresh = Accelerator(cpu=True, dataloader_config=config)
    resumed = prepare_data_loader(fresh, _loader(DataLoader, **options))
    fresh.load_state(folder)
    rest = [_record(b, fresh.device) for b in resumed]
    after = _epochs(resumed, fresh.device, 1)
    stats = resumed.stats()
    return {
        "expected": uninterrupted[1][steps:] + uninterrupted[2],
        "got": rest + after[0],
        "batches": stats.batches,
        "slot_batches": stats.slot_batches,
    }


def skipping(steps):
    """skip_first_batches: Accelerate's own, and shmloader's through the ring."""
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(3)
    theirs = accelerator.skip_first_batches(accelerator.prepare(_loader(TorchDataLoader)), steps)
    theirs = [_record(b, accelerator.device) for b in theirs]
    torch.manual_seed(3)
    prepared = prepare_data_loader(accelerator, _loader(DataLoader, slot_bytes=SLOT_BYTES))
    skipped = skip_first_batches(prepared, steps)
    ours = [_record(b, accelerator.device) for b in skipped]
    stats = skipped.stats()
    return {
        "theirs": theirs,
        "ours": ours,
        "base": type(skipped.base_dataloader).__module__,
        "batches": stats.batches,
        "slot_batches": stats.slot_batches,
    }


def main():
    out = sys.argv[1]
    results = {
        "sharding": {
            name: sharding(config)
            for name, config in {
                "even": {},
                "uneven": {"even_batches": False},
                "split": {"split_batches": True},
            }.items()
        },
        "resume": resume(3),
        "skip": skipping(2),
        "world": int(os.environ.get("WORLD_SIZE", "1")),
    }
    rank = int(os.environ.get("RANK", "0"))
    with tempfile.NamedTemporaryFile("w", dir=out, delete=False) as f:
        json.dump(results, f)
    os.replace(f.name, os.path.join(out, f"rank{rank}.json"))


if __name__ == "__main__":
    main()

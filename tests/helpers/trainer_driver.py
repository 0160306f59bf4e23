"""transformers' Trainer fed by its own loaders and by shmloader's, trained,
checkpointed mid-epoch, resumed: writes what each run's model saw to
<out>/trainer<RANK>.json.

    python -m tests.helpers.trainer_driver OUT
    torchrun --nproc-per-node=2 -m tests.helpers.trainer_driver OUT

(-m, from the repository's root: run as a script, tests/helpers/ would be on sys.path and its
datasets.py would pass for Hugging Face's datasets.)
"""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from shmloader.integrations.transformers import ShmloaderTrainer

N = 36
BATCH = 4  # per process
EPOCHS = 2
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # (under torchrun, each rank's share)
STEPS_PER_EPOCH = -(-N // (BATCH * WORLD))  # (the last batch padded, as Accelerate does)
RESUME_FROM = STEPS_PER_EPOCH + 3  # the one checkpoint: mid-way through epoch 1
SLOT_BYTES = 1 << 16  # every batch in a ring slot from the first


class Augmented(Dataset):
    """Sample i, plus noise drawn in the worker from torch's RNG (an augmentation)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {
            "x": torch.full((3, 4, 4), float(i)) + torch.rand(3, 4, 4),
            "labels": i % 2,
            "index": i,
        }


class Tiny(nn.Module):
    """A linear classifier that notes every batch it is given."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(48, 2)
        self.seen = []

    def forward(self, x, labels, index):
        self.seen.append([index.tolist(), x.sum(dim=(1, 2, 3)).tolist()])
        logits = self.linear(x.flatten(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Recording:
    """Keeps the loaders a Trainer trained from (shmloader's stats are read off them)."""

    def get_train_dataloader(self):
        self.loaders = [super().get_train_dataloader()]
        return self.loaders[0]

    def get_resumed_dataloader(self, dataloader, num_batches):
        self.loaders.append(super().get_resumed_dataloader(dataloader, num_batches))
        return self.loaders[-1]


class TorchTrainer(Recording, Trainer):
    pass


class ShmTrainer(Recording, ShmloaderTrainer):
    pass


def run(cls, out, resume=None, **kwargs):
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        save_strategy="steps",
        save_steps=RESUME_FROM,
        dataloader_num_workers=2,
        seed=0,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    torch.manual_seed(0)  # the same initial model in every run
    model = Tiny()
    trainer = cls(model=model, args=args, train_dataset=Augmented(), **kwargs)
    loss = trainer.train(resume_from_checkpoint=resume).training_loss
    loaders = [loader.base_dataloader for loader in trainer.loaders]
    return {
        "seen": model.seen,
        "loss": loss,
        "weights": model.linear.weight.sum().item(),
        "loaders": [type(loader).__module__ for loader in loaders],
        "options": [getattr(loader, "slot_bytes", None) for loader in loaders],
        "batches": [loader.stats().batches for loader in loaders if hasattr(loader, "stats")],
        "slot_batches": [
            loader.stats().slot_batches for loader in loaders if hasattr(loader, "stats")
        ],
    }


def main():
    out = sys.argv[1]
    shm_options = {"shmloader_options": {"slot_bytes": SLOT_BYTES}}
    results = {
        "torch": run(TorchTrainer, os.path.join(out, "torch")),
        "shm": run(ShmTrainer, os.path.join(out, "shm"), **shm_options),
    }
    for name, cls, options in (("torch", TorchTrainer, {}), ("shm", ShmTrainer, shm_options)):
        checkpoint = os.path.join(out, name, f"checkpoint-{RESUME_FROM}")
        results[name + "_resumed"] = run(
            cls, os.path.join(out, name + "_resumed"), resume=checkpoint, **options
        )
    results["world"] = WORLD
    results["steps_per_epoch"] = STEPS_PER_EPOCH
    results["resume_from"] = RESUME_FROM
    with open(os.path.join(out, f"trainer{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()

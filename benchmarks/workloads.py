"""The benchmark's workloads: one table of named presets (see shared/BENCHMARKS.md).

A sample is a clone of an array from a small pool generated once, deterministically,
when the dataset is built: producing a sample then costs the same copy whichever
loader asks for it, and the values are reproducible, so the two loaders' batches can
be compared for equality.
"""
from dataclasses import dataclass
from math import prod
from typing import Callable

import torch
from torch.utils.data import Dataset

POOL_SIZE = 8
NUM_CLASSES = 1000
SEED = 0


class PoolDataset(Dataset):
    """Map-style dataset whose item i is (a fresh copy of pool[i % pool size], a label)."""

    def __init__(self, pool: list[torch.Tensor], length: int):
        self.pool = pool
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.pool[index % len(self.pool)].clone(), index % NUM_CLASSES


def random_pool(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    if dtype == torch.uint8:
        return [torch.randint(0, 256, shape, dtype=dtype, generator=generator) for _ in range(POOL_SIZE)]
    return [torch.randn(shape, dtype=dtype, generator=generator) for _ in range(POOL_SIZE)]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    batch_size: int
    # Epoch lengths in batches, sized so that a torch epoch takes about 4 s in a full
    # run and 1 s with --quick on 2 cores: long enough for start-up and scheduling
    # noise to stay small against the figure.
    batches: int
    quick_batches: int
    sample_bytes: int
    make_dataset: Callable[[int], Dataset]  # number of samples -> dataset


def tensor_preset(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  batch_size: int, batches: int, quick_batches: int) -> Preset:
    """A preset whose sample is one dense tensor of `shape` plus an int label."""
    dims = "x".join(map(str, shape))
    type_name = str(dtype).removeprefix("torch.")
    return Preset(
        name=name,
        description=f"{type_name} {dims} + int label",
        batch_size=batch_size,
        batches=batches,
        quick_batches=quick_batches,
        sample_bytes=prod(shape) * dtype.itemsize,
        make_dataset=lambda length: PoolDataset(random_pool(shape, dtype), length),
    )


PRESETS = {p.name: p for p in [
    tensor_preset("uint8-224", (3, 224, 224), torch.uint8, batch_size=256, batches=240, quick_batches=60),
    tensor_preset("f32-512", (3, 512, 512), torch.float32, batch_size=32, batches=70, quick_batches=20),
    tensor_preset("uint8-1024", (3, 1024, 1024), torch.uint8, batch_size=16, batches=160, quick_batches=40),
    tensor_preset("tiny", (256,), torch.float32, batch_size=64, batches=4000, quick_batches=1000),
]}

"""The benchmark's workloads: one table of named presets (see docs/benchmarks.md).

A synthetic sample is a clone of an array from a small pool generated once,
deterministically, when the dataset is built: producing a sample then costs the same
copy whichever loader asks for it, and the values are reproducible, so the loaders'
batches can be compared for equality. The `jpeg` preset decodes real files instead,
written into the run's scratch folder (see jpeg_folder.py), and so does `imagefolder`,
the user-style dataset of imagefolder_example.py (outside the six workloads: bench.py
runs it when named). CostDataset adds a set cost to every sample, for the benchmarks of
loader features (see features.py). preset_dataset() hands a preset's dataset to
`python -m shmloader.compare`.
"""

import tempfile
import time
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import Dataset, Subset

POOL_SIZE = 8
NUM_CLASSES = 1000
SEED = 0
# multi-field: objects per sample. Fixed, so that torch's default collate can stack them.
OBJECTS = 16
MASK_SIDE = 128


class PoolDataset(Dataset):
    """Map-style dataset whose item i is (a fresh copy of pool[i % pool size], a label)."""

    def __init__(self, pool: list[torch.Tensor], length: int):
        self.pool = pool
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.pool[index % len(self.pool)].clone(), index % NUM_CLASSES


class CostDataset(PoolDataset):
    """PoolDataset whose item i first costs costs_ms[i]: a busy loop, which competes for
    the cores as decoding and augmenting do, or (busy=False) a sleep, which does not."""

    def __init__(
        self, pool: list[torch.Tensor], costs_ms: list[float], busy: bool, loops_per_ms: float
    ):
        super().__init__(pool, len(costs_ms))
        self.costs_ms = costs_ms
        self.busy = busy
        self.loops_per_ms = loops_per_ms

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.busy:
            spin(round(self.costs_ms[index] * self.loops_per_ms))
        else:
            time.sleep(self.costs_ms[index] / 1e3)
        return super().__getitem__(index)


def spin(loops: int) -> None:
    for _ in range(loops):
        pass


def spin_loops_per_ms(loops: int = 200_000, tries: int = 5) -> float:
    """spin()'s loops per millisecond on this machine, from the fastest of a few tries
    (the slower ones shared the core with other processes)."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        spin(loops)
        times.append(time.perf_counter() - start)
    return loops / (min(times) * 1e3)


def uneven_costs(length: int, light_ms: float, factor: float, every: int) -> list[float]:
    """light_ms per sample, but `factor` times that for one sample in `every`, chosen at
    random (with a fixed seed) so that batches hold more or fewer of them."""
    heavy = set(
        torch.randperm(length, generator=torch.Generator().manual_seed(SEED))[
            : length // every
        ].tolist()
    )
    return [light_ms * factor if i in heavy else light_ms for i in range(length)]


class DetectionDataset(Dataset):
    """Map-style dataset of detection-like samples: a dict of tensors copied from a pool
    entry, plus the sample's id and file name, which are made per index as a real
    dataset's would be."""

    def __init__(self, pool: list[dict[str, torch.Tensor]], length: int):
        self.pool = pool
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        sample = {key: value.clone() for key, value in self.pool[index % len(self.pool)].items()}
        sample["image_id"] = index
        sample["filename"] = f"images/{index:08d}.jpg"
        return sample


def random_pool(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    return [random_tensor(shape, dtype, generator) for _ in range(POOL_SIZE)]


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=generator)
    high = 256 if dtype == torch.uint8 else NUM_CLASSES
    return torch.randint(0, high, shape, dtype=dtype, generator=generator)


# multi-field: the tensor fields of a sample, (shape, dtype), in the order a detection
# dataset returns them. With image_id and filename, a sample has 8 leaves.
DETECTION_FIELDS = {
    "image": ((3, 512, 512), torch.uint8),
    "boxes": ((OBJECTS, 4), torch.float32),
    "labels": ((OBJECTS,), torch.int64),
    "masks": ((OBJECTS, MASK_SIDE, MASK_SIDE), torch.uint8),
    "area": ((OBJECTS,), torch.float32),
    "iscrowd": ((OBJECTS,), torch.uint8),
}


def detection_pool() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED)
    return [
        {
            key: random_tensor(shape, dtype, generator)
            for key, (shape, dtype) in DETECTION_FIELDS.items()
        }
        for _ in range(POOL_SIZE)
    ]


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    batch_size: int
    # Epoch lengths in batches, sized so that a torch epoch takes about 4 s in a full
    # run (2 s for the size sweep, which has many points) and about 1 s with --quick on
    # 2 cores, so that --quick finishes in under 2 minutes. shmloader's and the limit's
    # --quick epochs on the large images then last 0.1-0.2 s, short enough for a few
    # milliseconds of scheduling noise to show: the full run's are four times longer.
    batches: int
    quick_batches: int
    sample_bytes: int  # tensor bytes of one sample
    make_dataset: Callable[[int, Path], Dataset]  # (number of samples, scratch folder) -> dataset
    family: str | None = None  # presets that are points of one sweep, plotted together


def tensor_preset(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    batch_size: int,
    batches: int,
    quick_batches: int,
    family: str | None = None,
) -> Preset:
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
        make_dataset=lambda length, scratch: PoolDataset(random_pool(shape, dtype), length),
        family=family,
    )


def multi_field_preset() -> Preset:
    return Preset(
        name="multi-field",
        description=(
            f"dict of uint8 image 3x512x512, {OBJECTS} boxes, labels, areas, iscrowd, "
            f"uint8 masks {OBJECTS}x{MASK_SIDE}x{MASK_SIDE}, int id, str filename"
        ),
        batch_size=16,
        batches=320,
        quick_batches=56,
        sample_bytes=sum(
            prod(shape) * dtype.itemsize for shape, dtype in DETECTION_FIELDS.values()
        ),
        make_dataset=lambda length, scratch: DetectionDataset(detection_pool(), length),
    )


def make_jpeg_dataset(length: int, scratch: Path) -> Dataset:
    import jpeg_folder  # Pillow is needed by this preset only

    return jpeg_folder.JpegFolderDataset(jpeg_folder.ensure_tree(scratch / "jpeg"), length)


def jpeg_preset() -> Preset:
    return Preset(
        name="jpeg",
        description="ImageFolder of ~500x375 JPEGs, Pillow decode, random-resized-crop 224 + flip -> uint8 3x224x224",
        batch_size=128,
        batches=40,
        quick_batches=6,
        sample_bytes=3 * 224 * 224,
        make_dataset=make_jpeg_dataset,
    )


def make_imagefolder_dataset(length: int, scratch: Path) -> Dataset:
    import imagefolder_example  # Pillow is needed by this preset only
    import jpeg_folder

    dataset = imagefolder_example.make_dataset(
        scratch / "imagefolder", -(-length // jpeg_folder.CLASSES)
    )
    return dataset if len(dataset) == length else Subset(dataset, range(length))


def imagefolder_preset() -> Preset:
    return Preset(
        name="imagefolder",
        description="imagefolder_example.py: ImageFolder of ~500x375 JPEGs, random-resized-crop 224 + flip "
        "(torch's global generator), to float, normalised -> float32 3x224x224",
        batch_size=64,
        batches=20,
        quick_batches=5,
        sample_bytes=3 * 224 * 224 * 4,
        make_dataset=make_imagefolder_dataset,
    )


SIZE_SWEEP = "size-sweep"
# (name suffix, shape, batches, quick batches): float32 samples of about 1 KB to 12 MB,
# with epochs of about 2 s for torch at batch 16 (0.5 s with --quick).
SIZE_SWEEP_POINTS = [
    ("1k", (1, 16, 16), 2000, 500),
    ("16k", (1, 64, 64), 1500, 400),
    ("256k", (1, 256, 256), 600, 150),
    ("1m", (1, 512, 512), 200, 50),
    ("4m", (1, 1024, 1024), 60, 15),
    ("12m", (3, 1024, 1024), 20, 6),
]


def size_sweep_presets() -> list[Preset]:
    return [
        tensor_preset(
            f"{SIZE_SWEEP}-{suffix}",
            shape,
            torch.float32,
            batch_size=16,
            batches=batches,
            quick_batches=quick,
            family=SIZE_SWEEP,
        )
        for suffix, shape, batches, quick in SIZE_SWEEP_POINTS
    ]


PRESETS = {
    p.name: p
    for p in [
        tensor_preset(
            "uint8-224", (3, 224, 224), torch.uint8, batch_size=256, batches=240, quick_batches=40
        ),
        tensor_preset(
            "f32-512", (3, 512, 512), torch.float32, batch_size=32, batches=70, quick_batches=14
        ),
        tensor_preset(
            "uint8-1024", (3, 1024, 1024), torch.uint8, batch_size=16, batches=160, quick_batches=28
        ),
        tensor_preset(
            "tiny", (256,), torch.float32, batch_size=64, batches=4000, quick_batches=600
        ),
        multi_field_preset(),
        jpeg_preset(),
        imagefolder_preset(),
        *size_sweep_presets(),
    ]
}
# The six workloads of docs/benchmarks.md, which --quick runs; a full run adds the sweep.
WORKLOADS = ("uint8-224", "f32-512", "uint8-1024", "tiny", "multi-field", "jpeg")
FAMILIES = {SIZE_SWEEP: tuple(name for name, p in PRESETS.items() if p.family == SIZE_SWEEP)}

# Where preset_dataset's jpeg and imagefolder presets write their files, kept for the next run.
DEFAULT_SCRATCH = Path(tempfile.gettempdir()) / "shmloader-bench"


def preset_dataset(name: str, length: int, scratch: str = str(DEFAULT_SCRATCH)) -> Dataset:
    """A preset's dataset of `length` samples, as bench.py builds it, for
    `python -m shmloader.compare`:

        python -m shmloader.compare --dataset benchmarks/workloads.py:preset_dataset \\
            --dataset-args '{"name": "jpeg", "length": 768}' --batch-size 128 --persistent-workers
    """
    if name not in PRESETS:
        raise ValueError(f"there is no preset {name!r}; the presets are {', '.join(PRESETS)}")
    return PRESETS[name].make_dataset(length, Path(scratch))

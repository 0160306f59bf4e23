"""A real training loop (forward, backward, optimizer step) fed three ways in one run:
torch's DataLoader, shmloader's, and the ideal (the same batches already in memory, no
loader at all). What users feel: steps/s, and what the loader takes from the training
thread.

    python benchmarks/train.py --quick            # the cases below, 2 workers: under 3 min
    python benchmarks/train.py                     # more steps and repetitions
    python benchmarks/train.py --device cuda       # on a GPU (see below)
    python benchmarks/train.py --case tiny/data --workers 4

Cases: a workload (the samples, and what the workers do to them) and a model, chosen so
that either the model bounds the loop (the loader must keep up and stay out of the way)
or the data does (the loader's throughput is the loop's):

    uint8-224/model   uint8 3x224x224, 256 a batch, random flip + brightness in the workers;
                      a channels-last ConvNet on a 1/2-scale view (model-bound)
    uint8-224/data    the same batches; the ConvNet on a 1/8-scale view (data-bound)
    uint8-1024/data   uint8 3x1024x1024, 4 a batch, random flip; a patchifying model on a
                      1/4-scale view (data-bound)
    jpeg/data         JPEG files, Pillow decode + random-resized-crop 224 + flip, 64 a
                      batch; the 1/4-scale model (decode-bound)
    tiny/data         float32 256 + label, 64 a batch: a 3-layer MLP (many small batches:
                      the loader's cost per batch bounds the loop)
    vit/model         uint8-224's batches, 64 a batch; a small ViT (model-bound)

On the CPU the cores are split, and said so in the record: the training process (the
model, with --threads intra-op threads, default 1) keeps the first --threads cores, the
workers share the others (their affinity is set by a worker_init_fn, the same for both
loaders). Conditions alternate (torch, shmloader, ideal, then rotated) and repeat, so
noise hits all three; figures are medians over the repetitions, with their spread.

Per condition: steps/s and samples/s; the loop's speed as a percentage of the ideal's;
time per step inside next() (waiting, plus the loader's own work on the training thread)
and the training thread's CPU inside next(); main-process CPU per step (all its threads,
the model's work included: the loader's share is what exceeds the ideal's); the loader's
peak memory (its workers' private memory and the shared memory of the batches in the
training process; see loader_bytes), sampled in a pass of its own, one loader alive at a
time.

With --device cuda the model trains on the GPU; both loaders use pin_memory=True and the
loop copies with non_blocking=True, as PyTorch's docs advise; a third condition is
shmloader with device= (it copies each batch there itself). GPU busy time is measured
with CUDA events around each step's work. The ideal's batches are already on the GPU.
"""

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import report
import torch
import torch.utils.data
from torch import nn
from workloads import make_jpeg_dataset

from shmloader import DataLoader as ShmDataLoader
from shmloader.bench import plot
from shmloader.bench.machine import proc_bytes
from shmloader.bench.memory import PeakSampler, psutil
from shmloader.bench.progress import StatusLine

DEFAULT_OUT = report.RESULTS / "train.json"
SEED = 0
POOL = 8  # distinct source samples each workload clones from
# (full, --quick): warm-up steps, timed steps, repetitions per condition, memory-pass steps
STEPS = {False: (5, 40, 5, 10), True: (3, 12, 3, 6)}


# ---- data ---------------------------------------------------------------------------------


class Images(torch.utils.data.Dataset):
    """uint8 images cloned from a small pool, lightly augmented in the worker: a random
    horizontal flip and, with `brightness`, a random brightness shift (torch's RNG, so
    each loader's workers draw alike from the same seeds)."""

    def __init__(self, shape: tuple[int, ...], length: int, brightness: bool = True):
        generator = torch.Generator().manual_seed(SEED)
        self.pool = [
            torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
            for _ in range(POOL)
        ]
        self.length = length
        self.brightness = brightness

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.pool[index % POOL]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        else:
            image = image.clone()
        if self.brightness:
            shift = int(torch.randint(-16, 17, ()))
            image = image.add_(shift) if shift >= 0 else image.sub_(-shift)
        return image, index % 1000


class Vectors(torch.utils.data.Dataset):
    """float32 256 + a label: a small sample, many per second."""

    def __init__(self, length: int):
        generator = torch.Generator().manual_seed(SEED)
        self.pool = [torch.randn(256, generator=generator) for _ in range(POOL)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.pool[index % POOL] + 0.01 * torch.randn(256), index % 10


# ---- models -------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """A small channels-last ConvNet: a stride-4 stem, two stride-2 stages, a classifier."""

    def __init__(self, classes: int = 1000, scale: int = 1):
        super().__init__()
        self.scale = scale  # look at a 1/scale view of the image (a data-bound model)
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 4, stride=4),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.scale > 1:
            images = images[:, :, :: self.scale, :: self.scale]
        x = images.float().div_(255).contiguous(memory_format=torch.channels_last)
        return self.head(self.features(x))


class Patchify(nn.Module):
    """For very large images: 32x32 patches of a 1/4-scale view embedded by one strided
    conv, pooled."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.embed = nn.Conv2d(3, 32, 32, stride=32)
        self.head = nn.Linear(32, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images[:, :, ::4, ::4].float().div_(255).contiguous(memory_format=torch.channels_last)
        return self.head(self.embed(x).mean(dim=(2, 3)))


class ViT(nn.Module):
    """A small vision transformer: 16x16 patches of a 1/2-scale view, 4 layers, width 128."""

    def __init__(self, classes: int = 1000, width: int = 128, layers: int = 4):
        super().__init__()
        self.embed = nn.Conv2d(3, width, 16, stride=16)
        self.position = nn.Parameter(torch.zeros(1, 49, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images[:, :, ::2, ::2].float().div_(255)
        x = self.embed(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.encoder(x).mean(dim=1))


class MLP(nn.Sequential):
    def __init__(self, classes: int = 10):
        super().__init__(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, classes)
        )


# ---- cases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    bound: str  # "model" or "data": what is meant to bound the loop
    batch_size: int
    make_dataset: Callable[[int, Path], torch.utils.data.Dataset]
    make_model: Callable[[], nn.Module]
    description: str
    steps_scale: int = 1  # more steps where one takes a millisecond or two


CASES = [
    Case(
        "uint8-224/model",
        "model",
        256,
        lambda n, scratch: Images((3, 224, 224), n),
        lambda: ConvNet(scale=2),
        "uint8 3x224x224, 256 a batch, flip + brightness in the workers; a channels-last ConvNet on a 1/2-scale view",
    ),
    Case(
        "uint8-224/data",
        "data",
        256,
        lambda n, scratch: Images((3, 224, 224), n),
        lambda: ConvNet(scale=8),
        "the same batches; the ConvNet on a 1/8-scale view",
    ),
    Case(
        "uint8-1024/data",
        "data",
        4,
        lambda n, scratch: Images((3, 1024, 1024), n, brightness=False),
        Patchify,
        "uint8 3x1024x1024, 4 a batch, flip in the workers; a 32x32-patch embedding of a 1/4-scale view",
    ),
    Case(
        "jpeg/data",
        "data",
        64,
        make_jpeg_dataset,
        lambda: ConvNet(scale=4),
        "JPEG folder, Pillow decode + random-resized-crop 224 + flip, 64 a batch; ConvNet on a 1/4-scale view",
    ),
    Case(
        "tiny/data",
        "data",
        64,
        lambda n, scratch: Vectors(n),
        MLP,
        "float32 256 + label, 64 a batch (many batches a second); a 3-layer MLP",
        steps_scale=20,
    ),
    Case(
        "vit/model",
        "model",
        64,
        lambda n, scratch: Images((3, 224, 224), n),
        ViT,
        "uint8 3x224x224, 64 a batch, flip + brightness; a 4-layer ViT on a 1/2-scale view",
    ),
]


# ---- the loop -----------------------------------------------------------------------------


class WorkerCores:
    """worker_init_fn: the workers on the cores the training process leaves them."""

    def __init__(self, cores: set[int]):
        self.cores = cores

    def __call__(self, worker_id: int) -> None:
        if self.cores:
            os.sched_setaffinity(0, self.cores)


@dataclass
class Trainer:
    """One model and optimizer, trained the same way whatever feeds it."""

    model: nn.Module
    device: torch.device
    non_blocking: bool

    def __post_init__(self) -> None:
        self.model.to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.cuda = self.device.type == "cuda"

    def step(self, batch) -> None:
        inputs, labels = batch
        inputs = inputs.to(self.device, non_blocking=self.non_blocking)
        labels = labels.to(self.device, non_blocking=self.non_blocking)
        loss = nn.functional.cross_entropy(self.model(inputs), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def timed_steps(trainer: Trainer, batches, warmup: int, steps: int) -> dict[str, float]:
    """`warmup` steps, then `steps` timed ones, from the iterator `batches`."""
    for _ in range(warmup):
        trainer.step(next(batches))
    if trainer.cuda:
        torch.cuda.synchronize()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(steps)
        ]
    in_next = in_next_cpu = 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        batch = next(batches)
        in_next += time.perf_counter() - t
        in_next_cpu += time.thread_time() - c
        if trainer.cuda:
            events[i][0].record()
        trainer.step(batch)
        if trainer.cuda:
            events[i][1].record()
    if trainer.cuda:
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    figures = {
        "steps_per_s": steps / wall,
        "next_ms": in_next / steps * 1e3,
        "next_cpu_ms": in_next_cpu / steps * 1e3,
        "main_cpu_ms": cpu / steps * 1e3,
    }
    if trainer.cuda:
        busy = sum(start.elapsed_time(end) for start, end in events) / 1e3
        figures["gpu_busy"] = busy / wall
    return figures


def loader_bytes() -> int:
    """The loader's memory: its workers' private memory (USS: what a worker alone maps,
    copies of the training process's pages it wrote included) and the shared memory
    mapped in the training process (the batches it holds: torch's segments, shmloader's
    ring), whole. Not PSS: a forked worker shares the training process's heap (the
    model's, the ideal's batches), and PSS would charge it a share of that."""
    me = psutil.Process()
    total = proc_bytes(f"/proc/{me.pid}/status", "RssShmem")
    for child in me.children(recursive=True):
        try:
            total += proc_bytes(f"/proc/{child.pid}/smaps_rollup", "Private_Clean", "Private_Dirty")
        except OSError:  # a worker that exited after being listed
            continue
    return total


class LoaderMemory(PeakSampler):
    """The peak of loader_bytes() while the `with` block runs."""

    def __init__(self):
        super().__init__(interval_s=0.02)
        self.peak = 0

    def _take(self) -> None:
        self.peak = max(self.peak, loader_bytes())


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def run_case(case: Case, args, scratch: Path, status: StatusLine) -> dict[str, Any]:
    warmup, steps, reps, memory_steps = (
        n * (case.steps_scale if i != 2 else 1) for i, n in enumerate(STEPS[args.quick])
    )
    needed = warmup + max(steps, memory_steps)
    dataset = case.make_dataset(needed * case.batch_size, scratch)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    common = dict(
        batch_size=case.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        pin_memory=cuda,
        drop_last=True,
        worker_init_fn=WorkerCores(args.worker_cores),
    )

    def loader(cls, **extra):
        return cls(dataset, generator=torch.Generator().manual_seed(SEED), **common, **extra)

    makers = {
        "torch": lambda: loader(torch.utils.data.DataLoader),
        "shmloader": lambda: loader(ShmDataLoader),
    }
    if cuda:
        makers["shmloader device="] = lambda: loader(ShmDataLoader, device=device)
    loaders = {name: make() for name, make in makers.items()}
    # The ideal's batches: torch's first epoch, kept; shmloader's must be the same.
    status(f"{case.name}: the batches")
    reference = [tuple(t.clone() for t in b) for b in loaders["torch"]]
    check = [tuple(t.clone() for t in b) for b in loaders["shmloader"]]
    if not all(same(a, b) for a, b in zip(reference, check)) or len(check) != len(reference):
        raise SystemExit(f"{case.name}: shmloader's batches differ from torch's")
    del check
    # Each way of feeding the loop, as a fresh iterator over the run's batches (a loader
    # made once, persistent workers; the ideal's batches already on the device).
    on_device = [tuple(t.to(device) for t in b) for b in reference]
    conditions = {name: (lambda ld=ld: iter(ld)) for name, ld in loaders.items()}
    conditions["ideal"] = lambda: iter(on_device)

    torch.manual_seed(SEED)
    trainer = Trainer(case.make_model(), device, non_blocking=cuda)
    trainer.model.to(memory_format=torch.channels_last)  # (the conv weights)
    # The model's first steps are slower for a while (the allocator's thresholds settle as
    # its large blocks come and go): untimed, on the ideal's batches, before any condition.
    status(f"{case.name}: warming the model up")
    timed_steps(trainer, itertools.cycle(on_device), 0, 2 * warmup + 4)
    names = list(conditions)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            status(f"{case.name}: {name}, repetition {rep + 1} of {reps}")
            samples[name].append(timed_steps(trainer, conditions[name](), warmup, steps))
    # Memory: each way of feeding alone (a fresh loader, no other's workers alive), its
    # peak sampled by a thread, which would cost the timed steps CPU.
    del loaders, conditions
    memory = {}
    for name in makers if psutil is not None else []:
        status(f"{case.name}: {name}, memory")
        made = makers[name]()
        with LoaderMemory() as peak:
            timed_steps(trainer, iter(made), 0, memory_steps)
        memory[name] = peak.peak
        del made
    rows = {}
    for name, runs in samples.items():
        rate = [r["steps_per_s"] for r in runs]
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        row["spread"] = (max(rate) - min(rate)) / statistics.median(rate)
        row["samples_per_s"] = row["steps_per_s"] * case.batch_size
        row["loader_bytes"] = memory.get(name)
        rows[name] = row
    for row in rows.values():
        row["of_ideal"] = row["steps_per_s"] / rows["ideal"]["steps_per_s"]
    return {
        "case": case.name,
        "bound": case.bound,
        "description": case.description,
        "batch_size": case.batch_size,
        "workers": args.workers,
        "steps": steps,
        "warmup": warmup,
        "repetitions": reps,
        "rows": rows,
        "samples": samples,
    }


def core_split(threads: int, device: str) -> tuple[set[int], set[int], str]:
    """(the training process's cores, the workers' cores, how they were split, in words)."""
    cores = sorted(os.sched_getaffinity(0))
    if device != "cpu" or len(cores) <= threads:
        return set(cores), set(cores), f"{len(cores)} cores, shared by all"
    main, workers = set(cores[:threads]), set(cores[threads:])
    words = (
        f"{len(cores)} cores: the training process on {len(main)} (the model with "
        f"{threads} intra-op thread{'s' if threads > 1 else ''}), the workers on {len(workers)}"
    )
    return main, workers, words


# glibc's malloc hands the models' large activations back to the kernel and maps them
# again at every step, unless told otherwise before the interpreter starts (it reads these
# once): the ConvNet's steps then vary by +-20% from one repetition to the next here, and
# run a third slower, which would drown the loaders' differences. Kept for the whole tree,
# so both loaders' workers run with them too.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def with_steady_malloc() -> None:
    """Run this script again with MALLOC_ENV set, where it is not (the same arguments)."""
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--case", nargs="+", choices=[c.name for c in CASES], help="these only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="the model's intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON record")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False here")
    main_cores, args.worker_cores, split = core_split(args.threads, args.device)
    document = report.new_document(  # (the machine as it is, before the split below)
        benchmark="train",
        device=args.device,
        workers=args.workers,
        cores=split,
        malloc=MALLOC_ENV,
        runs=[],
    )
    os.sched_setaffinity(0, main_cores)  # (the workers set theirs as they start)
    torch.set_num_threads(args.threads)
    status = StatusLine("train.py")
    cases = [c for c in CASES if not args.case or c.name in args.case]
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases:
            document["runs"].append(run_case(case, args, Path(scratch), status))
            status.clear()
            print(report.train_table(document["runs"][-1]) + "\n", flush=True)
    print(f"{split}\n{report.write_with_chart(document, args.out, plot.write_train)}")
    return 0


if __name__ == "__main__":
    with_steady_malloc()
    sys.exit(main())

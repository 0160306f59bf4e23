"""Where the main process's CPU per batch goes: the same per-batch work, with batches
arriving back to back or far apart.

    python benchmarks/main_cpu.py [--quick]

bench.py reports 0.2-0.3 ms of main-process CPU per batch on the large workloads and
0.06 ms on `tiny`, though the main process does the same few dozen Python steps per
batch on every workload (see shmloader/_main/_iterator.py). This separates the two things
that differ: how much memory the workers stream, and how long the main process sleeps
between batches. The dataset returns the same small tensor for every index, with no
copy, so the workers stream almost nothing; a sleep in one sample of each batch spaces
the batches out without using a core. Each row is both loaders over the same dataset
object, 2 workers, persistent, the consumer reading one element per tensor as bench.py's
does; figures are main-process CPU (time.process_time) per batch less the consumer's own,
as bench.py reports it, median of 3 epochs after a warm-up one, the two loaders' epochs
interleaved (see shmloader/bench/measure.py), with each loader's own time between
batches beside it (torch's back to back is slower).
If the CPU per batch grows with the interval alone, it is the cost of running the same
code on caches that other processes have since filled (the main process sleeps in
poll() between batches), not work that grows with batch bytes. Figures go to
results/main_cpu.json.
"""

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import report
import torch
from torch.utils.data import Dataset

import shmloader
from shmloader.bench.measure import batch_spec, interleaved, timed_epoch

DEFAULT_OUT = report.RESULTS / "main_cpu.json"
WORKERS = 2
BATCH_SIZE = 64
INTERVALS_MS = (0.0, 0.5, 5.0, 25.0)  # target time between batches
EPOCHS = 3  # timed epochs per loader, after a warm-up one


class SpacedBatches(Dataset):
    """Float32 256 + label, the same tensor each time; the first sample of every batch
    sleeps 2 * interval (two workers share the batches)."""

    def __init__(self, batches: int, interval_ms: float):
        self.sample = torch.ones(256)
        self.length = batches * BATCH_SIZE
        self.sleep_s = 2 * interval_ms / 1e3

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        if self.sleep_s and index % BATCH_SIZE == 0:
            time.sleep(self.sleep_s)
        return self.sample, index


def _quiet(line: str) -> None:
    """No progress line per epoch: the interval's line says what runs."""


def epoch_ms_per_batch(loader, spec) -> tuple[float, float]:
    """(main-process CPU ms per batch less the consumer's own, wall ms per batch) of one
    epoch, measured as bench.py measures it."""
    epoch = timed_epoch(loader, spec)
    return epoch.loader_cpu_s / epoch.batches * 1e3, epoch.wall_s / epoch.batches * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches per interval")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    document = report.new_document(workers=WORKERS, batch_size=BATCH_SIZE)
    rows = []
    for interval_ms in INTERVALS_MS:
        batches = 200 if interval_ms < 1 else (40 if args.quick else 80)
        dataset = SpacedBatches(batches, interval_ms)
        row = {"interval_ms": interval_ms, "batches": batches}
        print(f"batches every ~{interval_ms} ms ...", file=sys.stderr)
        loaders = {
            name: cls(dataset, batch_size=BATCH_SIZE, num_workers=WORKERS, persistent_workers=True)
            for name, cls in (
                ("torch", torch.utils.data.DataLoader),
                ("shmloader", shmloader.DataLoader),
            )
        }
        spec = batch_spec(next(iter(loaders["torch"])))
        for loader in loaders.values():  # a warm-up epoch each
            epoch_ms_per_batch(loader, spec)
        figures = interleaved(
            {
                name: functools.partial(epoch_ms_per_batch, loader, spec)
                for name, loader in loaders.items()
            },
            EPOCHS,
            _quiet,
            "epoch",
        )
        for name, epochs in figures.items():
            row[f"{name}_cpu_ms"] = statistics.median(cpu for cpu, _ in epochs)
            row[f"{name}_wall_ms"] = statistics.median(wall for _, wall in epochs)
        del loaders
        rows.append(row)
    lines = [
        [
            "target between batches",
            "torch: between batches",
            "CPU ms/batch",
            "shmloader: between batches",
            "CPU ms/batch",
        ]
    ]
    for row in rows:
        lines.append(
            [
                f"{row['interval_ms']} ms",
                f"{row['torch_wall_ms']:.2f} ms",
                f"{row['torch_cpu_ms']:.3f}",
                f"{row['shmloader_wall_ms']:.2f} ms",
                f"{row['shmloader_cpu_ms']:.3f}",
            ]
        )
    print("\n".join(report.aligned(lines)))
    document["rows"] = rows
    report.write_json(document, args.out)
    print(f"\nfigures written to {args.out}")


if __name__ == "__main__":
    main()

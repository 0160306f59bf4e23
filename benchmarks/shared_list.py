"""What a SharedList index saves forked workers (pytorch issue 13246), and what it costs.

    python benchmarks/shared_list.py [--entries 2000000] [--workers 2] [--out PATH]

The index: `--entries` ImageFolder-style (path, class) tuples, 1000 classes, paths like
"/data/imagenet21k/train/n00000123/n00000123_246000.JPEG".  Three figures:

1. Per-worker USS growth over one shuffled epoch (fork, as DataLoader starts workers on
   Linux), the dataset holding the index as a list and as a SharedList, under torch's
   DataLoader and shmloader's.  Each of the four runs is a fresh process.  A worker's
   __getitem__ unpacks its entry as ImageFolder does and returns a number derived from
   it, so what grows is the index, not images.  Growth: a worker's USS when the epoch's
   last batch arrives less its USS when the first batch did (by then each worker has
   read at most a few batches' entries: under 0.5 % of the index).
2. Building the SharedList: wall and CPU time (medians of 3), the segment's bytes, the most
   the build's heap held beside it (tracemalloc, a 4th build), against the entries'
   content (the paths' UTF-8 bytes, 8 bytes a label).
3. sl[i] against list[i]: CPU time per call over 1 M shuffled indices (the order an
   epoch reads in), the best of 5 rounds.  CPU, not wall, time: on a shared machine a
   wall clock counts time other processes ran.

The figures go to results/shared_list.json.
"""

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import psutil
import report
import torch

import shmloader
from shmloader import SharedList

LOADERS = {"torch": torch.utils.data.DataLoader, "shmloader": shmloader.DataLoader}
CLASSES = 1000
BATCH_SIZE = 1000
MIB = 1 << 20
DEFAULT_OUT = report.RESULTS / "shared_list.json"


def make_index(entries: int) -> list:
    per_class = max(1, entries // CLASSES)
    return [
        (
            f"/data/imagenet21k/train/n{i // per_class:08d}/n{i // per_class:08d}_{i}.JPEG",
            i // per_class,
        )
        for i in range(entries)
    ]


class IndexDataset(torch.utils.data.Dataset):
    """ImageFolder's __getitem__ without the image."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        return target + len(path)


def _uss(pids) -> dict:
    return {pid: psutil.Process(pid).memory_full_info().uss for pid in pids}


def epoch_growth(loader_name: str, index_kind: str, entries: int, workers: int) -> dict:
    """One shuffled epoch in this process (run it in a fresh one): each worker's USS
    growth, in bytes."""
    samples = make_index(entries)
    if index_kind == "SharedList":
        samples = SharedList(samples)  # the one line a user changes
        gc.collect()
    loader = LOADERS[loader_name](
        IndexDataset(samples),
        batch_size=BATCH_SIZE,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    batches = len(loader)
    me = psutil.Process()
    start = time.perf_counter()
    for number, _ in enumerate(loader, 1):
        if number == 1:
            pids = [child.pid for child in me.children()]
            first = _uss(pids)
        if number == batches:
            last = _uss(pids)
    return {
        "growth": [last[pid] - first[pid] for pid in pids],
        "uss_at_end": [last[pid] for pid in pids],
        "epoch_s": time.perf_counter() - start,
    }


def build_cost(index: list) -> dict:
    content = sum(len(path.encode()) + 8 for path, _ in index)
    times, cpu_times = [], []
    for _ in range(3):
        start, cpu_start = time.perf_counter(), time.process_time()
        shared = SharedList(index)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        del shared
    tracemalloc.start()
    shared = SharedList(index)
    heap_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "build_s": statistics.median(times),
        "build_s_all": times,
        "build_cpu_s": statistics.median(cpu_times),
        "content_bytes": content,
        "segment_bytes": shared.nbytes,
        "build_heap_peak_bytes": heap_peak,
    }


def per_call_ns(sequence, indices) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for i in indices:
            sequence[i]
        best = min(best, time.process_time() - start)
    return best / len(indices) * 1e9


def getitem_cost(index: list) -> dict:
    shared = SharedList(index)
    indices = random.Random(0).sample(range(len(index)), min(len(index), 1_000_000))
    return {"list_ns": per_call_ns(index, indices), "shared_ns": per_call_ns(shared, indices)}


def run_epoch_in_fresh_process(loader: str, kind: str, args) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--entries",
            str(args.entries),
            "--workers",
            str(args.workers),
            "--one-epoch",
            loader,
            kind,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {loader} / {kind} epoch failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def print_figures(figures: dict) -> None:
    build = figures["build"]
    content, segment = build["content_bytes"], build["segment_bytes"]
    peak = segment + build["build_heap_peak_bytes"]
    print(
        f"index: {figures['entries']} (path, class) entries; {figures['workers']} workers, "
        f"batch_size={BATCH_SIZE}, shuffle=True, fork; load average before "
        f"{figures['load_before']:.1f}, after {figures['load_after']:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        "\nper-worker USS growth over one epoch (MiB, each worker), USS at its end (MiB), "
        "epoch (s):"
    )
    for row in figures["epochs"]:
        growth = ", ".join(f"{g / MIB:.1f}" for g in row["growth"])
        end = ", ".join(f"{u / MIB:.0f}" for u in row["uss_at_end"])
        print(
            f"  {row['loader']:9} {row['index']:10} growth {growth:>14}   "
            f"USS at end {end:>10}   {row['epoch_s']:.1f} s"
        )
    print(
        f"\nbuilding the SharedList: {build['build_s']:.2f} s (median of "
        f"{', '.join(f'{t:.2f}' for t in build['build_s_all'])}), "
        f"{build['build_cpu_s']:.2f} s of CPU"
    )
    print(
        f"  entries' content {content / MIB:.1f} MiB; segment {segment / MIB:.1f} MiB "
        f"({segment / content:.2f}x); segment + the build's heap at its peak "
        f"{peak / MIB:.1f} MiB ({peak / content:.2f}x)"
    )
    calls = figures["getitem"]
    print(
        f"\nCPU per call over shuffled indices: list[i] {calls['list_ns']:.0f} ns, "
        f"sl[i] {calls['shared_ns']:.0f} ns"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=2_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--one-epoch", nargs=2, metavar=("LOADER", "INDEX"), help=argparse.SUPPRESS
    )  # a fresh process's single run
    args = parser.parse_args()
    if args.one_epoch:
        print(json.dumps(epoch_growth(*args.one_epoch, args.entries, args.workers)))
        return
    figures = report.new_document(
        entries=args.entries, workers=args.workers, load_before=os.getloadavg()[0], epochs=[]
    )
    for loader in LOADERS:
        for kind in ("list", "SharedList"):
            row = run_epoch_in_fresh_process(loader, kind, args)
            figures["epochs"].append({"loader": loader, "index": kind, **row})
    index = make_index(args.entries)
    figures["build"] = build_cost(index)
    figures["getitem"] = getitem_cost(index)
    figures["load_after"] = os.getloadavg()[0]
    print_figures(figures)
    report.write_json(figures, args.out)
    print(f"\nfigures written to {args.out}")


if __name__ == "__main__":
    main()

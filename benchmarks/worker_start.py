"""Worker start-up under fork, forkserver and spawn (issue 38): torch's DataLoader and
shmloader's side by side in one run.

    python benchmarks/worker_start.py --quick    # 200,000 entries, 2 reps: about 5 min on 2 cores
    python benchmarks/worker_start.py            # 1,000,000 entries, 3 reps: over twice as long
    python benchmarks/worker_start.py --entries 2000000 --workers 4 --methods forkserver

The dataset: ImageFolder's, its index a list of --entries (path, class) tuples (synthetic
paths, 1000 classes, no files), held as a plain `list` and as a `shmloader.SharedList`.
__getitem__ unpacks its entry as ImageFolder does and returns a 3-element int64 tensor
derived from it (no decode, so that nothing hides what starting the workers costs).

Every condition (start method x workers x index x loader) is a non-persistent loader,
built before the clock starts, run for --epochs consecutive epochs over the same
--batches batches of --batch-size indices spread over the whole index (a training step
after each batch: a sleep of --step-ms, as while a GPU works). Two figures:

1. first batch: from iter() of the fresh loader to holding its first batch (worker start,
   the dataset reaching the workers, the first batch);
2. epoch gap: from the last batch of an epoch to the first of the next (the step, the end
   of the epoch, which shuts its workers down, and the next epoch's workers starting),
   against the steady interval, the median between consecutive batches within the same
   epochs; over the boundaries from the second epoch's end on (a non-persistent loader of
   shmloader's starts its next epoch's workers during an epoch from its second epoch on),
   the first boundary apart (first gap).

Conditions run in turn, torch's and shmloader's adjacent, the order reversed every other
repetition; figures are medians over the repetitions, with their spread ((max - min) /
median). Before timing, each start method runs a small loader of each kind once (under
forkserver that starts the server, once per process as in a training script). Every batch
is checked against the batches computed in this process.

The script imports only torch and shmloader at module level, as a training script would:
spawned workers import this module afresh (as __mp_main__); forkserver's server imports it
once (Python's default preload, "__main__"), and its workers fork from it.

Figures go to results/worker_start.json (and a chart, worker_start.png, with matplotlib).
"""

import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.utils.data

import shmloader

LOADERS = {"torch": torch.utils.data.DataLoader, "shmloader": shmloader.DataLoader}
INDEXES = ("list", "SharedList")
METHODS = ("fork", "forkserver", "spawn")
CLASSES = 1000
SEED = 0


class ImageIndex(torch.utils.data.Dataset):
    """ImageFolder's __getitem__ without the image: the entry unpacked, a small tensor
    derived from it."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, target = self.samples[index]
        return torch.tensor([index, target, len(path)], dtype=torch.int64)


def worker_init(worker_id: int) -> None:
    """What training scripts' worker_init_fn often does; the same for every loader."""
    torch.set_num_threads(1)


def make_index(entries: int) -> list:
    per_class = max(1, entries // CLASSES)
    return [
        (
            f"/data/imagenet21k/train/n{i // per_class:08d}/n{i // per_class:08d}_{i}.JPEG",
            i // per_class,
        )
        for i in range(entries)
    ]


@dataclass(frozen=True)
class Settings:
    entries: int
    reps: int
    epochs: int  # consecutive epochs per run: one first batch, epochs - 1 gaps
    batches: int  # per epoch
    batch_size: int
    step_s: float


FULL = Settings(entries=1_000_000, reps=3, epochs=3, batches=20, batch_size=64, step_s=0.01)
QUICK = replace(FULL, entries=200_000, reps=2)


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def run_epochs(loader: Any, epochs: int, step_s: float) -> list[dict[str, Any]]:
    """perf_counter() before each epoch's iter(), at each batch's arrival and at the
    epoch's end; each batch's sum."""
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        arrivals, sums = [], []
        for batch in loader:
            arrivals.append(time.perf_counter())
            sums.append(int(batch.sum()))
            time.sleep(step_s)
        times.append(
            {"started": started, "arrivals": arrivals, "ended": time.perf_counter(), "sums": sums}
        )
    return times


def one_run(
    loader_name: str,
    dataset: torch.utils.data.Dataset,
    sampler: list[int],
    method: str,
    workers: int,
    settings: Settings,
) -> list[dict[str, Any]]:
    loader = LOADERS[loader_name](
        dataset,
        batch_size=settings.batch_size,
        sampler=sampler,
        num_workers=workers,
        multiprocessing_context=method,
        worker_init_fn=worker_init,
        persistent_workers=False,
    )
    times = run_epochs(loader, settings.epochs, settings.step_s)
    del loader
    return times


def figures(runs: list[list[dict[str, Any]]], expected: list[int]) -> dict[str, Any]:
    """A condition's figures from its runs (one_run's results, one per repetition)."""
    first = [run[0]["arrivals"][0] - run[0]["started"] for run in runs]
    steady = [
        b - a
        for run in runs
        for epoch in run
        for a, b in zip(epoch["arrivals"], epoch["arrivals"][1:])
    ]
    # A non-persistent loader's spare workers (spawn, forkserver) start from its second
    # epoch on: the first boundary of each run apart, the gap over the later ones.
    firsts = [(run[0], run[1]) for run in runs if len(run) >= 2]
    pairs = [(e, f) for run in runs for e, f in zip(run[1:], run[2:])] or firsts
    gaps = [f["arrivals"][0] - e["arrivals"][-1] for e, f in pairs]
    wrong = sum(epoch["sums"] != expected for run in runs for epoch in run)
    result: dict[str, Any] = {
        "first_batch_s": statistics.median(first),
        "first_batch_spread": spread(first),
        "first_batch_s_all": first,
        "steady_interval_s": statistics.median(steady),
        "epochs_checked": sum(len(run) for run in runs),
        "epochs_wrong": wrong,
    }
    if gaps:
        steady_s = result["steady_interval_s"]
        result.update(
            {
                "first_gap_s": statistics.median(
                    f["arrivals"][0] - e["arrivals"][-1] for e, f in firsts
                ),
                "gap_s": statistics.median(gaps),
                "gap_spread": spread(gaps),
                "gaps_s": gaps,
                "gap/steady": statistics.median(gaps) / steady_s,
                # The gap's parts: the end of the epoch after its last batch's step (the
                # workers shut down), and the next epoch's iter() to its first batch.
                "end_s": statistics.median(
                    e["ended"] - e["arrivals"][-1] - steady_s for e, _ in pairs
                ),
                "next_first_batch_s": statistics.median(
                    f["arrivals"][0] - f["started"] for _, f in pairs
                ),
            }
        )
    return result


def warm_up(methods: list[str], datasets: dict[str, Any]) -> None:
    """One small loader of each kind under each start method, untimed: forkserver's server
    starts (once per process), imports reach the page cache."""
    small = ImageIndex(make_index(64))
    for method in methods:
        for make in LOADERS.values():
            for _ in make(small, batch_size=16, num_workers=1, multiprocessing_context=method):
                pass


def condition_name(method: str, workers: int, index: str, loader: str) -> str:
    return f"{method}/{workers}/{index}/{loader}"


def table(document: dict[str, Any]) -> list[list[str]]:
    """The terminal table's rows: a row per condition, shmloader's with its ratios to torch."""
    rows = [
        [
            "method",
            "workers",
            "index",
            "loader",
            "first batch s",
            "spread",
            "vs torch",
            "first gap s",
            "epoch gap s",
            "spread",
            "vs torch",
            "steady ms",
            "gap/steady",
            "checked",
        ]
    ]
    by_key = {(r["method"], r["workers"], r["index"], r["loader"]): r for r in document["runs"]}
    for (method, workers, index, loader), r in by_key.items():
        torch_row = by_key.get((method, workers, index, "torch"))
        ratio = loader != "torch" and torch_row is not None
        gap = "gap_s" in r
        rows.append(
            [
                method,
                str(workers),
                index,
                loader,
                f"{r['first_batch_s']:.3f}",
                f"{r['first_batch_spread']:.0%}",
                f"{r['first_batch_s'] / torch_row['first_batch_s']:.2f}x" if ratio else "",
                f"{r['first_gap_s']:.3f}" if gap else "-",
                f"{r['gap_s']:.3f}" if gap else "-",
                f"{r['gap_spread']:.0%}" if gap else "-",
                f"{r['gap_s'] / torch_row['gap_s']:.2f}x" if ratio and gap else "",
                f"{r['steady_interval_s'] * 1e3:.1f}",
                f"{r['gap/steady']:,.1f}x" if gap else "-",
                "ok" if r["epochs_wrong"] == 0 else f"{r['epochs_wrong']} WRONG",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    import report

    from shmloader.bench import plot
    from shmloader.bench.progress import StatusLine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200,000 entries, 2 repetitions")
    parser.add_argument("--entries", type=int, help=f"index entries (default {FULL.entries:,})")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--reps", type=int, help=f"repetitions (default {FULL.reps})")
    parser.add_argument("--epochs", type=int, help=f"epochs per run (default {FULL.epochs})")
    parser.add_argument("--batches", type=int, help=f"batches per epoch (default {FULL.batches})")
    parser.add_argument("--step-ms", type=float, help=f"default {FULL.step_s * 1e3:g}")
    parser.add_argument("--out", type=Path, default=report.RESULTS / "worker_start.json")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    for name in ("entries", "reps", "epochs", "batches"):
        if getattr(args, name) is not None:
            settings = replace(settings, **{name: getattr(args, name)})
    if args.step_ms is not None:
        settings = replace(settings, step_s=args.step_ms / 1e3)
    if settings.epochs < 2 or settings.reps < 1 or settings.batches < 2:
        parser.error("--epochs needs at least 2 (a gap), --batches 2, --reps 1")

    document = report.new_document(benchmark="worker_start", settings=asdict(settings), runs=[])
    status = StatusLine("worker_start.py")
    status(f"building the index: {settings.entries:,} entries, and its SharedList")
    index = make_index(settings.entries)
    start = time.perf_counter()
    shared = shmloader.SharedList(index)
    document["shared_list_build_s"] = time.perf_counter() - start
    datasets = {"list": ImageIndex(index), "SharedList": ImageIndex(shared)}
    count = settings.batches * settings.batch_size
    sampler = random.Random(SEED).sample(range(settings.entries), count)
    expected = [
        int(torch.stack([datasets["list"][i] for i in sampler[b : b + settings.batch_size]]).sum())
        for b in range(0, count, settings.batch_size)
    ]
    status("warm-up: a small loader of each kind under each start method")
    warm_up(args.methods, datasets)

    keys = [
        (method, workers, index_name, loader)
        for method in args.methods
        for workers in args.workers
        for index_name in INDEXES
        for loader in LOADERS
    ]
    runs: dict[tuple, list] = {key: [] for key in keys}
    began = time.perf_counter()
    for rep in range(settings.reps):
        for key in keys if rep % 2 == 0 else keys[::-1]:
            method, workers, index_name, loader = key
            status(
                f"{condition_name(*key)}: run {rep + 1}/{settings.reps} of {settings.epochs} epochs"
            )
            runs[key].append(
                one_run(loader, datasets[index_name], sampler, method, workers, settings)
            )
    document["timed_s"] = time.perf_counter() - began
    for (method, workers, index_name, loader), results in runs.items():
        document["runs"].append(
            {
                "method": method,
                "workers": workers,
                "index": index_name,
                "loader": loader,
                **figures(results, expected),
            }
        )
    status.clear()
    print(
        f"index: {settings.entries:,} (path, class) entries; {settings.batches} batches of "
        f"{settings.batch_size} an epoch, a {settings.step_s * 1e3:g} ms step after each; "
        f"non-persistent loaders; median of {settings.reps} runs of {settings.epochs} epochs"
    )
    print("\n".join(report.aligned(table(document))))
    print(
        "first batch: iter() of a fresh loader to its first batch; epoch gap: last batch of "
        "an epoch to the first of the next; steady: between batches within the epochs"
    )
    print(report.write_with_chart(document, args.out, plot.write_worker_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())

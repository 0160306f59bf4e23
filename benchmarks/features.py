"""shmloader's options against torch's DataLoader, 2 workers, side by side in one run:

    python benchmarks/features.py --quick   # under a minute on 2 cores
    python benchmarks/features.py [--out PATH]

1. first batch: time to the first batch, worker start included, of a new loader and of a
   new epoch of a non-persistent loader (shmloader keeps its ring, and with fetch="sample"
   its samples' layout, from one epoch to the next), on the jpeg workload: torch,
   shmloader fetch="batch" and fetch="sample".
2. epoch boundary: persistent workers, a training step per batch (a sleep, as while a GPU
   works); the gap from the last batch of an epoch to the first of the next (the step,
   the end of the loop and iter() included) against the median interval between batches
   within epochs: torch, shmloader, and shmloader with prefetch_next_epoch.
3. uneven costs: one sample in eight costs ten times the others; samples/s of torch and
   of shmloader fetch="sample" with assignment "interleaved" and "dynamic", the cost
   spent in a busy loop (the workers compete for the cores) and in a sleep (they do not).

Each section checks first that every loader yields the batches that torch yields, then
interleaves its timed repetitions. shmloader's wait_fraction (LoaderStats) covers the
timed repetitions only.
"""

import argparse
import functools
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
import torch.utils.data
from workloads import PRESETS, SEED, CostDataset, random_pool, spin_loops_per_ms, uneven_costs

from shmloader import DataLoader as ShmDataLoader
from shmloader.bench.check import checked_warm_up
from shmloader.bench.errors import BenchmarkError
from shmloader.bench.figures import throughput_figures
from shmloader.bench.measure import Spec, consume, first_batch_s, interleaved, timed_epoch
from shmloader.bench.progress import StatusLine

WORKERS = 2
DEFAULT_OUT = report.RESULTS / "features.json"
SAMPLE_COST_PROBES = 64  # jpeg samples whose CPU time in this process gives the cost per sample


@dataclass(frozen=True)
class Settings:
    """Sizes of the three sections; FULL and QUICK below."""

    first_batch_reps: int
    boundary_runs: int  # interleaved runs per loader, each of boundary_epochs consecutive epochs
    boundary_epochs: int
    uneven_reps: int
    uneven_batches: int  # per epoch


FULL = Settings(
    first_batch_reps=7, boundary_runs=5, boundary_epochs=8, uneven_reps=7, uneven_batches=120
)
QUICK = Settings(
    first_batch_reps=3, boundary_runs=3, boundary_epochs=4, uneven_reps=3, uneven_batches=40
)

FIRST_BATCH_SIZE = 64
FIRST_BATCH_BATCHES = 8  # per epoch: more than the prefetch_factor * workers batches in flight
FIRST_BATCH_RATIOS = [
    ("shmloader sample", "shmloader batch"),
    ("shmloader sample", "torch"),
    ("shmloader batch", "torch"),
]

# Epoch boundary: uint8 3x128x128 samples of 0.2 ms each in batches of 32 (6.4 ms per
# batch and worker, 3.2 ms per batch from two) against a 5 ms step: the loader keeps up.
SAMPLE_SHAPE = (3, 128, 128)
BOUNDARY_BATCH_SIZE = 32
BOUNDARY_BATCHES = 20
BOUNDARY_SAMPLE_MS = 0.2
STEP_S = 0.005

# Uneven costs: 0.3 ms per sample, 3 ms for one in eight.
UNEVEN_BATCH_SIZE = 32
UNEVEN_LIGHT_MS = 0.3
UNEVEN_FACTOR = 10
UNEVEN_EVERY = 8

# The targets, by section: (ratio, at most or at least, value).
TARGETS = {
    "first_batch": [
        (f"{when}: shmloader sample/{other}", "<=", 0.6)
        for when in ("new loader", "next epoch")
        for other in ("shmloader batch", "torch")
    ],
    "epoch_boundary": [("shmloader prefetch gap/steady", "<=", 1.5)],
    "uneven": [("shmloader dynamic/torch", ">=", 1.3)],
}


def loaders(
    dataset: torch.utils.data.Dataset, shm_options: dict[str, dict[str, Any]], **common: Any
) -> dict[str, Callable[..., Any]]:
    """Makers of torch's loader and of a shmloader per set of options, all with the same
    dataset, WORKERS and `common` arguments; a maker's keywords are added to those."""
    makers = {
        "torch": functools.partial(
            torch.utils.data.DataLoader, dataset, num_workers=WORKERS, **common
        )
    }
    for name, options in shm_options.items():
        makers[name] = functools.partial(
            ShmDataLoader, dataset, num_workers=WORKERS, **common, **options
        )
    return makers


def cpu_ms_per_sample(dataset: torch.utils.data.Dataset) -> float:
    """Mean CPU milliseconds of the dataset's first samples in this process (CPU time:
    other processes' load does not count)."""
    start = time.process_time()
    for index in range(SAMPLE_COST_PROBES):
        dataset[index]
    return (time.process_time() - start) / SAMPLE_COST_PROBES * 1e3


def wait_fraction(before: Any, after: Any) -> float:
    """shmloader's wait_fraction between two stats() snapshots."""
    return (after.wait_seconds - before.wait_seconds) / (after.wall_seconds - before.wall_seconds)


def next_epoch_first_batch_s(loader: Any, spec: Spec) -> float:
    """first_batch_s of a new iterator of `loader`, an existing non-persistent loader."""
    return first_batch_s(lambda: loader, spec)


def first_batch(
    settings: Settings, progress: Callable[[str], None], scratch: Path
) -> dict[str, Any]:
    preset = PRESETS["jpeg"]
    dataset = preset.make_dataset(FIRST_BATCH_BATCHES * FIRST_BATCH_SIZE, scratch)
    makers = loaders(
        dataset,
        {"shmloader batch": {"fetch": "batch"}, "shmloader sample": {"fetch": "sample"}},
        batch_size=FIRST_BATCH_SIZE,
    )
    live = {name: make() for name, make in makers.items()}
    progress("first batch: an epoch of each loader, checking that their batches are equal")
    spec, compared = checked_warm_up(live)
    reps_s = {
        "new loader": interleaved(
            {name: functools.partial(first_batch_s, make, spec) for name, make in makers.items()},
            settings.first_batch_reps,
            progress,
            "first batch of a new loader",
        ),
        "next epoch": interleaved(
            {
                name: functools.partial(next_epoch_first_batch_s, loader, spec)
                for name, loader in live.items()
            },
            settings.first_batch_reps,
            progress,
            "first batch of a next epoch",
        ),
    }
    medians = {
        when: {name: statistics.median(reps) for name, reps in by_loader.items()}
        for when, by_loader in reps_s.items()
    }
    return {
        "workload": f"jpeg: {preset.description}",
        "batch_size": FIRST_BATCH_SIZE,
        "cpu_ms_per_sample": cpu_ms_per_sample(dataset),
        "reps": settings.first_batch_reps,
        "compared_batches": compared,
        "first_batch_s": medians,
        "reps_s": reps_s,
        "ratios": {
            f"{when}: {a}/{b}": by_loader[a] / by_loader[b]
            for when, by_loader in medians.items()
            for a, b in FIRST_BATCH_RATIOS
        },
    }


def epoch_times(loader: Any, spec: Spec, epochs: int) -> list[tuple[float, list[float]]]:
    """Consecutive epochs with a STEP_S sleep after every batch; per epoch, perf_counter()
    before its iter() and when each of its batches arrived."""
    times = []
    for _ in range(epochs):
        started = time.perf_counter()
        arrivals = []
        for batch in loader:
            arrivals.append(time.perf_counter())
            consume(batch, spec)
            time.sleep(STEP_S)
        times.append((started, arrivals))
    return times


def boundary_figures(runs: list[list[tuple[float, list[float]]]]) -> dict[str, Any]:
    """The median interval between batches within epochs and the gaps between epochs
    (with the part of each from iter() to the first batch) of epoch_times() runs."""
    steady = [b - a for run in runs for _, arrivals in run for a, b in itertools.pairwise(arrivals)]
    boundaries = [
        (earlier[1][-1], *later) for run in runs for earlier, later in itertools.pairwise(run)
    ]
    gaps = [arrivals[0] - last for last, _, arrivals in boundaries]
    return {
        "steady_interval_s": statistics.median(steady),
        "gap_s": statistics.median(gaps),
        "gap_max_s": max(gaps),
        "gap/steady": statistics.median(gaps) / statistics.median(steady),
        "iter_to_first_batch_s": statistics.median(
            arrivals[0] - started for _, started, arrivals in boundaries
        ),
        "gaps_s": gaps,
    }


def epoch_boundary(settings: Settings, progress: Callable[[str], None]) -> dict[str, Any]:
    costs = [BOUNDARY_SAMPLE_MS] * (BOUNDARY_BATCHES * BOUNDARY_BATCH_SIZE)
    loops_per_ms = spin_loops_per_ms()
    dataset = CostDataset(
        random_pool(SAMPLE_SHAPE, torch.uint8), costs, busy=True, loops_per_ms=loops_per_ms
    )
    makers = loaders(
        dataset,
        {"shmloader": {}, "shmloader prefetch": {"prefetch_next_epoch": True}},
        batch_size=BOUNDARY_BATCH_SIZE,
        shuffle=True,
        persistent_workers=True,
    )
    # Shuffled as in training, each loader drawing from a generator seeded alike.
    live = {
        name: make(generator=torch.Generator().manual_seed(SEED)) for name, make in makers.items()
    }
    progress("epoch boundary: two epochs of each loader, checking that their batches are equal")
    spec, compared = checked_warm_up(live)
    compared += checked_warm_up(live)[1]  # the second epoch is the first one prefetched
    before = {
        name: loader.stats() for name, loader in live.items() if isinstance(loader, ShmDataLoader)
    }
    runs = interleaved(
        {
            name: functools.partial(epoch_times, loader, spec, settings.boundary_epochs)
            for name, loader in live.items()
        },
        settings.boundary_runs,
        progress,
        f"run of {settings.boundary_epochs} epochs",
    )
    figures = {name: boundary_figures(runs[name]) for name in live}
    for name, stats in before.items():
        after = live[name].stats()
        figures[name]["wait_fraction"] = wait_fraction(stats, after)
        figures[name]["prefetched_epochs"] = after.prefetched_epochs - stats.prefetched_epochs
    return {
        "workload": (
            f"uint8 {'x'.join(map(str, SAMPLE_SHAPE))} + int label, {BOUNDARY_SAMPLE_MS} ms busy loop "
            f"per sample, shuffled"
        ),
        "batch_size": BOUNDARY_BATCH_SIZE,
        "batches_per_epoch": BOUNDARY_BATCHES,
        "step_s": STEP_S,
        "spin_loops_per_ms": loops_per_ms,
        "runs": settings.boundary_runs,
        "epochs_per_run": settings.boundary_epochs,
        "compared_batches": compared,
        "loaders": figures,
        "ratios": {f"{name} gap/steady": figs["gap/steady"] for name, figs in figures.items()},
    }


def uneven_variant(
    busy: bool,
    costs: list[float],
    settings: Settings,
    loops_per_ms: float,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    dataset = CostDataset(random_pool(SAMPLE_SHAPE, torch.uint8), costs, busy, loops_per_ms)
    shm_options = {
        f"shmloader {a}": {"fetch": "sample", "assignment": a} for a in ("interleaved", "dynamic")
    }
    makers = loaders(dataset, shm_options, batch_size=UNEVEN_BATCH_SIZE, persistent_workers=True)
    live = {name: make() for name, make in makers.items()}
    kind = "busy loop" if busy else "sleep"
    progress(
        f"uneven costs ({kind}): an epoch of each loader, checking that their batches are equal"
    )
    spec, compared = checked_warm_up(live)
    before = {
        name: loader.stats() for name, loader in live.items() if isinstance(loader, ShmDataLoader)
    }
    epochs = interleaved(
        {name: functools.partial(timed_epoch, loader, spec) for name, loader in live.items()},
        settings.uneven_reps,
        progress,
        f"{kind} epoch",
    )
    figures = {name: throughput_figures(epochs[name]) for name in live}
    for name, stats in before.items():
        figures[name]["wait_fraction"] = wait_fraction(stats, live[name].stats())
    torch_rate = figures["torch"]["samples_per_s"]
    ratios = {
        f"{name}/torch": figs["samples_per_s"] / torch_rate
        for name, figs in figures.items()
        if name != "torch"
    }
    ratios["shmloader dynamic/shmloader interleaved"] = (
        figures["shmloader dynamic"]["samples_per_s"]
        / figures["shmloader interleaved"]["samples_per_s"]
    )
    return {
        "cost": kind,
        "compared_batches": compared,
        "loaders": figures,
        "ratios": ratios,
    }


def uneven(settings: Settings, progress: Callable[[str], None]) -> dict[str, Any]:
    loops_per_ms = spin_loops_per_ms()
    costs = uneven_costs(
        settings.uneven_batches * UNEVEN_BATCH_SIZE, UNEVEN_LIGHT_MS, UNEVEN_FACTOR, UNEVEN_EVERY
    )
    mean_cost_ms = statistics.mean(costs)
    return {
        "workload": (
            f"uint8 {'x'.join(map(str, SAMPLE_SHAPE))} + int label, {UNEVEN_LIGHT_MS} ms per sample, "
            f"{UNEVEN_LIGHT_MS * UNEVEN_FACTOR:g} ms for a random one in {UNEVEN_EVERY}, not shuffled"
        ),
        "batch_size": UNEVEN_BATCH_SIZE,
        "batches_per_epoch": settings.uneven_batches,
        "mean_cost_ms": mean_cost_ms,
        # Every worker always busy with samples at their nominal cost, and nothing else.
        "cost_bound_samples_per_s": WORKERS * 1e3 / mean_cost_ms,
        "reps": settings.uneven_reps,
        "spin_loops_per_ms": loops_per_ms,
        "variants": {
            "busy": uneven_variant(True, costs, settings, loops_per_ms, progress),
            "sleep": uneven_variant(False, costs, settings, loops_per_ms, progress),
        },
    }


def target_lines(section: str, ratios: dict[str, float]) -> list[str]:
    lines = []
    for figure, relation, value in TARGETS[section]:
        got = ratios[figure]
        met = got <= value if relation == "<=" else got >= value
        lines.append(
            f"target {figure} {relation} {value}x: {got:.2f}x, {'met' if met else 'missed'}"
        )
    return lines


def first_batch_table(record: dict[str, Any]) -> str:
    medians = record["first_batch_s"]
    rows = [["loader", *(f"{when} ms" for when in medians)]]
    rows += [
        [name, *(f"{by_loader[name] * 1e3:.0f}" for by_loader in medians.values())]
        for name in next(iter(medians.values()))
    ]
    rows += [
        [f"{a}/{b}", *(f"{record['ratios'][f'{when}: {a}/{b}']:.2f}x" for when in medians)]
        for a, b in FIRST_BATCH_RATIOS
    ]
    title = (
        f"1. first batch: {record['workload']} ({record['cpu_ms_per_sample']:.1f} ms CPU/sample), "
        f"batch {record['batch_size']}, {report.workers_label(WORKERS)}, median of {record['reps']} reps"
    )
    return "\n".join([title, *report.aligned(rows), *target_lines("first_batch", record["ratios"])])


def boundary_table(record: dict[str, Any]) -> str:
    rows = [
        [
            "loader",
            "steady ms",
            "gap ms",
            "max gap ms",
            "gap/steady",
            "iter() to batch ms",
            "wait fraction",
            "prefetched epochs",
        ]
    ]
    for name, f in record["loaders"].items():
        shm = "wait_fraction" in f
        milliseconds = (
            f"{f[key] * 1e3:.1f}" for key in ("steady_interval_s", "gap_s", "gap_max_s")
        )
        rows.append(
            [
                name,
                *milliseconds,
                f"{f['gap/steady']:.2f}x",
                f"{f['iter_to_first_batch_s'] * 1e3:.1f}",
                f"{f['wait_fraction']:.0%}" if shm else "",
                str(f["prefetched_epochs"]) if shm else "",
            ]
        )
    epochs = record["runs"] * record["epochs_per_run"]
    title = (
        f"2. epoch boundary, persistent workers: {record['workload']}, "
        f"batch {record['batch_size']}, {record['batches_per_epoch']} batches/epoch, "
        f"{report.workers_label(WORKERS)}, {record['step_s'] * 1e3:g} ms step; medians over "
        f"{record['runs']} runs of {record['epochs_per_run']} epochs ({epochs - record['runs']} gaps)"
    )
    return "\n".join(
        [title, *report.aligned(rows), *target_lines("epoch_boundary", record["ratios"])]
    )


def uneven_table(record: dict[str, Any]) -> str:
    rows = [["loader", "cost", "samples/s", "of bound", "spread", "wait fraction", "/torch"]]
    bound = record["cost_bound_samples_per_s"]
    for variant in record["variants"].values():
        for name, f in variant["loaders"].items():
            ratio = variant["ratios"].get(f"{name}/torch")
            rows.append(
                [
                    name,
                    variant["cost"],
                    f"{f['samples_per_s']:,.0f}",
                    f"{f['samples_per_s'] / bound:.0%}",
                    f"{f['throughput_spread']:.0%}",
                    f"{f['wait_fraction']:.0%}" if "wait_fraction" in f else "",
                    "" if ratio is None else f"{ratio:.2f}x",
                ]
            )
    title = (
        f"3. uneven costs, persistent workers: {record['workload']} (mean {record['mean_cost_ms']:.2f} ms), "
        f"batch {record['batch_size']}, {record['batches_per_epoch']} batches/epoch, "
        f"{report.workers_label(WORKERS)}, median of {record['reps']} epochs"
    )
    lines = [
        title,
        *report.aligned(rows),
        f"bound: {bound:,.0f} samples/s, {report.workers_label(WORKERS)} "
        "busy all the time with samples at their nominal cost (a sleep's overshoot not counted)",
    ]
    for variant in record["variants"].values():
        lines += [
            f"{variant['cost']}: {line}" for line in target_lines("uneven", variant["ratios"])
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and shorter epochs")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON path (default: %(default)s)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    document = report.new_document(
        settings={"quick": args.quick, "workers": WORKERS, **vars(settings)},
        # Other processes' load (1, 5 and 15 minute averages): the figures' noise.
        load_average={"start": os.getloadavg()},
    )
    with tempfile.TemporaryDirectory(prefix="shmloader-features-") as scratch:
        sections = {
            "first_batch": (
                functools.partial(first_batch, scratch=Path(scratch)),
                first_batch_table,
            ),
            "epoch_boundary": (epoch_boundary, boundary_table),
            "uneven": (uneven, uneven_table),
        }
        for number, (name, (measure_section, table)) in enumerate(sections.items(), 1):
            progress = StatusLine(f"[{number}/{len(sections)}]")
            try:
                document[name] = measure_section(settings, progress)
            except BenchmarkError as error:
                sys.exit(f"[{name}] {error}")
            progress.clear()
            document["load_average"]["end"] = os.getloadavg()
            report.write_json(
                document, args.out
            )  # after every section, so that a broken-off run keeps its figures
            print(table(document[name]) + "\n")
    load = document["load_average"]
    print(
        f"load average (1, 5, 15 min): {_loads(load['start'])} at the start, {_loads(load['end'])} at the end"
    )
    print(f"figures written to {args.out}")


def _loads(averages: tuple[float, float, float]) -> str:
    return ", ".join(f"{a:.2f}" for a in averages)


if __name__ == "__main__":
    main()

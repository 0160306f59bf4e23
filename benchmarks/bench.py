"""torch's DataLoader against shmloader's, side by side, on the same dataset objects, with
the transport-free limit of the same work measured in the same run.

    python benchmarks/bench.py --quick     # the six workloads, 2 workers: about 90 s on 2 cores
    python benchmarks/bench.py             # full: the six workloads and the size sweep, with
                                           # 1, 2 and 4 workers and two batch sizes each
    python benchmarks/bench.py --preset jpeg --workers 4 [--batch-size 64] [--loaders torch]
    python benchmarks/bench.py --shm-size 64m --preset uint8-224 --batch-size 256 64
                                           # in a container's 64 MB /dev/shm (see container.py)

A run is one preset with one number of workers and one batch size. Both loaders get the
same dataset object and the same arguments. Their first epochs run side by side and must
yield identical batches; then the limit's workers start (see shmloader/bench/limit.py)
and timed epochs alternate (torch, shmloader, limit, torch, ...) so that machine noise
hits all of them alike, and the figures are medians over those repetitions. Time to first
batch is measured afterwards on fresh non-persistent loaders (from construction to holding
the first batch), and memory on a fresh persistent loader over a few epochs (its peak, and
what is left between epochs: does it stay flat?), one loader at a time. This script only
chooses the runs: the measuring is shmloader/bench/session.py's, which
`python -m shmloader.compare` runs on a user's dataset too. Every run's figures go to one
JSON file, with the charts next to it (see shmloader/bench/plot.py).
See docs/benchmarks.md for what the figures mean.
"""

import argparse
import functools
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import container
import report
import torch.utils.data
from workloads import FAMILIES, PRESETS, SEED, SIZE_SWEEP, WORKLOADS, Preset

from shmloader.bench import plot, session
from shmloader.bench.errors import BenchmarkError, InputError
from shmloader.bench.figures import measurement_figures, ratios
from shmloader.bench.progress import StatusLine

LOADERS = ("torch", "shmloader")  # torch first: it is the reference the others are checked against
DEFAULT_OUT = report.RESULTS / "throughput.json"
# (full run, --quick): timed epochs per loader, and fresh loaders timed to first batch.
REPS = (7, 3)
FIRST_BATCH_REPS = (5, 3)
# (full run, --quick): epochs of the loader whose memory is measured, to see it stay flat.
MEMORY_EPOCHS = (4, 3)
# (full run, --quick): worker counts, and batch sizes as divisors of each preset's own.
# A quarter of the batch pays the per-batch costs four times as often per sample.
WORKERS = ((1, 2, 4), (2,))
BATCH_DIVISORS = ((4, 1), (1,))


@dataclass(frozen=True)
class Settings:
    quick: bool
    reps: int
    first_batch_reps: int
    memory_epochs: int


@dataclass(frozen=True)
class Run:
    preset: Preset
    workers: int
    batch_size: int

    def label(self) -> str:
        return f"{self.preset.name}, {report.workers_label(self.workers)}, batch {self.batch_size}"


def loader_class(name: str) -> type:
    if name == "torch":
        return torch.utils.data.DataLoader
    try:
        from shmloader import DataLoader
    except ImportError as error:
        sys.exit(f"shmloader.DataLoader cannot be imported ({error}); run with --loaders torch")
    return DataLoader


def measure_run(
    run: Run,
    classes: dict[str, type],
    settings: Settings,
    scratch: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Every figure of one run, as its JSON record."""
    preset = run.preset
    batches = preset.quick_batches if settings.quick else preset.batches
    dataset = preset.make_dataset(batches * run.batch_size, scratch)
    # The same dataset object and arguments for every loader; shuffle=False so that the
    # loaders' batches can be compared, and each loader's own generator seeded alike so
    # that random augmentations draw the same worker seeds. pin_memory=False: torch's
    # pinning thread would count as main-process CPU, and shmloader is compared on
    # transport alone. Throughput and memory on persistent loaders, time to first batch
    # on non-persistent ones (what such a loader pays every epoch).
    makers = {}
    for name, cls in classes.items():
        make = functools.partial(
            _seeded,
            cls,
            dataset,
            batch_size=run.batch_size,
            shuffle=False,
            num_workers=run.workers,
            pin_memory=False,
        )
        persistent = functools.partial(make, persistent_workers=True)
        makers[name] = session.Makers(
            timed=persistent,
            fresh=functools.partial(make, persistent_workers=False),
            memory=persistent,
        )
    plan = session.Plan(
        reps=settings.reps,
        first_batch_reps=settings.first_batch_reps,
        memory_epochs=settings.memory_epochs,
        limit=True,
    )
    measurement = session.measure(makers, plan, progress)
    loaders, limit = measurement_figures(measurement)
    return {
        "preset": {
            "name": preset.name,
            "sample": preset.description,
            "sample_bytes": preset.sample_bytes,
            "family": preset.family,
        },
        "settings": {
            **vars(settings),
            "workers": run.workers,
            "batch_size": run.batch_size,
            "batches_per_epoch": batches,
            "loaders": list(classes),
        },
        # Every loader after the first is checked against the first, torch when it runs.
        "correctness": {
            "reference": next(iter(classes)),
            "compared": list(classes)[1:],
            "batches": measurement.check.batches,
        },
        "loaders": loaders,
        "limit": limit,
        "ratios": ratios(loaders),
    }


def _seeded(cls: type, dataset: Any, **kwargs: Any) -> Any:
    """A new loader of `cls` with a generator of its own, seeded with SEED."""
    return cls(dataset, generator=torch.Generator().manual_seed(SEED), **kwargs)


def plan(
    preset_names: list[str], workers: list[int], batch_sizes: list[int] | None, quick: bool
) -> list[Run]:
    """The runs, preset by preset: every worker count with every batch size."""
    runs = []
    for name in preset_names:
        preset = PRESETS[name]
        sizes = batch_sizes or [max(1, preset.batch_size // d) for d in BATCH_DIVISORS[quick]]
        runs += [Run(preset, w, b) for w in workers for b in sizes]
    return runs


def preset_names(chosen: list[str] | None, quick: bool) -> list[str]:
    """Presets named on the command line, families expanded, each once; by default the
    six workloads, and with a full run the size sweep as well."""
    if not chosen:
        chosen = list(WORKLOADS) if quick else [*WORKLOADS, *FAMILIES]
    names = [member for name in chosen for member in FAMILIES.get(name, (name,))]
    return list(dict.fromkeys(names))


def _listed(values: tuple[int, ...]) -> str:
    return " ".join(map(str, values))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        action="append",
        choices=[*PRESETS, *FAMILIES],
        help="workload to run, or a family of them; repeat for several (default: "
        f"{', '.join(WORKLOADS)}; without --quick also {', '.join(FAMILIES)})",
    )
    parser.add_argument(
        "--loaders",
        nargs="+",
        choices=LOADERS,
        default=list(LOADERS),
        help="loaders to compare (default: both)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help=f"num_workers of every loader, one run each (default: {_listed(WORKERS[1])} with "
        f"--quick, else {_listed(WORKERS[0])})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        help="batch sizes, one run each (default: the preset's own, and without --quick "
        "also a quarter of it)",
    )
    parser.add_argument("--quick", action="store_true", help="short epochs and few repetitions")
    parser.add_argument(
        "--reps",
        type=int,
        help=f"timed epochs per loader (default: {REPS[1]} with --quick, else {REPS[0]})",
    )
    parser.add_argument(
        "--shm-size",
        metavar="SIZE",
        help="instead: both loaders with a /dev/shm of SIZE (a tmpfs size, 64m as "
        "Docker's default) beside a roomy one, in a private mount namespace "
        "(needs root); figures to results/container.json unless --out",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"JSON path; the charts are written next to it, named after it (default: {DEFAULT_OUT})",
    )
    args = parser.parse_args(argv)
    args.out = args.out or (
        DEFAULT_OUT.with_name("container.json") if args.shm_size else DEFAULT_OUT
    )
    args.workers = args.workers or list(WORKERS[args.quick])
    if min(args.workers) < 1:
        parser.error(
            "--workers must be at least 1: the benchmark measures the hand-off from workers"
        )
    if args.batch_size is not None and min(args.batch_size) < 1:
        parser.error("--batch-size must be at least 1")
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(
        quick=args.quick,
        reps=args.reps or REPS[args.quick],
        first_batch_reps=FIRST_BATCH_REPS[args.quick],
        memory_epochs=MEMORY_EPOCHS[args.quick],
    )
    # Keep the reference first whatever order the loaders were named in.
    classes = {name: loader_class(name) for name in LOADERS if name in args.loaders}
    runs = plan(preset_names(args.preset, args.quick), args.workers, args.batch_size, args.quick)
    if args.shm_size:
        small_dev_shm(runs, args)
        return
    document = report.new_document(runs=[])
    # The jpeg preset writes its files here; every run of this invocation shares them.
    with tempfile.TemporaryDirectory(prefix="shmloader-bench-") as scratch:
        for number, run in enumerate(runs, 1):
            progress = StatusLine(f"[{number}/{len(runs)}] {run.label()}:")
            try:
                record = measure_run(run, classes, settings, Path(scratch), progress)
            except BenchmarkError as error:
                sys.exit(f"[{run.label()}] {error}")
            progress.clear()
            document["runs"].append(record)
            report.write_json(
                document, args.out
            )  # after every run, so that a broken-off run keeps its figures
            print(report.table(record) + "\n")
    if len(runs) > 1:
        print(report.summary(document["runs"]) + "\n")
    print(f"figures written to {args.out}")
    try:
        paths = plot.write_throughput(document, args.out, SIZE_SWEEP)
    except InputError as error:  # the charts are optional: the table and the JSON are not
        print(f"no chart: {error}")
        return
    for path in paths:
        print(f"chart written to {path}")


def small_dev_shm(runs: list[Run], args: argparse.Namespace) -> None:
    """Every run with a /dev/shm of args.shm_size beside a roomy one (see container.py)."""
    container.check_namespace(args.shm_size)
    document = report.new_document(runs=[])
    with tempfile.TemporaryDirectory(prefix="shmloader-bench-") as scratch:
        for number, run in enumerate(runs, 1):
            progress = StatusLine(f"[{number}/{len(runs)}] {run.label()}:")
            record = container.measure(
                run.preset.name,
                run.workers,
                run.batch_size,
                args.shm_size,
                args.quick,
                scratch,
                progress,
            )
            progress.clear()
            document["runs"].append(record)
            report.write_json(document, args.out)
            print(container.table(record) + "\n")
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()

"""torch's DataLoader against shmloader's, side by side, on the same dataset objects.

    python benchmarks/bench.py --quick
    python benchmarks/bench.py --preset uint8-224 --preset tiny [--loaders torch]

For each preset, both loaders get the same dataset object and the same arguments. Their
first epochs run side by side and must yield identical batches; then timed epochs
alternate between the loaders (torch, shmloader, torch, ...) so that machine noise hits
both alike, and the figures are medians over those repetitions. Time to first batch and
peak memory are measured afterwards on fresh, non-persistent loaders, one at a time.
See shared/BENCHMARKS.md for what the figures mean.
"""
import argparse
import datetime
import functools
import gc
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.utils.data

import report
from measure import BenchmarkError, Epoch, Spec, checked_warm_up, first_batch_s, peak_memory, timed_epoch
from workloads import PRESETS, Preset

LOADERS = ("torch", "shmloader")  # torch first: it is the reference the others are checked against
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "{preset}.json"
# (full run, --quick): timed epochs per loader, and fresh loaders timed to first batch.
REPS = (7, 5)
FIRST_BATCH_REPS = (5, 3)


@dataclass(frozen=True)
class Settings:
    quick: bool
    workers: int
    reps: int
    first_batch_reps: int


def loader_class(name: str) -> type:
    if name == "torch":
        return torch.utils.data.DataLoader
    try:
        from shmloader import DataLoader
    except ImportError as error:
        sys.exit(f"shmloader.DataLoader cannot be imported ({error}); run with --loaders torch")
    return DataLoader


class Progress:
    """One status line on stderr, rewritten in place on a terminal."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._end = "\r" if sys.stderr.isatty() else "\n"
        self._width = 0

    def __call__(self, message: str) -> None:
        line = f"{self._prefix} {message}"
        if self._end == "\r":  # pad over the remains of a longer previous line
            self._width = max(self._width, len(line))
            line = line.ljust(self._width)
        print(line, end=self._end, file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self._end == "\r":
            print(" " * self._width, end="\r", file=sys.stderr, flush=True)


def throughput(makers: dict[str, Callable[..., Any]], settings: Settings,
               progress: Callable[[str], None]) -> tuple[Spec, int, dict[str, list[Epoch]], dict[str, Any]]:
    """Warm-up with the equality check, then the interleaved timed epochs of persistent
    loaders. The loaders live only in this function, so their workers are shut down
    when it returns. Returns (batch layout, batches compared, epochs, stats)."""
    loaders = {name: make(persistent_workers=True) for name, make in makers.items()}
    check = ", checking that their batches are equal" if len(loaders) > 1 else ""
    progress(f"warm-up epoch of {' and '.join(loaders)}{check}")
    spec, compared = checked_warm_up(loaders)
    epochs = {name: [] for name in loaders}
    for rep in range(settings.reps):
        for name, loader in loaders.items():
            progress(f"{name}: timed epoch {rep + 1}/{settings.reps}")
            epochs[name].append(timed_epoch(loader, spec))
    # Only shmloader has stats(); they cover the warm-up and every timed epoch.
    stats = {name: loader.stats() if hasattr(loader, "stats") else None for name, loader in loaders.items()}
    return spec, compared, epochs, stats


def fresh_loader_figures(makers: dict[str, Callable[..., Any]], spec: Spec, settings: Settings,
                         progress: Callable[[str], None]) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time to first batch (interleaved repetitions) and peak memory, each on a fresh
    non-persistent loader, one loader alive at a time."""
    fresh = {name: functools.partial(make, persistent_workers=False) for name, make in makers.items()}
    first = {name: [] for name in fresh}
    for rep in range(settings.first_batch_reps):
        for name, make in fresh.items():
            progress(f"{name}: first batch {rep + 1}/{settings.first_batch_reps}")
            first[name].append(first_batch_s(make, spec))
    memory = {}
    for name, make in fresh.items():
        progress(f"{name}: memory epoch")
        gc.collect()  # so that no earlier loader's workers count in the process tree
        memory[name] = peak_memory(make, spec)
    return first, memory


def run_preset(preset: Preset, classes: dict[str, type], settings: Settings) -> dict[str, Any]:
    batches = preset.quick_batches if settings.quick else preset.batches
    dataset = preset.make_dataset(batches * preset.batch_size)
    # The same dataset object and arguments for every loader; shuffle=False so that the
    # loaders' batches can be compared. pin_memory=False: torch's pinning thread would
    # count as main-process CPU, and shmloader is compared on transport alone.
    makers = {name: functools.partial(cls, dataset, batch_size=preset.batch_size, shuffle=False,
                                      num_workers=settings.workers, pin_memory=False)
              for name, cls in classes.items()}
    progress = Progress(f"[{preset.name}]")
    spec, compared, epochs, stats = throughput(makers, settings, progress)
    gc.collect()
    first, memory = fresh_loader_figures(makers, spec, settings, progress)
    progress.clear()
    loaders = {name: report.figures(epochs[name], first[name], memory[name], stats[name]) for name in classes}
    return {
        "preset": {
            "name": preset.name,
            "sample": preset.description,
            "batch_size": preset.batch_size,
            "batches_per_epoch": batches,
            "sample_bytes": preset.sample_bytes,
        },
        "settings": {**vars(settings), "loaders": list(classes)},
        # Every loader after the first is checked against the first, torch when it runs.
        "correctness": {"reference": next(iter(classes)), "compared": list(classes)[1:],
                        "batches": compared},
        "loaders": loaders,
        "ratios": report.ratios(loaders),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS),
                        help="workload to run; repeat for several (default: uint8-224)")
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS),
                        help="loaders to compare (default: both)")
    parser.add_argument("--workers", type=int, default=2, help="num_workers of every loader (default: 2)")
    parser.add_argument("--quick", action="store_true", help="short epochs and few repetitions")
    parser.add_argument("--reps", type=int,
                        help=f"timed epochs per loader (default: {REPS[1]} with --quick, else {REPS[0]})")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="JSON path; {preset} is replaced by the preset's name (default: %(default)s)")
    args = parser.parse_args(argv)
    args.preset = args.preset or ["uint8-224"]
    if args.workers < 1:
        parser.error("--workers must be at least 1: the benchmark measures the hand-off from workers")
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be at least 1")
    if len(args.preset) > 1 and "{preset}" not in args.out:
        parser.error("--out must contain {preset} when several presets run")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = Settings(
        quick=args.quick,
        workers=args.workers,
        reps=args.reps or REPS[args.quick],
        first_batch_reps=FIRST_BATCH_REPS[args.quick],
    )
    # Keep the reference first whatever order the loaders were named in.
    classes = {name: loader_class(name) for name in LOADERS if name in args.loaders}
    machine = report.machine()
    print(report.machine_line(machine) + "\n")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for name in dict.fromkeys(args.preset):
        try:
            figures = run_preset(PRESETS[name], classes, settings)
        except BenchmarkError as error:
            sys.exit(f"[{name}] {error}")
        record = {"started": started, "command": sys.argv, "machine": machine, **figures}
        path = Path(args.out.format(preset=name))
        report.write_json(record, path)
        print(report.table(record))
        print(f"written to {path}\n")


if __name__ == "__main__":
    main()

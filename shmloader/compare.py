"""What shmloader gains on YOUR pipeline: torch's DataLoader and shmloader's on your dataset,
with your loader arguments, side by side in one run.

    python -m shmloader.compare --dataset mypackage.data:make_train_set \\
        --dataset-args '{"root": "/data/train"}' --batch-size 64 --num-workers 4 \\
        --shuffle --persistent-workers --step-ms 30 --max-batches 200

(installed as the console script shmloader-compare as well). --dataset names a callable
that returns your Dataset: package.module:callable, or path/to/file.py:callable. Both
loaders get the same dataset object and arguments, and each a generator seeded alike,
so they draw the same order and the same worker seeds. Their first epochs run side by
side and their batches are compared; then timed epochs alternate (torch, shmloader,
shmloader, torch, ...) so that machine noise hits both alike; then time to first batch
on new loaders, and the memory of the process tree over a few epochs, one loader at a
time. The table gives medians, the ratios, and one sentence to conclude. --step-ms
stands in for your training step (a sleep, as while a GPU works).

Exit status: 0; 1 when the loaders' batches differ or a loader fails; 2 for bad input.
See docs/compare.md.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import torch.utils.data

import shmloader
from shmloader.bench import factory, plot, preflight, session
from shmloader.bench.check import EXACT, STRUCTURE
from shmloader.bench.errors import InputError, require
from shmloader.bench.figures import REFERENCE, measurement_figures, ratios
from shmloader.bench.machine import machine_line
from shmloader.bench.progress import ProgressBar
from shmloader.bench.record import head, write_json
from shmloader.bench.verdict import OTHER, conclusion, table

PROG = "shmloader-compare"
LOADERS = {REFERENCE: torch.utils.data.DataLoader, OTHER: shmloader.DataLoader}
AUTO = "auto"
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
# torch's DataLoader flags, passed on as given.
FLAGS = ("shuffle", "drop_last", "persistent_workers", "pin_memory")


def _at_least(minimum: int | float, kind: type) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is less than {minimum}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    data = p.add_argument_group("your dataset")
    data.add_argument(
        "--dataset",
        required=True,
        metavar="MODULE:CALLABLE",
        help="a callable returning your Dataset: package.module:callable or path/to/file.py:callable",
    )
    data.add_argument(
        "--dataset-args",
        default="{}",
        metavar="JSON",
        help="""its keyword arguments, a JSON object: '{"root": "/data", "train": true}'""",
    )
    loader = p.add_argument_group("your loader's arguments (torch.utils.data.DataLoader's)")
    loader.add_argument("--batch-size", type=_at_least(1, int), default=1)
    loader.add_argument("--num-workers", type=_at_least(0, int), default=2, help="(default: 2)")
    for flag in FLAGS:
        loader.add_argument(f"--{flag.replace('_', '-')}", action="store_true")
    loader.add_argument("--prefetch-factor", type=_at_least(1, int))
    loader.add_argument("--collate-fn", metavar="MODULE:CALLABLE")
    loader.add_argument("--worker-init-fn", metavar="MODULE:CALLABLE")
    loader.add_argument("--multiprocessing-context", choices=("fork", "spawn", "forkserver"))
    loader.add_argument("--timeout", type=_at_least(0, float), default=0, metavar="SECONDS")
    run = p.add_argument_group("the measurement")
    run.add_argument(
        "--epochs",
        type=_at_least(1, int),
        default=3,
        help="timed epochs per loader, and new loaders timed to their first batch (default: 3)",
    )
    run.add_argument(
        "--max-batches",
        type=_at_least(1, int),
        metavar="N",
        help="end every epoch after N batches (default: whole epochs)",
    )
    run.add_argument(
        "--step-ms",
        type=_at_least(0, float),
        default=0.0,
        metavar="MS",
        help="a training step after each batch, slept (default: 0)",
    )
    run.add_argument(
        "--memory-epochs",
        type=_at_least(0, int),
        default=2,
        metavar="N",
        help="epochs of a new loader over which memory is sampled (psutil); 0: no memory figures "
        "(default: 2)",
    )
    run.add_argument(
        "--check",
        choices=(AUTO, EXACT, STRUCTURE),
        default=AUTO,
        help="compare the first epochs' batches exactly, or by structure, shapes and dtypes only; "
        "auto: exactly unless the dataset returns another batch under the same seeds "
        "(default: auto)",
    )
    run.add_argument("--seed", type=int, default=0, help="of both loaders' generators (default: 0)")
    out = p.add_argument_group("output")
    out.add_argument(
        "--json", type=Path, metavar="FILE", help="write every figure, the machine and versions"
    )
    out.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw the comparison (matplotlib)"
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.num_workers == 0:
        p.error(
            "--num-workers 0 makes both loaders torch's own single-process loader: there is nothing to "
            "compare. Give the number of workers your training uses (1 or more)"
        )
    if args.plot is not None and args.plot.suffix.lower() not in PLOT_SUFFIXES:
        p.error(f"--plot {args.plot}: name a file ending in {', '.join(PLOT_SUFFIXES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command; returns its exit status (see the module's docstring)."""
    args = parse_args(argv)
    try:
        return run(args, [PROG, *(sys.argv[1:] if argv is None else argv)])
    except InputError as error:
        if error.trace:
            print(error.trace, file=sys.stderr, end="")
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, command: list[str]) -> int:
    # The optional packages first: a missing one is an error now, not after the run.
    if args.plot is not None:
        plot.figure_class()
    if args.memory_epochs:
        require("psutil", "peak memory (--memory-epochs; 0 skips it)")
    dataset_args = factory.keyword_arguments(args.dataset_args, "--dataset-args")
    dataset = factory.make_dataset(args.dataset, dataset_args)
    kwargs = loader_kwargs(args)
    preflight.check_kind(dataset, args.shuffle)
    if args.check == AUTO:
        mode, why = preflight.check_mode(dataset, args.batch_size, kwargs["collate_fn"], args.seed)
    else:
        preflight.first_batch(dataset, args.batch_size, kwargs["collate_fn"])
        mode, why = args.check, "as --check asked"
    makers = {name: _maker(cls, dataset, kwargs, args.seed) for name, cls in LOADERS.items()}
    batches = _batches_per_epoch(makers[REFERENCE], args.max_batches)
    record = head(command)
    print(machine_line(record["machine"]) + "\n")
    plan = session.Plan(
        reps=args.epochs,
        first_batch_reps=args.epochs,
        memory_epochs=args.memory_epochs,
        max_batches=args.max_batches,
        step_s=args.step_ms / 1e3,
        check=mode,
        fail_on_mismatch=False,
        fixed_layout=False,
    )
    # Per loader: the first epoch, the timed and the memory epochs, a batch per first-batch repetition.
    total = (
        None
        if batches is None
        else len(LOADERS) * (batches * (1 + args.epochs + args.memory_epochs) + args.epochs)
    )
    progress = ProgressBar(total)
    try:
        measurement = session.measure(
            {name: session.Makers(make, make, make) for name, make in makers.items()},
            plan,
            progress,
            progress.tick,
        )
    except Exception as error:  # a loader failed: the dataset in a worker, most likely
        # Its traceback holds the loader's iterator in a cycle (torch's re-raise holds the
        # error): collected later, torch's would wait 5 s for each worker.
        error.__traceback__ = None
        progress.clear()
        print(
            f"{PROG}: a loader failed while measuring: {type(error).__name__}: {error}",
            file=sys.stderr,
        )
        return 1
    progress.clear()
    record.update(_figures(args, dataset, dataset_args, kwargs, measurement, why))
    record["conclusion"] = conclusion(record)
    print(table(record) + "\n\n" + record["conclusion"])
    if args.json is not None:
        write_json(record, args.json)
        print(f"figures written to {args.json}")
    if args.plot is not None:
        plot.write(record, args.plot)
        print(f"chart written to {args.plot}")
    return 1 if measurement.check.mismatch is not None else 0


def _figures(
    args: argparse.Namespace,
    dataset: Any,
    dataset_args: dict[str, Any],
    kwargs: dict[str, Any],
    measurement: session.Measurement,
    why: str,
) -> dict[str, Any]:
    """The record's body: what was measured, how, and every figure."""
    loaders, _ = measurement_figures(measurement)
    check = measurement.check
    return {
        "dataset": {
            "factory": args.dataset,
            "args": dataset_args,
            "call": factory.call_text(args.dataset, dataset_args),
            "type": type(dataset).__name__,
            "kind": "iterable"
            if isinstance(dataset, torch.utils.data.IterableDataset)
            else "map-style",
        },
        "loader_args": {
            **kwargs,
            "collate_fn": args.collate_fn,
            "worker_init_fn": args.worker_init_fn,
        },
        "settings": {
            "epochs": args.epochs,
            "first_batch_reps": args.epochs,
            "max_batches": args.max_batches,
            "step_ms": args.step_ms,
            "memory_epochs": args.memory_epochs,
            "seed": args.seed,
            "batches_per_epoch": measurement.epochs[REFERENCE][0].batches,
        },
        "check": {
            "mode": check.mode,
            "why": why,
            "reference": check.reference,
            "compared": list(check.compared),
            "batches": check.batches,
            "mismatch": check.mismatch,
        },
        "loaders": loaders,
        "ratios": ratios(loaders),
    }


def loader_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """torch's DataLoader arguments from the command line, callables loaded."""
    kwargs = {
        "batch_size": args.batch_size,
        "num_workers": args.num_workers,
        "timeout": args.timeout,
        "multiprocessing_context": args.multiprocessing_context,
        "prefetch_factor": args.prefetch_factor,
        **{flag: getattr(args, flag) for flag in FLAGS},
        "collate_fn": None,
        "worker_init_fn": None,
    }
    for name in ("collate_fn", "worker_init_fn"):
        spec = getattr(args, name)
        if spec is not None:
            kwargs[name] = factory.load_callable(spec, f"--{name.replace('_', '-')}")
    return kwargs


def _maker(cls: type, dataset: Any, kwargs: dict[str, Any], seed: int) -> Any:
    """A function that builds a new loader, its generator seeded with `seed` (so that
    every loader draws the same order and worker seeds); InputError now if the loader
    rejects the arguments."""

    def make() -> Any:
        return cls(dataset, generator=torch.Generator().manual_seed(seed), **kwargs)

    try:
        make()
    except (ValueError, TypeError) as error:
        raise InputError(
            f"{cls.__module__}.{cls.__qualname__} rejects these arguments: {error}"
        ) from None
    return make


def _batches_per_epoch(make: Any, max_batches: int | None) -> int | None:
    """Batches in an epoch, for the progress bar; None where the dataset has no length."""
    try:
        batches = len(make())
    except TypeError:  # an IterableDataset without __len__
        return max_batches
    return batches if max_batches is None else min(batches, max_batches)


if __name__ == "__main__":
    sys.exit(main())

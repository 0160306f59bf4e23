"""compare's terminal output from its record: the table of figures, the check, and the one
sentence that tells the user what to conclude."""

from typing import Any, Callable

from .check import EXACT
from .figures import REFERENCE

# Throughputs closer than this (or than the repetitions' own spread) are the same.
NOISE_FLOOR = 0.03
# A loop that waits for data this much of the time is bound by the data, not its step;
# and a loader that cuts the waiting by this much unblocks it.
DATA_BOUND = 0.10
OTHER = "shmloader"


def _memory(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda figs: (figs["memory"] or {}).get(key)


# (heading, the figure, its format, its scale, the key of its ratio to torch or None)
COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any], str, float, str | None]] = [
    ("samples/s", lambda f: f["samples_per_s"], "{:,.0f}", 1, "samples_per_s"),
    ("GB/s", lambda f: f["gb_per_s"], "{:.3g}", 1, "gb_per_s"),
    ("spread", lambda f: f["throughput_spread"], "{:.0%}", 1, None),
    ("main CPU ms/batch", lambda f: f["cpu_s_per_batch"], "{:.2f}", 1e3, "cpu_s_per_batch"),
    ("first batch s", lambda f: f["first_batch_s"], "{:.3f}", 1, "first_batch_s"),
    ("waits for data", lambda f: f["wait_fraction"], "{:.0%}", 1, None),
    ("peak PSS MiB", _memory("peak_pss_bytes"), "{:,.0f}", 2**-20, "peak_pss_bytes"),
]


def table(record: dict[str, Any]) -> str:
    """The title, the loaders' figures and their ratios, what the figures mean, the check."""
    rows = [["loader", *(heading for heading, *_ in COLUMNS)]]
    for name, figs in record["loaders"].items():
        rows.append(
            [
                name,
                *(
                    "" if (value := get(figs)) is None else template.format(value * scale)
                    for _, get, template, scale, _ in COLUMNS
                ),
            ]
        )
    for name, ratio in record["ratios"].items():
        rows.append(
            [
                name,
                *(
                    "" if key is None or ratio.get(key) is None else f"{ratio[key]:.2f}x"
                    for *_, key in COLUMNS
                ),
            ]
        )
    return "\n".join(
        [
            title(record),
            *aligned(rows),
            "ratios: higher is better for samples/s and GB/s; lower for CPU, first batch and memory",
            "main CPU: the main process's CPU per batch less the loop's own; waits for data: of each epoch's time, "
            "the time the loop was blocked in iter() and next(); peak PSS: main process and workers, shared pages "
            "counted once",
            check_line(record["check"]),
        ]
    )


def title(record: dict[str, Any]) -> str:
    args, settings = record["loader_args"], record["settings"]
    options = [
        f"batch {args['batch_size']}",
        f"{args['num_workers']} workers",
        *(
            name.replace("_", " ")
            for name in ("shuffle", "drop_last", "persistent_workers", "pin_memory")
            if args.get(name)
        ),
        *(
            f"{name.replace('_', ' ')} {args[name]}"
            for name in (
                "prefetch_factor",
                "collate_fn",
                "worker_init_fn",
                "multiprocessing_context",
                "timeout",
            )
            if args.get(name)
        ),
    ]
    step = f", a {settings['step_ms']:g} ms step per batch" if settings["step_ms"] else ""
    return (
        f"torch DataLoader vs shmloader on {record['dataset']['call']}: {', '.join(options)}; "
        f"{settings['batches_per_epoch']:,} batches per epoch{step}; "
        + (
            "one timed epoch each"
            if settings["epochs"] == 1
            else f"medians of {settings['epochs']} epochs"
        )
    )


def check_line(check: dict[str, Any]) -> str:
    compared = " and ".join(check["compared"])
    if check["mismatch"] is not None:
        return (
            f"MISMATCH in the first epoch ({check['mode']} comparison): {check['mismatch']}. If the dataset "
            "draws random numbers that no loader seeds, rerun with --check structure; otherwise please "
            "report it: shmloader must yield torch's batches"
        )
    if check["mode"] == EXACT:
        return (
            f"check: {compared} yielded exactly the same {check['batches']:,} batches as "
            f"{check['reference']} in the first epoch ({check['why']})"
        )
    return (
        f"check: {compared}'s first {check['batches']:,} batches match {check['reference']}'s in structure, "
        f"shapes and dtypes; values not compared: {check['why']}"
    )


def conclusion(record: dict[str, Any]) -> str:
    """One sentence: is the loop data-bound, and what does shmloader change."""
    ref, other = record["loaders"][REFERENCE], record["loaders"][OTHER]
    speedup = other["samples_per_s"] / ref["samples_per_s"]
    noise = max(NOISE_FLOOR, ref["throughput_spread"], other["throughput_spread"])
    saved_ms = (ref["cpu_s_per_batch"] - other["cpu_s_per_batch"]) * 1e3
    cpu = (
        f"saves {saved_ms:.2f} ms of main-process CPU per batch"
        if saved_ms >= 0
        else f"costs {-saved_ms:.2f} ms more main-process CPU per batch"
    )
    waits = (
        f"your loop waits for data {ref['wait_fraction']:.0%} of the time with torch, "
        f"{other['wait_fraction']:.0%} with shmloader"
    )
    if speedup > 1 + noise and ref["wait_fraction"] - other["wait_fraction"] >= DATA_BOUND:
        sentence = f"{waits}: shmloader delivers {speedup:.2f}x torch's samples/s and {cpu}."
    elif speedup > 1 + noise:  # as data-bound as before, but faster
        sentence = f"shmloader delivers {speedup:.2f}x torch's samples/s and {cpu} ({waits})."
    elif speedup < 1 - noise:
        sentence = (
            f"shmloader is slower on your pipeline, {speedup:.2f}x torch's samples/s ({waits}), and {cpu}. "
            "Please report it, with the --json file."
        )
    else:
        bound = (
            "the dataset's own work (fetching and transforming samples in the workers)"
            if max(ref["wait_fraction"], other["wait_fraction"]) >= DATA_BOUND
            else f"your training step ({waits})"
        )
        sentence = (
            f"your pipeline is bound by {bound}: both loaders are within {abs(speedup - 1):.0%} of each "
            f"other's samples/s (the epochs' own spread: {noise:.0%}), and shmloader {cpu}."
        )
    if record["check"]["mismatch"] is not None:
        sentence += " But the loaders' batches differ (MISMATCH above): these figures compare different work."
    return sentence


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines: the first column left-aligned, the others right-aligned,
    each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:]))]
        ).rstrip()
        for row in rows
    ]


def workers_label(workers: int) -> str:
    return f"{workers} worker{'' if workers == 1 else 's'}"

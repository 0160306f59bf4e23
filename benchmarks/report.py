"""Turning measurements into figures, the terminal table and the JSON record."""
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import numpy
import torch

from measure import Epoch, psutil

REFERENCE = "torch"
# Figures compared as (loader / torch): above 1 is better for throughput, worse for the rest.
RATIO_FIGURES = ("samples_per_s", "gb_per_s", "cpu_s_per_batch", "first_batch_s")


def figures(epochs: list[Epoch], first_batch_reps_s: list[float],
            memory: dict[str, int] | None, stats: Any) -> dict[str, Any]:
    """One loader's figures: medians over repetitions, with every repetition kept."""
    rates = [e.samples / e.wall_s for e in epochs]
    result = {
        "samples_per_s": statistics.median(rates),
        "gb_per_s": statistics.median(e.bytes / e.wall_s / 1e9 for e in epochs),
        "cpu_s_per_batch": statistics.median(e.cpu_s / e.batches for e in epochs),
        # (max - min) / median of samples/s: how far apart the repetitions were.
        "throughput_spread": (max(rates) - min(rates)) / statistics.median(rates),
        "first_batch_s": statistics.median(first_batch_reps_s),
        "memory": memory,
        "epochs": [dataclasses.asdict(e) for e in epochs],
        "first_batch_reps_s": first_batch_reps_s,
    }
    if stats is not None:
        result["stats"] = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else repr(stats)
    return result


def ratios(loaders: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each other loader's figures divided by torch's."""
    if REFERENCE not in loaders:
        return {}
    ref = loaders[REFERENCE]
    result = {}
    for name, figs in loaders.items():
        if name == REFERENCE:
            continue
        ratio = {key: figs[key] / ref[key] for key in RATIO_FIGURES}
        if figs["memory"] and ref["memory"]:
            ratio["added_pss_bytes"] = figs["memory"]["added_pss_bytes"] / ref["memory"]["added_pss_bytes"]
        result[f"{name}/{REFERENCE}"] = ratio
    return result


def machine() -> dict[str, Any]:
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _meminfo_bytes("MemTotal"),
        "dev_shm_bytes": _dev_shm_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "psutil": psutil.__version__ if psutil else None,
        "shmloader": _installed_version("shmloader"),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (f"{m['cores']} cores ({m['cpu_model']}), {m['memory_bytes'] / 2**30:.1f} GiB, Python {m['python']}, "
            f"torch {m['torch']}, numpy {m['numpy']}, {m['platform']}")


def _cpu_model() -> str | None:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # /proc/meminfo counts in KiB


def _dev_shm_bytes() -> int | None:
    try:
        vfs = os.statvfs("/dev/shm")
    except OSError:
        return None
    return vfs.f_blocks * vfs.f_frsize


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_json(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


# (heading, width, function of a loader's figures -> cell, function of a ratio dict -> cell)
_COLUMNS = [
    ("samples/s", 10, lambda f: f"{f['samples_per_s']:,.0f}", lambda r: f"{r['samples_per_s']:.2f}x"),
    ("GB/s", 7, lambda f: f"{f['gb_per_s']:.2f}", lambda r: f"{r['gb_per_s']:.2f}x"),
    ("spread", 7, lambda f: f"{f['throughput_spread']:.0%}", lambda r: ""),
    ("main CPU ms/batch", 18, lambda f: f"{f['cpu_s_per_batch'] * 1e3:.2f}", lambda r: f"{r['cpu_s_per_batch']:.2f}x"),
    ("first batch s", 14, lambda f: f"{f['first_batch_s']:.3f}", lambda r: f"{r['first_batch_s']:.2f}x"),
    ("peak PSS MiB", 13, lambda f: _mib(f["memory"], "peak_pss_bytes"), lambda r: ""),
    ("added MiB", 10, lambda f: _mib(f["memory"], "added_pss_bytes"),
     lambda r: f"{r['added_pss_bytes']:.2f}x" if "added_pss_bytes" in r else ""),
]


def _mib(memory: dict[str, int] | None, key: str) -> str:
    return f"{memory[key] / 2**20:,.0f}" if memory else "n/a"


def table(record: dict[str, Any]) -> str:
    """The terminal table of one preset's record."""
    p, s = record["preset"], record["settings"]
    title = (f"{p['name']}: {p['sample']}, batch {p['batch_size']}, {s['workers']} workers, "
             f"{p['batches_per_epoch']} batches/epoch, median of {s['reps']} reps")
    rows = [[name, *(cell(figs) for _, _, cell, _ in _COLUMNS)] for name, figs in record["loaders"].items()]
    rows += [[name, *(cell(r) for _, _, _, cell in _COLUMNS)] for name, r in record["ratios"].items()]
    first_width = max(len("loader"), *(len(row[0]) for row in rows))
    widths = [first_width, *(width for _, width, _, _ in _COLUMNS)]
    header = ["loader", *(heading for heading, _, _, _ in _COLUMNS)]
    lines = [title, _line(header, widths), *(_line(row, widths) for row in rows)]
    check = record["correctness"]
    if check["compared"]:
        lines.append(f"equality check: {' and '.join(check['compared'])} yielded the same "
                     f"{check['batches']} batches as {check['reference']}")
    return "\n".join(lines)


def _line(cells: list[str], widths: list[int]) -> str:
    return "  ".join([cells[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

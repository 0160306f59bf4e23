"""The PNG charts of a benchmark run, drawn from its JSON document.

<out>.png                  samples/s per workload: torch, shmloader and the limit
<out>-vs-sample-size.png   GB/s against sample size, log-log (runs of the size sweep)
"""

import math
from pathlib import Path
from typing import Any

import report
from workloads import SIZE_SWEEP

try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import StrMethodFormatter
except ImportError:  # charts are optional: the table and the JSON do not need matplotlib
    Figure = None
AVAILABLE = Figure is not None

COLOURS = {
    "torch": "tab:blue",
    "shmloader": "tab:orange",
    "shmloader device=": "tab:red",
    report.LIMIT: "tab:gray",
    "ideal": "tab:gray",
}
LABELS = {
    report.LIMIT: "transport-free limit"
}  # legend names where the short name would not say enough
COLUMNS = 3  # subplots per row
MIN_WIDTH = 10  # inches
DPI = 110


def write(document: dict[str, Any], out: Path) -> list[Path]:
    """Draw every chart that the document's runs allow, next to `out`; returns their paths."""
    paths = [out.with_suffix(".png")]
    throughput_chart(document).savefig(paths[0], dpi=DPI)
    sweep = [run for run in document["runs"] if run["preset"]["family"] == SIZE_SWEEP]
    if sweep:
        paths.append(out.with_name(f"{out.stem}-vs-sample-size.png"))
        sample_size_chart(sweep, document["machine"]).savefig(paths[1], dpi=DPI)
    return paths


def write_train(document: dict[str, Any], out: Path) -> list[Path]:
    """train.py's chart next to `out`, where matplotlib is installed."""
    if not AVAILABLE:
        return []
    path = out.with_suffix(".png")
    train_chart(document).savefig(path, dpi=DPI)
    return [path]


def train_chart(document: dict[str, Any]) -> "Figure":
    """Steps/s of the training loop per case, a bar per way of feeding it, each labelled
    with its percentage of the ideal's."""
    runs = document["runs"]
    names = list(runs[0]["rows"])
    figure = Figure(
        figsize=(max(1.6 * len(runs) * len(names) / 2, MIN_WIDTH), 4.6), layout="constrained"
    )
    ax = figure.subplots()
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        positions = [i + (k - (len(names) - 1) / 2) * width for i in range(len(runs))]
        bars = ax.bar(
            positions,
            [run["rows"][name]["of_ideal"] for run in runs],
            width,
            label=name,
            color=COLOURS[name],
        )
        ax.bar_label(
            bars, [f"{run['rows'][name]['steps_per_s']:.3g}/s" for run in runs], fontsize=7
        )
    ax.set_xticks(
        range(len(runs)), [f"{r['case']}\n({r['bound']}-bound)" for r in runs], fontsize=8
    )
    ax.set_ylabel("steps/s, fraction of the ideal's")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.0%}"))
    ax.margins(y=0.12)
    finish(
        figure,
        f"Training loop fed by each loader, against batches already in memory ({document['cores']})",
        document["machine"],
    )
    return figure


def series(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The figures of every loader of a run, then the limit's."""
    return {**run["loaders"], report.LIMIT: run["limit"]}


def config(run: dict[str, Any]) -> tuple[int, int]:
    return run["settings"]["workers"], run["settings"]["batch_size"]


def run_label(run: dict[str, Any]) -> str:
    workers, batch = config(run)
    return f"{report.workers_label(workers)}\nbatch {batch}"


def size_label(nbytes: float) -> str:
    return f"{nbytes / 2**10:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.3g} MiB"


def throughput_chart(document: dict[str, Any]) -> "Figure":
    """One subplot per workload (each with its own scale, so that 300 and 300,000
    samples/s are both readable), a group of bars per run, a bar per loader and the
    limit; a loader's bar is labelled with its fraction of the limit."""
    by_preset: dict[str, list[dict[str, Any]]] = {}
    for run in document["runs"]:
        by_preset.setdefault(run["preset"]["name"], []).append(run)
    figure, axes = subplot_grid(len(by_preset))
    for ax, (name, runs) in zip(axes, by_preset.items()):
        bar_group(ax, runs)
        ax.set_title(
            f"{name} ({size_label(runs[0]['preset']['sample_bytes'])} per sample)", fontsize=10
        )
    finish(
        figure,
        "Throughput: torch DataLoader, shmloader and the transport-free limit "
        "(% = fraction of the limit)",
        document["machine"],
    )
    return figure


def bar_group(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Side by side for each run of one workload: a bar per loader, then the limit's."""
    names = list(series(runs[0]))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        figs = [series(run)[name] for run in runs]
        positions = [i + (k - (len(names) - 1) / 2) * width for i in range(len(runs))]
        bars = ax.bar(
            positions,
            [f["samples_per_s"] for f in figs],
            width,
            label=LABELS.get(name, name),
            color=COLOURS[name],
        )
        if name != report.LIMIT:
            ax.bar_label(bars, [f"{f['fraction_of_limit']:.0%}" for f in figs], fontsize=7)
    ax.set_xticks(range(len(runs)), [run_label(run) for run in runs], fontsize=8)
    ax.set_ylabel("samples/s")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.margins(y=0.12)  # room for the labels above the tallest bar


def sample_size_chart(runs: list[dict[str, Any]], machine: dict[str, Any]) -> "Figure":
    """GB/s against sample size, log-log, one subplot per (workers, batch size): where
    per-batch costs dominate GB/s grows with the sample, where bandwidth does it is flat."""
    configs = sorted({config(r) for r in runs})
    figure, axes = subplot_grid(len(configs))
    for ax, (workers, batch) in zip(axes, configs):
        points = sorted(
            (r for r in runs if config(r) == (workers, batch)),
            key=lambda r: r["preset"]["sample_bytes"],
        )
        sizes = [r["preset"]["sample_bytes"] for r in points]
        for name in series(points[0]):
            ax.plot(
                sizes,
                [series(r)[name]["gb_per_s"] for r in points],
                marker="o",
                label=LABELS.get(name, name),
                color=COLOURS[name],
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes, [size_label(s) for s in sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("sample size")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{report.workers_label(workers)}, batch {batch}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    finish(figure, "Throughput against sample size (float32 samples, size sweep)", machine)
    return figure


def subplot_grid(count: int) -> tuple["Figure", list[Any]]:
    """A figure with `count` subplots, COLUMNS to a row; the grid's spare cells hidden."""
    columns = min(COLUMNS, count)
    rows = math.ceil(count / columns)
    # At least MIN_WIDTH inches, so that the machine line under the title fits.
    figure = Figure(figsize=(max(5.2 * columns, MIN_WIDTH), 3.8 * rows + 1), layout="constrained")
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    return figure, axes[:count]


def finish(figure: "Figure", title: str, machine: dict[str, Any]) -> None:
    """One legend for every subplot (they share their series), and the title with the
    machine line under it."""
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    figure.suptitle(f"{title}\n{report.machine_line(machine)}", fontsize=10)

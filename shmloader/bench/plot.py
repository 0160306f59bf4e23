"""The charts, drawn from a JSON record. matplotlib comes with the bench extra and is
imported only here, when a chart is drawn.

compare's (--plot)         a panel per figure, torch's bar beside shmloader's
benchmarks/bench.py's      <out>.png: samples/s per workload, torch, shmloader and the limit;
                           <out>-vs-sample-size.png: GB/s against sample size, log-log
benchmarks/train.py's      <out>.png: steps/s per case, a fraction of the ideal's
benchmarks/worker_start.py <out>.png: first batch and epoch gap per start method and index,
                           torch's and shmloader's, a column per worker count, log scale
"""

import math
import textwrap
from pathlib import Path
from typing import Any

from .errors import require
from .figures import figure_at
from .limit import LIMIT
from .machine import machine_line
from .verdict import conclusion, title, workers_label

# Any other series (the limit, train.py's ideal) is grey.
COLOURS = {"torch": "tab:blue", "shmloader": "tab:orange", "shmloader device=": "tab:red"}
GREY = "tab:gray"
LABELS = {LIMIT: "transport-free limit"}  # legend names where the short name would not say enough
# compare's panels: (title, the figure in a loader's figures, scale, format of the bar labels)
PANELS = [
    ("samples/s (higher is better)", ("samples_per_s",), 1, "{:,.0f}"),
    ("main-process CPU ms per batch", ("cpu_s_per_batch",), 1e3, "{:.2f}"),
    ("time to first batch, s", ("first_batch_s",), 1, "{:.2f}"),
    ("loop waits for data, % of its time", ("wait_fraction",), 100, "{:.0f}%"),
    ("peak memory (PSS), MiB", ("memory", "peak_pss_bytes"), 2**-20, "{:,.0f}"),
]
WRAP = 150  # characters per line of compare's title
COLUMNS = 3  # subplots per row of the benchmarks' charts
MIN_WIDTH = 10  # inches
DPI = 110


def figure_class(purpose: str = "--plot") -> Any:
    """matplotlib's Figure (no pyplot, so no display is needed), or InputError naming
    `purpose` and the bench extra."""
    return require("matplotlib.figure", purpose).Figure


def _colour(name: str) -> str:
    return COLOURS.get(name, GREY)


def write(record: dict[str, Any], path: Path) -> None:
    """compare's chart."""
    panels = [
        (heading, keys, scale, template)
        for heading, keys, scale, template in PANELS
        if all(figure_at(figs, keys) is not None for figs in record["loaders"].values())
    ]
    figure = figure_class()(figsize=(3.2 * len(panels), 4.6), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    names = list(record["loaders"])
    for ax, (heading, keys, scale, template) in zip(axes, panels):
        values = [figure_at(record["loaders"][name], keys) * scale for name in names]
        bars = ax.bar(names, values, color=[_colour(name) for name in names])
        ax.bar_label(bars, [template.format(v) for v in values], fontsize=8)
        ax.set_title(heading, fontsize=9)
        ax.margins(y=0.15)  # room for the labels above the taller bar
    text = [title(record), conclusion(record), machine_line(record["machine"])]
    figure.suptitle(
        "\n".join(line for part in text for line in textwrap.wrap(part, WRAP)), fontsize=8
    )
    figure.savefig(path, dpi=DPI)


def write_throughput(document: dict[str, Any], out: Path, sweep: str) -> list[Path]:
    """bench.py's charts next to `out`: samples/s per workload, and GB/s against sample
    size where the document has runs of the presets of family `sweep`; their paths."""
    paths = [out.with_suffix(".png")]
    throughput_chart(document).savefig(paths[0], dpi=DPI)
    runs = [run for run in document["runs"] if run["preset"]["family"] == sweep]
    if runs:
        paths.append(out.with_name(f"{out.stem}-vs-sample-size.png"))
        sample_size_chart(runs, document["machine"]).savefig(paths[1], dpi=DPI)
    return paths


def write_train(document: dict[str, Any], out: Path) -> Path:
    """train.py's chart next to `out`; its path."""
    path = out.with_suffix(".png")
    train_chart(document).savefig(path, dpi=DPI)
    return path


def train_chart(document: dict[str, Any]) -> Any:
    """Steps/s of the training loop per case, a bar per way of feeding it, each labelled
    with its percentage of the ideal's."""
    runs = document["runs"]
    names = list(runs[0]["rows"])
    figure = figure_class("a chart")(
        figsize=(max(1.6 * len(runs) * len(names) / 2, MIN_WIDTH), 4.6), layout="constrained"
    )
    ax = figure.subplots()
    for k, name in enumerate(names):
        bars = _bars(ax, k, len(names), name, [run["rows"][name]["of_ideal"] for run in runs])
        ax.bar_label(
            bars, [f"{run['rows'][name]['steps_per_s']:.3g}/s" for run in runs], fontsize=7
        )
    ax.set_xticks(
        range(len(runs)), [f"{r['case']}\n({r['bound']}-bound)" for r in runs], fontsize=8
    )
    ax.set_ylabel("steps/s, fraction of the ideal's")
    ax.yaxis.set_major_formatter("{x:.0%}")
    ax.margins(y=0.12)
    _finish(
        figure,
        f"Training loop fed by each loader, against batches already in memory ({document['cores']})",
        document["machine"],
    )
    return figure


def write_worker_start(document: dict[str, Any], out: Path) -> Path:
    """worker_start.py's chart next to `out`; its path."""
    path = out.with_suffix(".png")
    worker_start_chart(document).savefig(path, dpi=DPI)
    return path


def worker_start_chart(document: dict[str, Any]) -> Any:
    """Two rows of subplots, the first batch and the epoch gap, a column per worker count;
    in each a group per (start method, index), a bar per loader, log scale (fork's
    hundredths of a second and spawn's seconds on one axis)."""
    runs = document["runs"]
    workers = list(dict.fromkeys(r["workers"] for r in runs))
    groups = list(dict.fromkeys((r["method"], r["index"]) for r in runs))
    names = list(dict.fromkeys(r["loader"] for r in runs))
    by_key = {(r["method"], r["workers"], r["index"], r["loader"]): r for r in runs}
    rows = [("first batch", "first_batch_s"), ("epoch gap", "gap_s")]
    figure = figure_class("a chart")(
        figsize=(max(1.1 * len(groups) * len(workers), MIN_WIDTH + 3), 3.6 * len(rows) + 1),
        layout="constrained",
    )
    axes = figure.subplots(len(rows), len(workers), squeeze=False)
    for row, (heading, key) in enumerate(rows):
        for column, count in enumerate(workers):
            ax = axes[row][column]
            for k, name in enumerate(names):
                values = [
                    figure_at(by_key.get((method, count, index, name)), (key,)) or 0.0
                    for method, index in groups
                ]
                bars = _bars(ax, k, len(names), name, values)
                ax.bar_label(bars, [f"{v:.2g}" for v in values], fontsize=6)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter("{x:.3g}")
            ax.yaxis.set_minor_formatter("")
            ax.set_xticks(range(len(groups)), [f"{m}\n{i}" for m, i in groups], fontsize=7)
            ax.set_ylabel(f"{heading}, s")
            ax.set_title(f"{heading}, {workers_label(count)}", fontsize=10)
    settings = document["settings"]
    _finish(
        figure,
        f"Worker start-up: first batch of a fresh loader and the gap between epochs "
        f"(non-persistent), {settings['entries']:,}-entry index",
        document["machine"],
    )
    return figure


def _bars(ax: Any, k: int, count: int, name: str, heights: list[float]) -> Any:
    """Series `name`'s bars, the k-th of `count` side by side in each group, a group per
    height."""
    width = 0.8 / count
    positions = [i + (k - (count - 1) / 2) * width for i in range(len(heights))]
    return ax.bar(positions, heights, width, label=LABELS.get(name, name), color=_colour(name))


def _series(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The figures of every loader of a run, then the limit's."""
    return {**run["loaders"], LIMIT: run["limit"]}


def _config(run: dict[str, Any]) -> tuple[int, int]:
    return run["settings"]["workers"], run["settings"]["batch_size"]


def _size_label(nbytes: float) -> str:
    return f"{nbytes / 2**10:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.3g} MiB"


def throughput_chart(document: dict[str, Any]) -> Any:
    """One subplot per workload (each with its own scale, so that 300 and 300,000
    samples/s are both readable), a group of bars per run, a bar per loader and the
    limit; a loader's bar is labelled with its fraction of the limit."""
    by_preset: dict[str, list[dict[str, Any]]] = {}
    for run in document["runs"]:
        by_preset.setdefault(run["preset"]["name"], []).append(run)
    figure, axes = _subplot_grid(len(by_preset))
    for ax, (name, runs) in zip(axes, by_preset.items()):
        _bar_group(ax, runs)
        ax.set_title(
            f"{name} ({_size_label(runs[0]['preset']['sample_bytes'])} per sample)", fontsize=10
        )
    _finish(
        figure,
        "Throughput: torch DataLoader, shmloader and the transport-free limit "
        "(% = fraction of the limit)",
        document["machine"],
    )
    return figure


def _bar_group(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Side by side for each run of one workload: a bar per loader, then the limit's."""
    names = list(_series(runs[0]))
    for k, name in enumerate(names):
        figs = [_series(run)[name] for run in runs]
        bars = _bars(ax, k, len(names), name, [f["samples_per_s"] for f in figs])
        if name != LIMIT:
            ax.bar_label(bars, [f"{f['fraction_of_limit']:.0%}" for f in figs], fontsize=7)
    ax.set_xticks(
        range(len(runs)),
        [f"{workers_label(w)}\nbatch {b}" for w, b in map(_config, runs)],
        fontsize=8,
    )
    ax.set_ylabel("samples/s")
    ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.margins(y=0.12)  # room for the labels above the tallest bar


def sample_size_chart(runs: list[dict[str, Any]], machine: dict[str, Any]) -> Any:
    """GB/s against sample size, log-log, one subplot per (workers, batch size): where
    per-batch costs dominate GB/s grows with the sample, where bandwidth does it is flat."""
    configs = sorted({_config(r) for r in runs})
    figure, axes = _subplot_grid(len(configs))
    for ax, (workers, batch) in zip(axes, configs):
        points = sorted(
            (r for r in runs if _config(r) == (workers, batch)),
            key=lambda r: r["preset"]["sample_bytes"],
        )
        sizes = [r["preset"]["sample_bytes"] for r in points]
        for name in _series(points[0]):
            ax.plot(
                sizes,
                [_series(r)[name]["gb_per_s"] for r in points],
                marker="o",
                label=LABELS.get(name, name),
                color=_colour(name),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_size_label(s) for s in sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("sample size")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{workers_label(workers)}, batch {batch}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    _finish(figure, "Throughput against sample size (float32 samples, size sweep)", machine)
    return figure


def _subplot_grid(count: int) -> tuple[Any, list[Any]]:
    """A figure with `count` subplots, COLUMNS to a row; the grid's spare cells hidden."""
    columns = min(COLUMNS, count)
    rows = math.ceil(count / columns)
    # At least MIN_WIDTH inches, so that the machine line under the title fits.
    figure = figure_class("a chart")(
        figsize=(max(5.2 * columns, MIN_WIDTH), 3.8 * rows + 1), layout="constrained"
    )
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    return figure, axes[:count]


def _finish(figure: Any, heading: str, machine: dict[str, Any]) -> None:
    """One legend for every subplot (they share their series), and the heading with the
    machine line under it."""
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    figure.suptitle(f"{heading}\n{machine_line(machine)}", fontsize=10)

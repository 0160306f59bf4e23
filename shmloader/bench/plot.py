"""compare's chart (--plot): a panel per figure, torch's bar beside shmloader's, from the
record. matplotlib comes with the bench extra and is imported only here."""

import textwrap
from pathlib import Path
from typing import Any

from .errors import require
from .machine import machine_line
from .verdict import conclusion, title

COLOURS = {"torch": "tab:blue", "shmloader": "tab:orange"}
# (panel title, the figure in a loader's figures, scale, format of the bar labels)
PANELS = [
    ("samples/s (higher is better)", ("samples_per_s",), 1, "{:,.0f}"),
    ("main-process CPU ms per batch", ("cpu_s_per_batch",), 1e3, "{:.2f}"),
    ("time to first batch, s", ("first_batch_s",), 1, "{:.2f}"),
    ("loop waits for data, % of its time", ("wait_fraction",), 100, "{:.0f}%"),
    ("peak memory (PSS), MiB", ("memory", "peak_pss_bytes"), 2**-20, "{:,.0f}"),
]
WRAP = 150  # characters per line of the title
DPI = 110


def figure_class() -> Any:
    """matplotlib's Figure (no pyplot, so no display is needed), or InputError naming the
    bench extra."""
    return require("matplotlib.figure", "--plot").Figure


def write(record: dict[str, Any], path: Path) -> None:
    panels = [
        (heading, keys, scale, template)
        for heading, keys, scale, template in PANELS
        if all(_value(figs, keys) is not None for figs in record["loaders"].values())
    ]
    figure = figure_class()(figsize=(3.2 * len(panels), 4.6), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    names = list(record["loaders"])
    for ax, (heading, keys, scale, template) in zip(axes, panels):
        values = [_value(record["loaders"][name], keys) * scale for name in names]
        bars = ax.bar(names, values, color=[COLOURS.get(name, "tab:gray") for name in names])
        ax.bar_label(bars, [template.format(v) for v in values], fontsize=8)
        ax.set_title(heading, fontsize=9)
        ax.margins(y=0.15)  # room for the labels above the taller bar
    text = [title(record), conclusion(record), machine_line(record["machine"])]
    figure.suptitle(
        "\n".join(line for part in text for line in textwrap.wrap(part, WRAP)), fontsize=8
    )
    figure.savefig(path, dpi=DPI)


def _value(figs: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = figs
    for key in keys:
        value = value.get(key) if value else None
    return value

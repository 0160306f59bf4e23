"""Turning measurements into figures, the terminal table and the JSON record."""

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from shmloader.bench.errors import InputError
from shmloader.bench.figures import figure_at
from shmloader.bench.limit import LIMIT
from shmloader.bench.machine import machine_line
from shmloader.bench.record import (
    head,
    write_json,  # noqa: F401  (the scripts write through report)
)
from shmloader.bench.verdict import aligned, workers_label


def write_with_chart(document: dict, out: Path, draw) -> str:
    """Write the JSON record, then its chart (`draw(document, out)` returns
    the chart's path), which is optional where the JSON is not (matplotlib
    missing): the line that says what was written."""
    write_json(document, out)
    try:
        chart = f", {draw(document, out)}"
    except InputError as error:
        chart = f"; no chart: {error}"
    return f"wrote {out}{chart}"


def new_document(**fields: Any) -> dict[str, Any]:
    """The head of a benchmark's JSON record (when, the command, the machine: see
    shmloader.bench.record), then `fields`; prints the machine line the terminal table
    starts with."""
    document = {**head(sys.argv), **fields}
    print(machine_line(document["machine"]) + "\n")
    return document


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the table: where its figure is in a loader's (or the limit's)
    figures, and whether the ratio rows show it too."""

    heading: str
    path: tuple[str, ...]  # keys, outermost first
    template: str
    scale: float = 1
    ratio: bool = False

    def cell(self, figs: dict[str, Any]) -> str:
        value = figure_at(figs, self.path)
        return "" if value is None else self.template.format(value * self.scale)

    def ratio_cell(self, ratio: dict[str, float]) -> str:
        value = ratio.get(self.path[-1]) if self.ratio else None
        return "" if value is None else f"{value:.2f}x"


_COLUMNS = [
    Column("samples/s", ("samples_per_s",), "{:,.0f}", ratio=True),
    Column("GB/s", ("gb_per_s",), "{:.3g}", ratio=True),
    Column("fraction of limit", ("fraction_of_limit",), "{:.0%}"),
    Column("spread", ("throughput_spread",), "{:.0%}"),
    Column("main CPU ms/batch", ("cpu_s_per_batch",), "{:.2f}", scale=1e3, ratio=True),
    Column("first batch s", ("first_batch_s",), "{:.3f}", ratio=True),
    Column("peak PSS MiB", ("memory", "peak_pss_bytes"), "{:,.0f}", scale=2**-20),
    Column("added MiB", ("memory", "added_pss_bytes"), "{:,.0f}", scale=2**-20, ratio=True),
    Column("growth MiB", ("memory", "growth_pss_bytes"), "{:+,.0f}", scale=2**-20),
]


def table(record: dict[str, Any]) -> str:
    """The terminal table of one run's record: the loaders, the limit, the ratios."""
    p, s = record["preset"], record["settings"]
    title = (
        f"{p['name']}: {p['sample']}, batch {s['batch_size']}, {workers_label(s['workers'])}, "
        f"{s['batches_per_epoch']} batches/epoch, median of {s['reps']} reps"
    )
    figures_rows = [*record["loaders"].items(), (LIMIT, record["limit"])]
    rows = [[name, *(c.cell(figs) for c in _COLUMNS)] for name, figs in figures_rows]
    rows += [[name, *(c.ratio_cell(r) for c in _COLUMNS)] for name, r in record["ratios"].items()]
    lines = [title, *aligned([["loader", *(c.heading for c in _COLUMNS)], *rows])]
    lines.append(
        "ratios: higher is better for samples/s and GB/s; lower for CPU, first batch and memory"
    )
    lines.append(
        "main CPU: the main process's CPU per batch less the consumer's own (reading one element "
        "per tensor); growth: the tree's PSS between epochs, after the last memory epoch less after the second"
    )
    lines.append(
        f"{LIMIT}: the same {workers_label(s['workers'])} fetching the same batches and stacking them "
        "(large plain rows as shmloader copies them, the rest with torch.stack) into shared memory of their "
        "own, with no hand-off"
    )
    check = record["correctness"]
    if check["compared"]:
        lines.append(
            f"equality check: {' and '.join(check['compared'])} yielded the same "
            f"{check['batches']} batches as {check['reference']}"
        )
    return "\n".join(lines)


def summary(records: list[dict[str, Any]]) -> str:
    """One line per run: samples/s of every loader and of the limit, each loader's
    fraction of the limit, and the ratios to torch."""
    loaders = list(records[0]["loaders"])
    ratios = list(records[0]["ratios"])
    header = [
        "workload",
        "workers",
        "batch",
        *(f"{n} samples/s" for n in [*loaders, LIMIT]),
        *(f"{n} of limit" for n in loaders),
        *ratios,
    ]
    rows = [
        [
            r["preset"]["name"],
            str(r["settings"]["workers"]),
            str(r["settings"]["batch_size"]),
            *(f"{f['samples_per_s']:,.0f}" for f in [*r["loaders"].values(), r["limit"]]),
            *(f"{f['fraction_of_limit']:.0%}" for f in r["loaders"].values()),
            *(f"{ratio['samples_per_s']:.2f}x" for ratio in r["ratios"].values()),
        ]
        for r in records
    ]
    return "\n".join(["summary (samples/s, medians)", *aligned([header, *rows])])


# train.py's columns: (heading, key in a condition's row, template, scale).
TRAIN_COLUMNS = [
    ("steps/s", "steps_per_s", "{:.3g}", 1),
    ("samples/s", "samples_per_s", "{:,.0f}", 1),
    ("of ideal", "of_ideal", "{:.0%}", 1),
    ("spread", "spread", "{:.0%}", 1),
    ("in next() ms/step", "next_ms", "{:.2f}", 1),
    ("its CPU ms/step", "next_cpu_ms", "{:.2f}", 1),
    ("main CPU ms/step", "main_cpu_ms", "{:.1f}", 1),
    ("loader MiB", "loader_bytes", "{:,.0f}", 2**-20),
    ("GPU busy", "gpu_busy", "{:.0%}", 1),
]


def _train_cells(row: dict[str, Any]) -> list[str]:
    return [
        "-" if row.get(key) is None else template.format(row[key] * scale)
        for _, key, template, scale in TRAIN_COLUMNS
    ]


def _train_columns(run: dict[str, Any]) -> list[tuple[str, str, str, float]]:
    """The columns a run has figures for (GPU busy only on a GPU)."""
    rows = run["rows"].values()
    return [c for c in TRAIN_COLUMNS if any(row.get(c[1]) is not None for row in rows)]


def train_table(run: dict[str, Any]) -> str:
    """The terminal table of one train.py case: a row per condition."""
    columns = _train_columns(run)
    title = (
        f"{run['case']} ({run['bound']}-bound): {run['description']}; "
        f"{workers_label(run['workers'])}, median of {run['repetitions']} x {run['steps']} steps"
    )
    rows = [
        [name, *(c for c, col in zip(_train_cells(row), TRAIN_COLUMNS) if col in columns)]
        for name, row in run["rows"].items()
    ]
    return "\n".join([title, *aligned([["feeding", *(c[0] for c in columns)], *rows])])


def train_markdown(document: dict[str, Any]) -> list[str]:
    """A train.py document: a row per case and condition."""
    columns = _train_columns(
        {"rows": {k: v for r in document["runs"] for k, v in r["rows"].items()}}
    )
    lines = [f"Cores: {document['cores']}.", ""]
    lines += _head(["case", "feeding", *(c[0] for c in columns)])
    for run in document["runs"]:
        for name, row in run["rows"].items():
            cells = [c for c, col in zip(_train_cells(row), TRAIN_COLUMNS) if col in columns]
            lines.append(_row([f"`{run['case']}`", name, *cells]))
    lines += [""] + [
        f"- `{run['case']}` ({run['bound']}-bound): {run['description']}; batch "
        f"{run['batch_size']}, {workers_label(run['workers'])}, median of "
        f"{run['repetitions']} repetitions of {run['steps']} steps after {run['warmup']}."
        for run in document["runs"]
    ]
    return lines


# The figures section of docs/benchmarks.md, written from the JSON in benchmarks/results/
# (`python benchmarks/report.py`), never by hand. The results folder is not kept by git:
# the section shows whatever runs are there when it is written, and records each file's
# digest, so that tests/unit/test_docs.py can tell whether the page still matches a file it finds.
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- figures: begin. Written by `python benchmarks/report.py` from benchmarks/results/*.json: do not edit. -->"
END = "<!-- figures: end -->"


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _joined(values: list[str]) -> str:
    return " / ".join(values)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _head(cells: list[str]) -> list[str]:
    """A table's heading row and the line under it."""
    return [_row(cells), _row(["---"] * len(cells))]


def _figure(
    figs: dict[str, Any] | None, *path: str, template: str = "{:,.0f}", scale: float = 1
) -> str:
    value = figure_at(figs, path)
    return "-" if value is None else template.format(value * scale)


def throughput_markdown(document: dict[str, Any]) -> list[str]:
    """A bench.py document (throughput.json, full.json): one row per run, the loaders'
    figures side by side (torch first), the limit's and the ratios beside them."""
    runs = document["runs"]
    names = list(runs[0]["loaders"])
    both = _joined(names)
    ratio_names = list(runs[0]["ratios"])
    lines = _head(
        [
            "workload",
            "workers",
            "batch",
            f"samples/s, {both} / limit",
            f"GB/s, {both}",
            *(f"{r} samples/s" for r in ratio_names),
            f"of limit, {both}",
            f"main CPU ms per batch, {both} (whole main process)",
            f"first batch s, {both}",
            f"added MiB, {both}",
            f"growth MiB, {both}",
            f"spread, {both}",
        ]
    )
    for run in runs:
        loaders = [run["loaders"][n] for n in names]
        main_cpu = [
            f"{_figure(f, 'cpu_s_per_batch', template='{:.2f}', scale=1e3)} "
            f"({_figure(f, 'main_cpu_s_per_batch', template='{:.2f}', scale=1e3)})"
            for f in loaders
        ]
        lines.append(
            _row(
                [
                    f"`{run['preset']['name']}`: {run['preset']['sample']}",
                    str(run["settings"]["workers"]),
                    str(run["settings"]["batch_size"]),
                    _joined([_figure(f, "samples_per_s") for f in [*loaders, run["limit"]]]),
                    _joined([_figure(f, "gb_per_s", template="{:.2f}") for f in loaders]),
                    *(
                        f"**{_figure(run['ratios'][r], 'samples_per_s', template='{:.2f}x')}**"
                        for r in ratio_names
                    ),
                    _joined([_figure(f, "fraction_of_limit", template="{:.0%}") for f in loaders]),
                    _joined(main_cpu),
                    _joined([_figure(f, "first_batch_s", template="{:.3f}") for f in loaders]),
                    _joined(
                        [_figure(f, "memory", "added_pss_bytes", scale=2**-20) for f in loaders]
                    ),
                    _joined(
                        [
                            _figure(
                                f, "memory", "growth_pss_bytes", template="{:+,.0f}", scale=2**-20
                            )
                            for f in loaders
                        ]
                    ),
                    _joined([_figure(f, "throughput_spread", template="{:.0%}") for f in loaders]),
                ]
            )
        )
    settings = runs[0]["settings"]
    lines += [
        "",
        f"Median of {settings['reps']} timed epochs of {settings['batches_per_epoch']} batches "
        f"(first run; every run's own in the JSON) after a warm-up epoch; "
        f"{_joined(runs[0]['correctness']['compared']) or 'no loader'} checked equal to "
        f"{runs[0]['correctness']['reference']} on the warm-up epoch.",
    ]
    return lines


def _shm_failure(figs: dict[str, Any]) -> str:
    import re

    message = re.sub(r" for file <[^>]*>", "", figs["failed"])
    message = re.sub(r"^(\w+: )\1+", r"\1", message)  # "RuntimeError: RuntimeError: ..." once
    epoch = figs["failed_in_epoch"]
    return f"fails{'' if epoch is None else f' in epoch {epoch}'} (`{message}`)"


def container_markdown(document: dict[str, Any]) -> list[str]:
    """A bench.py --shm-size document (container.json): each run in a roomy /dev/shm and
    in the small one, one row each."""
    runs = document["runs"]
    names = list(next(iter(runs[0]["conditions"].values())))
    both = _joined(names)
    lines = _head(
        [
            "workload",
            "workers",
            "batch",
            "/dev/shm",
            *(f"{n} samples/s" for n in names),
            "shmloader / torch",
            f"/dev/shm used (peak MiB), {both}",
            f"same batches as torch, {both}",
        ]
    )
    for run in runs:
        for condition, by_loader in run["conditions"].items():
            figs = [by_loader.get(n, {}) for n in names]
            rates = [
                f"{f['samples_per_s']:,.0f}"
                if "samples_per_s" in f
                else _shm_failure(f)
                if "failed" in f
                else "-"
                for f in figs
            ]
            ratio = "-"
            if all("samples_per_s" in by_loader.get(n, {}) for n in ("torch", "shmloader")):
                ratio = f"{by_loader['shmloader']['samples_per_s'] / by_loader['torch']['samples_per_s']:.2f}x"
            shm = "roomy" if condition == "roomy" else f"{condition} (as a container's)"
            lines.append(
                _row(
                    [
                        f"`{run['preset']}`",
                        str(run["workers"]),
                        str(run["batch_size"]),
                        shm,
                        *rates,
                        ratio,
                        _joined([_figure(f, "dev_shm_peak_bytes", scale=2**-20) for f in figs]),
                        _joined(
                            [
                                {True: "yes", False: "NO"}.get(f.get("same_batches_as_torch"), "-")
                                for f in figs
                            ]
                        ),
                    ]
                )
            )
    lines += [
        "",
        f"{runs[0]['epochs']} epochs per loader, a plain persistent loop; samples/s is the median of "
        "the epochs after the first (which starts the workers).",
    ]
    return lines


def _vs(figs: dict[str, Any], reference: dict[str, Any] | None, key: str) -> str:
    """figs[key] over reference[key], in bold; empty without a reference."""
    value, base = figure_at(figs, (key,)), figure_at(reference, (key,))
    return f"**{value / base:.2f}x**" if value is not None and base else ""


def worker_start_markdown(document: dict[str, Any]) -> list[str]:
    """A worker_start.py document: a row per condition (start method, workers, index,
    loader), shmloader's with its ratios to torch's."""
    by_key = {(r["method"], r["workers"], r["index"], r["loader"]): r for r in document["runs"]}
    lines = _head(
        [
            "start method",
            "workers",
            "index",
            "loader",
            "first batch s (spread)",
            "vs torch",
            "first gap s",
            "epoch gap s (spread)",
            "vs torch",
            "steady interval ms",
            "gap / steady",
        ]
    )
    for (method, workers, index, loader), r in by_key.items():
        reference = by_key.get((method, workers, index, "torch")) if loader != "torch" else None

        lines.append(
            _row(
                [
                    method,
                    str(workers),
                    f"`{index}`",
                    loader,
                    f"{_figure(r, 'first_batch_s', template='{:.3f}')} "
                    f"({_figure(r, 'first_batch_spread', template='{:.0%}')})",
                    _vs(r, reference, "first_batch_s"),
                    _figure(r, "first_gap_s", template="{:.3f}"),
                    f"{_figure(r, 'gap_s', template='{:.3f}')} "
                    f"({_figure(r, 'gap_spread', template='{:.0%}')})",
                    _vs(r, reference, "gap_s"),
                    _figure(r, "steady_interval_s", template="{:.1f}", scale=1e3),
                    _figure(r, "gap/steady", template="{:,.1f}x"),
                ]
            )
        )
    s = document["settings"]
    wrong = sum(r.get("epochs_wrong", 0) for r in document["runs"])
    lines += [
        "",
        f"An ImageFolder-style index of {s['entries']:,} (path, class) entries; non-persistent "
        f"loaders, built before the clock starts, {s['batches']} batches of {s['batch_size']} "
        f"an epoch with a {s['step_s'] * 1e3:g} ms step after each; median of {s['reps']} runs "
        f"of {s['epochs']} epochs per condition, conditions alternated. First batch: iter() of "
        "the fresh loader to its first batch; epoch gap: the last batch of an epoch to the "
        "first of the next, over the boundaries from the second epoch's end on (first gap: "
        "the first boundary, before shmloader's spare workers start); spread: (max - min) / "
        "median. "
        + (
            "Every batch was checked against the expected one."
            if not wrong
            else f"**{wrong} epochs yielded batches other than the expected ones.**"
        ),
    ]
    return lines


# What a results file holds, by the shape of its runs; None: not drawn here.
def _kind(document: dict[str, Any]) -> str | None:
    runs = document.get("runs") if isinstance(document, dict) else None
    if not runs or not isinstance(runs, list) or not isinstance(runs[0], dict):
        return None
    if "loaders" in runs[0] and "limit" in runs[0]:
        return "throughput"
    if "conditions" in runs[0]:
        return "container"
    if document.get("benchmark") == "train":
        return "train"
    if document.get("benchmark") == "worker_start":
        return "worker_start"
    return None


_RENDERERS = {
    "throughput": throughput_markdown,
    "container": container_markdown,
    "train": train_markdown,
    "worker_start": worker_start_markdown,
}


def figures_section(results: Path = RESULTS) -> str:
    """The figures section: every JSON file in `results` that this code can draw, in
    name order, each with its command and machine; the others named."""
    lines = [BEGIN, ""]
    skipped = []
    paths = sorted(results.glob("*.json")) if results.is_dir() else []
    for path in paths:
        try:
            document = json.loads(path.read_text())
        except ValueError:
            skipped.append(path.name)
            continue
        kind = _kind(document)
        if kind is None:
            skipped.append(path.name)
            continue
        command = " ".join(["python", *document.get("command", ["?"])])
        lines += [
            f"### `benchmarks/results/{path.name}`",
            "",
            f"<!-- source: {path.name} sha256:{_digest(path)} -->",
            f"`{command}` on {machine_line(document['machine'], commit=False)}.",
            "",
            *_RENDERERS[kind](document),
            "",
        ]
    if not paths:
        lines += [
            "No results in `benchmarks/results/` when this section was written: run a benchmark "
            "(see [Running it](#running-it)), then `python benchmarks/report.py`.",
            "",
        ]
    if skipped:
        lines += [
            "Not drawn here (no table for their kind yet): "
            + ", ".join(f"`benchmarks/results/{name}`" for name in skipped)
            + ".",
            "",
        ]
    lines.append(END)
    return "\n".join(lines)


def replace_section(page: str, section: str) -> str:
    """`page` with the text from BEGIN to END replaced by `section`."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + section + page[end:]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Write the figures section of docs/benchmarks.md from "
        "the JSON files in benchmarks/results/."
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help=f"folder of JSON files (default: {RESULTS})"
    )
    parser.add_argument(
        "--page", type=Path, default=DOCS_PAGE, help=f"the page to rewrite (default: {DOCS_PAGE})"
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if the page is out of date"
    )
    args = parser.parse_args(argv)
    page = args.page.read_text()
    updated = replace_section(page, figures_section(args.results))
    if args.check:
        print(f"{args.page} is {'up to date' if updated == page else 'out of date'}")
        return 0 if updated == page else 1
    args.page.write_text(updated)
    print(f"figures section of {args.page} written from {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

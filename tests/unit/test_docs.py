"""The documentation: every relative link in README.md and docs/*.md resolves (to a file, and
to a heading where it names one), the README stays short and runs CI's test command, every
DataLoader argument is documented in docs/options.md (with its real default) and in the
README's options table, and the benchmark figures in docs/benchmarks.md are what
benchmarks/report.py writes from their JSON.  No loader runs here."""

import importlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

import shmloader
from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
OPTIONS = DOCS / "options.md"
README_MAX_LINES = 200
# What CI runs (.ci/run); the README gives it as one line to copy.
TEST_COMMAND = (
    "python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 numpy "
    '&& pip install -e ".[test,integrations]" && python -m pytest -q tests'
)
PARAMETERS = [
    name for name in inspect.signature(shmloader.DataLoader.__init__).parameters if name != "self"
]


def pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """`text` without fenced code blocks, inline code spans and HTML comments: what is left
    holds the links and the headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (and, for these headings, mkdocs' too)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative(path: Path) -> str:
    return path.resolve().relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", pages(), ids=relative)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page.resolve()
        try:
            name = relative(resolved)
        except ValueError:
            broken.append(f"{target}: outside the repository")
            continue
        if not resolved.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor:
            if resolved.suffix != ".md":
                broken.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(resolved):
                broken.append(f"{target}: {name} has no heading #{anchor}")
    assert not broken, f"{relative(page)}: " + "; ".join(broken)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    )


def test_readme_runs_the_ci_test_command():
    assert TEST_COMMAND in README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    for step in TEST_COMMAND.split(" && ")[2:]:  # after the venv: installs and the test run
        assert step.replace("pip install ", "pip install --quiet ") in ci or step in ci, step


def test_readme_and_docs_hold_no_history():
    """Dated run narratives and commit hashes belong in CHANGELOG.md."""
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        text = prose(page.read_text())
        assert not re.search(r"\bUTC\b", text), f"{relative(page)} gives a UTC time"
        hashes = [
            h
            for h in re.findall(r"\b[0-9a-f]{7,40}\b", text)
            if re.search(r"[a-f]", h) and re.search(r"[0-9]", h)
        ]
        assert not hashes, f"{relative(page)} cites commits {hashes}"


def written(default) -> str:
    """A default as the docs write it: strings in double quotes, the rest as Python's repr."""
    return f'"{default}"' if isinstance(default, str) else repr(default)


def options_entries() -> dict[str, str]:
    """Each argument docs/options.md documents: its table row, or its section's text."""
    text = OPTIONS.read_text()
    entries = {}
    for row in re.findall(r"^\|\s*`(\w+)`\s*\|(.*)$", text, flags=re.M):
        entries[row[0]] = row[1]
    for name, body in re.findall(r"^###\s+`(\w+)`\s*$(.*?)(?=^#|\Z)", text, flags=re.M | re.S):
        entries[name] = body
    return entries


@pytest.mark.parametrize("name", PARAMETERS)
def test_every_argument_is_in_docs_options(name):
    entries = options_entries()
    assert name in entries, f"docs/options.md documents no `{name}` (a table row or a ### heading)"
    default = inspect.signature(shmloader.DataLoader.__init__).parameters[name].default
    entry = entries[name].strip().lstrip("|").strip()
    if default is inspect.Parameter.empty:
        assert entry.startswith("(required)"), (
            f"`{name}` has no default; docs/options.md says {entry[:40]!r}"
        )
    else:
        expected = f"`{written(default)}`"
        assert entry.startswith(expected) or entry.startswith(f"Default {expected}"), (
            f"`{name}` defaults to {expected}; docs/options.md says {entry[:40]!r}"
        )


def readme_options_table() -> str:
    text = README.read_text()
    section = re.search(r"^## Options\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "README.md has no '## Options' section"
    rows = [line for line in section.group(1).splitlines() if line.startswith("|")]
    assert rows, "README.md's Options section has no table"
    return "\n".join(line.split("|")[1] for line in rows)  # the first column


@pytest.mark.parametrize("name", PARAMETERS)
def test_every_argument_is_in_the_readme_options_table(name):
    assert f"`{name}`" in readme_options_table(), f"README.md's options table has no `{name}`"


# The figures section of docs/benchmarks.md and benchmarks/report.py, which writes it.


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("report")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def figures_section(report) -> str:
    page = (DOCS / "benchmarks.md").read_text()
    assert page.count(report.BEGIN) == 1 and page.count(report.END) == 1, (
        "docs/benchmarks.md needs one figures section, between report.py's markers"
    )
    return page[page.index(report.BEGIN) : page.index(report.END) + len(report.END)]


def test_figures_section_is_what_report_writes(report, tmp_path):
    """Where every JSON file the section was written from is here, unchanged, writing it
    again from them gives the same text (so no figure was edited by hand)."""
    section = figures_section(report)
    sources = re.findall(r"<!-- source: (\S+) sha256:([0-9a-f]+) -->", section)
    for name, digest in sources:
        path = report.RESULTS / name
        if not path.exists() or report._digest(path) != digest:
            pytest.skip(f"benchmarks/results/{name} is not the file the figures were written from")
        shutil.copy(path, tmp_path / name)
    assert report.figures_section(tmp_path) == section, (
        "docs/benchmarks.md's figures differ from their JSON: run python benchmarks/report.py"
    )


def bench_document() -> dict:
    """A made-up bench.py document (not measured: only its shape matters here)."""

    def figures(rate):
        return {
            "samples_per_s": rate,
            "gb_per_s": rate / 1e4,
            "throughput_spread": 0.1,
            "fraction_of_limit": rate / 1000,
            "cpu_s_per_batch": 1e-3,
            "main_cpu_s_per_batch": 2e-3,
            "first_batch_s": 0.2,
            "memory": {"added_pss_bytes": 2**21, "growth_pss_bytes": 0},
        }

    return {
        "command": ["benchmarks/bench.py", "--quick"],
        "machine": {
            "cores": 2,
            "cpu_model": "cpu",
            "memory_bytes": 2**30,
            "python": "3.11",
            "torch": "2.13",
            "numpy": "2.4",
            "platform": "Linux",
            "shmloader": "0.1.0",
        },
        "runs": [
            {
                "preset": {"name": "tiny", "sample": "float32 256 + int label"},
                "settings": {"workers": 2, "batch_size": 64, "reps": 3, "batches_per_epoch": 10},
                "loaders": {"torch": figures(100), "shmloader": figures(500)},
                "limit": {"samples_per_s": 1000},
                "ratios": {"shmloader/torch": {"samples_per_s": 5.0}},
                "correctness": {"reference": "torch", "compared": ["shmloader"], "batches": 10},
            }
        ],
    }


def test_report_writes_a_table_for_every_kind_it_knows(report, tmp_path):
    (tmp_path / "throughput.json").write_text(json.dumps(bench_document()))
    (tmp_path / "other.json").write_text(json.dumps({"runs": [{"something": 1}]}))
    section = report.figures_section(tmp_path)
    assert section.startswith(report.BEGIN) and section.endswith(report.END)
    assert "| `tiny`: float32 256 + int label | 2 | 64 | 100 / 500 / 1,000 |" in section
    assert "**5.00x**" in section
    assert "`benchmarks/results/other.json`" in section  # named, not drawn
    header, rule = [line for line in section.splitlines() if line.startswith("|")][:2]
    assert header.count("|") == rule.count("|")
    empty = report.figures_section(tmp_path / "missing")
    assert "No results" in empty
    page = f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n"
    assert report.replace_section(page, section) == f"# x\n\n{section}\n\nafter\n"


def test_report_writes_train_py_documents(report, tmp_path):
    """benchmarks/train.py's JSON (made up here: only its shape matters) gets its table."""

    def row(rate, ideal):
        return {
            "steps_per_s": rate,
            "samples_per_s": rate * 256,
            "of_ideal": rate / ideal,
            "spread": 0.04,
            "next_ms": 0.3,
            "next_cpu_ms": 0.28,
            "main_cpu_ms": 50.0,
            "loader_bytes": 2**28,
        }

    document = bench_document()
    document.update(
        command=["benchmarks/train.py", "--quick"],
        benchmark="train",
        cores="2 cores: the training process on 1, the workers on 1",
        runs=[
            {
                "case": "uint8-224/model",
                "bound": "model",
                "description": "uint8 3x224x224; a ConvNet",
                "batch_size": 256,
                "workers": 2,
                "steps": 12,
                "warmup": 3,
                "repetitions": 3,
                "rows": {"torch": row(15, 19), "shmloader": row(18.8, 19), "ideal": row(19, 19)},
            }
        ],
    )
    (tmp_path / "train.json").write_text(json.dumps(document))
    section = report.figures_section(tmp_path)
    assert "Cores: 2 cores: the training process on 1, the workers on 1." in section
    assert "| `uint8-224/model` | shmloader | 18.8 | 4,813 | 99% | 4% | 0.30 | 0.28 |" in section
    assert "GPU busy" not in section  # no figure for it off a GPU
    header, rule = [line for line in section.splitlines() if line.startswith("|")][:2]
    assert header.count("|") == rule.count("|")


def test_report_writes_worker_start_py_documents(report, tmp_path):
    """benchmarks/worker_start.py's JSON (made up here: only its shape matters) gets its
    table, shmloader's rows with their ratios to torch's."""

    def row(loader, first, gap):
        return {
            "method": "spawn",
            "workers": 2,
            "index": "list",
            "loader": loader,
            "first_batch_s": first,
            "first_batch_spread": 0.1,
            "first_gap_s": 2 * gap,
            "gap_s": gap,
            "gap_spread": 0.2,
            "steady_interval_s": 0.01,
            "gap/steady": gap / 0.01,
            "epochs_wrong": 0,
        }

    document = bench_document()
    document.update(
        command=["benchmarks/worker_start.py", "--quick"],
        benchmark="worker_start",
        settings={
            "entries": 1000,
            "reps": 3,
            "epochs": 3,
            "batches": 20,
            "batch_size": 64,
            "step_s": 0.01,
        },
        runs=[row("torch", 4.0, 4.2), row("shmloader", 1.0, 2.1)],
    )
    (tmp_path / "worker_start.json").write_text(json.dumps(document))
    section = report.figures_section(tmp_path)
    assert (
        "| spawn | 2 | `list` | shmloader | 1.000 (10%) | **0.25x** | 4.200 | 2.100 (20%) | **0.50x** "
        "| 10.0 | 210.0x |" in section
    )
    assert "Every batch was checked" in section
    header, rule = [line for line in section.splitlines() if line.startswith("|")][:2]
    assert header.count("|") == rule.count("|")

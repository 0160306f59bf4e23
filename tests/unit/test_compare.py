"""`python -m shmloader.compare`: the figures it writes, the check of the loaders' batches,
its progress lines, its conclusion, and a clear error with a non-zero exit for every bad
input. No timing is asserted: the figures are checked for being there and consistent.

The datasets and factories below are module-level so that the command can name them
(tests.unit.test_compare:tiny) and the workers can unpickle them. The memory figures and the
chart need the bench extra (psutil, matplotlib) and are skipped without it; everything
else runs with the test extra alone.
"""

import io
import json
import os
import subprocess
import sys
import textwrap
import traceback

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from shmloader import compare
from shmloader.bench import verdict
from shmloader.bench.check import EXACT, STRUCTURE, first_epoch_check
from shmloader.bench.progress import ProgressBar
from tests.helpers import ROOT

# Short runs: two batches per epoch, one timed epoch per loader, no memory epochs.
SHORT = [
    "--num-workers",
    "2",
    "--batch-size",
    "4",
    "--epochs",
    "1",
    "--max-batches",
    "2",
    "--memory-epochs",
    "0",
]


class Tiny(Dataset):
    """Item i: a uint8 image filled with i, and i."""

    def __init__(self, length: int = 40):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return torch.full((3, 8, 8), index % 256, dtype=torch.uint8), index


def tiny(length: int = 40) -> Tiny:
    return Tiny(length)


def as_dict(samples: list) -> dict:
    """A collate_fn of the user's own: a dict batch."""
    return {
        "image": torch.stack([s[0] for s in samples]),
        "index": torch.tensor([s[1] for s in samples]),
    }


def worker_init(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)  # the same in both loaders: the batches stay equal


class SeededAugment(Tiny):
    """A random augmentation drawn from torch's global generator, which both loaders'
    workers seed alike (as torchvision's transforms draw)."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image + torch.randint(0, 8, image.shape, dtype=torch.uint8), label


class UnseededAugment(Tiny):
    """A random augmentation from a source no loader seeds: fresh entropy every call."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        noise = np.random.default_rng().integers(0, 8, image.shape, dtype=np.uint8)
        return image + torch.from_numpy(noise), label


class DiffersInShmloader(Tiny):
    """Another value in shmloader's workers than in torch's: a loader bug, as the check sees it."""

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        in_shmloader = any(
            os.path.join("shmloader", "_worker", "") in frame.filename
            for frame in traceback.extract_stack()
        )
        return image + 1 if in_shmloader else image, label


class FailsLater(Tiny):
    """Fine for the first batch, which the command fetches itself; a worker meets the error."""

    def __getitem__(self, index: int):
        if index >= 4:
            raise OSError(f"cannot read sample {index}")
        return super().__getitem__(index)


class Stream(IterableDataset):
    def __iter__(self):
        return ((torch.zeros(4), i) for i in range(16))


class NoLength(Dataset):
    def __getitem__(self, index: int):
        return torch.zeros(4)


class Corrupt(Tiny):
    def __getitem__(self, index: int):
        raise ValueError(f"corrupt record {index}")


def seeded_augment() -> SeededAugment:
    return SeededAugment()


def unseeded_augment() -> UnseededAugment:
    return UnseededAugment()


def differs_in_shmloader() -> DiffersInShmloader:
    return DiffersInShmloader()


def fails_later() -> FailsLater:
    return FailsLater()


def stream() -> Stream:
    return Stream()


def no_length() -> NoLength:
    return NoLength()


def corrupt() -> Corrupt:
    return Corrupt()


def ragged() -> list:
    return [torch.zeros(i + 1) for i in range(8)]


def names() -> list:
    return [f"file{i}.jpg" for i in range(8)]


def empty() -> list:
    return []


def returns_none() -> None:
    return None


def returns_generator():
    return (torch.zeros(4) for _ in range(8))


def raises() -> Tiny:
    raise FileNotFoundError("/data/train does not exist")


NOT_CALLABLE = 42


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """The command's exit status, stdout and stderr (argparse's errors exit instead)."""
    try:
        status = compare.main(list(argv))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


# ------------------------------------------------------------------------ a real run


def test_a_run_prints_and_writes_every_figure(capsys, tmp_path):
    out_json = tmp_path / "figures.json"
    status, out, err = run(
        capsys,
        "--dataset",
        "tests.unit.test_compare:tiny",
        "--dataset-args",
        '{"length": 40}',
        *SHORT,
        "--shuffle",
        "--persistent-workers",
        "--collate-fn",
        "tests.unit.test_compare:as_dict",
        "--worker-init-fn",
        "tests.unit.test_compare:worker_init",
        "--step-ms",
        "1",
        "--json",
        str(out_json),
    )
    assert status == 0, err
    lines = out.splitlines()
    assert any(line.startswith("torch ") for line in lines) and any(
        line.startswith("shmloader ") for line in lines
    )
    assert any(line.startswith("shmloader/torch ") for line in lines)
    assert "check: shmloader yielded exactly the same 2 batches as torch" in out
    record = json.loads(out_json.read_text())
    assert record["machine"]["torch"] == torch.__version__ and record["machine"]["cores"] >= 1
    assert record["dataset"]["call"] == "tests.unit.test_compare:tiny(length=40)"
    assert record["loader_args"]["collate_fn"] == "tests.unit.test_compare:as_dict"
    assert record["settings"]["batches_per_epoch"] == 2
    assert record["check"] == {
        "mode": EXACT,
        "why": record["check"]["why"],
        "reference": "torch",
        "compared": ["shmloader"],
        "batches": 2,
        "mismatch": None,
    }
    for figures in record["loaders"].values():
        (epoch,) = figures["epochs"]
        assert (epoch["batches"], epoch["samples"]) == (2, 8)
        assert epoch["bytes"] == 8 * (3 * 8 * 8 + 8)  # the images and the int64 indices
        assert 0 < epoch["wait_s"] < epoch["wall_s"]  # the 1 ms steps are not waiting
        assert (
            figures["samples_per_s"] > 0
            and figures["first_batch_s"] > 0
            and 0 < figures["wait_fraction"] < 1
        )
        assert figures["memory"] is None  # --memory-epochs 0
    assert record["loaders"]["shmloader"]["stats"]["batches"] > 0
    ratio = record["ratios"]["shmloader/torch"]
    assert ratio["samples_per_s"] == pytest.approx(
        record["loaders"]["shmloader"]["samples_per_s"]
        / record["loaders"]["torch"]["samples_per_s"]
    )
    assert record["conclusion"] == lines[-2] and record["conclusion"] in out
    assert f"figures written to {out_json}" in out


def test_a_dataset_file_imports_the_modules_beside_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", sys.path[:])  # the command puts the file's folder first
    (tmp_path / "helpers_for_compare.py").write_text("import torch\nSHAPE = (2, 3)\n")
    (tmp_path / "my_data.py").write_text(
        textwrap.dedent("""
        import torch
        from helpers_for_compare import SHAPE

        def make(length):
            return [torch.ones(SHAPE) * i for i in range(length)]
    """)
    )
    status, out, err = run(
        capsys,
        "--dataset",
        f"{tmp_path}/my_data.py:make",
        "--dataset-args",
        '{"length": 16}',
        *SHORT,
    )
    assert status == 0, err
    assert f"on {tmp_path}/my_data.py:make(length=16)" in out
    for name in ("my_data", "helpers_for_compare"):
        monkeypatch.delitem(sys.modules, name)


def test_a_stream_dataset_is_measured(capsys):
    status, out, err = run(capsys, "--dataset", "tests.unit.test_compare:stream", *SHORT)
    assert status == 0, err
    assert "yielded exactly the same 2 batches" in out


def test_memory_figures_with_psutil(capsys, tmp_path):
    pytest.importorskip("psutil")
    out_json = tmp_path / "figures.json"
    status, out, err = run(
        capsys,
        "--dataset",
        "tests.unit.test_compare:tiny",
        *SHORT[:-1],
        "1",
        "--json",
        str(out_json),
    )
    assert status == 0, err
    for figures in json.loads(out_json.read_text())["loaders"].values():
        memory = figures["memory"]
        # RSS counts every page PSS counts (and shared ones more than once).
        assert memory["peak_rss_bytes"] >= memory["peak_pss_bytes"] > 0
        assert len(memory["idle_pss_bytes"]) == 1  # one memory epoch
    assert "peak PSS MiB" in out


def test_plot_draws_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "compare.png"
    status, out, err = run(
        capsys, "--dataset", "tests.unit.test_compare:tiny", *SHORT, "--plot", str(chart)
    )
    assert status == 0, err
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"chart written to {chart}" in out


# ------------------------------------------------------------------------ the check


def test_random_augmentations_the_loaders_seed_are_compared_exactly(capsys):
    status, out, err = run(
        capsys, "--dataset", "tests.unit.test_compare:seeded_augment", *SHORT, "--shuffle"
    )
    assert status == 0, err
    assert "yielded exactly the same 2 batches" in out


def test_unseeded_random_augmentations_are_compared_by_structure(capsys):
    status, out, err = run(capsys, "--dataset", "tests.unit.test_compare:unseeded_augment", *SHORT)
    assert status == 0, err
    assert "match torch's in structure, shapes and dtypes; values not compared" in out
    assert "neither loader seeds" in out


def test_a_mismatch_is_reported_with_a_non_zero_exit(capsys, tmp_path):
    out_json = tmp_path / "figures.json"
    status, out, err = run(
        capsys,
        "--dataset",
        "tests.unit.test_compare:differs_in_shmloader",
        *SHORT,
        "--json",
        str(out_json),
    )
    assert status == 1
    assert (
        "MISMATCH in the first epoch (exact comparison): shmloader batch 0 differs from torch's: "
        "batch[0]: 768 of 768 elements differ" in out
    )
    record = json.loads(out_json.read_text())
    assert record["check"]["mismatch"].startswith("shmloader batch 0 differs")
    assert "these figures compare different work" in record["conclusion"]


def test_check_structure_forgives_values_not_shapes():
    reference = [(torch.zeros(2, 3), 1), (torch.zeros(2, 3), 2)]
    values_differ = [(torch.ones(2, 3), 1), (torch.ones(2, 3), 2)]
    shape_differs = [(torch.ones(2, 3), 1), (torch.ones(2, 4), 2)]
    assert first_epoch_check({"a": reference, "b": values_differ}, STRUCTURE).mismatch is None
    assert (
        first_epoch_check({"a": reference, "b": values_differ}, EXACT).mismatch
        == "b batch 0 differs from a's: batch[0]: 6 of 6 elements differ"
    )
    check = first_epoch_check({"a": reference, "b": shape_differs}, STRUCTURE)
    assert (check.batches, check.mismatch) == (
        1,
        "b batch 1 differs from a's: batch[0]: torch.float32 (2, 4) where the reference has torch.float32 (2, 3)",
    )


def test_check_reports_a_loader_that_ends_early():
    batches = [torch.zeros(2)] * 3
    check = first_epoch_check({"a": batches, "b": batches[:2]})
    assert check.mismatch == "b ended after 2 batches while the other loaders went on"


def test_check_counts_nan_as_equal_to_nan():
    batch = torch.tensor([1.0, float("nan")])
    assert first_epoch_check({"a": [batch], "b": [batch.clone()]}).mismatch is None


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--dataset", "no_such_package.data:make"],
            "no module named 'no_such_package.data' can be imported",
        ),
        (["--dataset", "tests/no_such_file.py:make"], "there is no file 'tests/no_such_file.py'"),
        (
            ["--dataset", "tests/c/ring_stress.c:make"],
            "--dataset: tests/c/ring_stress.c cannot be imported: name a .py file",
        ),
        (
            ["--dataset", "tests.unit.test_compare"],
            "names no callable: write package.module:callable or path/to/file.py",
        ),
        (
            ["--dataset", "tests.unit.test_compare:nope"],
            "tests.unit.test_compare has no attribute 'nope'; its callables are:",
        ),
        (
            ["--dataset", "tests.unit.test_compare:NOT_CALLABLE"],
            "'tests.unit.test_compare:NOT_CALLABLE' is int 42, not a callable",
        ),
        (
            ["--dataset", "tests.unit.test_compare:raises"],
            "tests.unit.test_compare:raises() raised FileNotFoundError: /data/train does not exist",
        ),
        (
            ["--dataset", "tests.unit.test_compare:tiny", "--dataset-args", '{"size": 3}'],
            "raised TypeError: tiny() got an unexpected keyword argument 'size' (check --dataset-args)",
        ),
        (
            ["--dataset", "tests.unit.test_compare:tiny", "--dataset-args", "{length: 3}"],
            "--dataset-args is not JSON",
        ),
        (
            ["--dataset", "tests.unit.test_compare:tiny", "--dataset-args", "[3]"],
            "--dataset-args is a JSON list, not an object of keyword arguments",
        ),
        (
            ["--dataset", "tests.unit.test_compare:returns_none"],
            "returned NoneType None, not a Dataset",
        ),
        (
            ["--dataset", "tests.unit.test_compare:returns_generator"],
            "not a Dataset (an iterator: return an IterableDataset whose __iter__ yields its samples)",
        ),
        (
            ["--dataset", "tests.unit.test_compare:stream", "--shuffle"],
            "--shuffle needs a map-style dataset (samples fetched by index, which a sampler shuffles), but the factory "
            "returned an IterableDataset (Stream)",
        ),
        (
            ["--dataset", "tests.unit.test_compare:no_length"],
            "the dataset (NoLength) has no length",
        ),
        (["--dataset", "tests.unit.test_compare:empty"], "the dataset (list) is empty (len 0)"),
        (
            ["--dataset", "tests.unit.test_compare:corrupt"],
            "fetching the first 4 samples in this process raised ValueError: corrupt record 0",
        ),
        (
            ["--dataset", "tests.unit.test_compare:ragged"],
            "the dataset's samples cannot be batched: torch's default_collate raised RuntimeError on the first 4: "
            "stack expects each tensor to be equal size",
        ),
        (
            [
                "--dataset",
                "tests.unit.test_compare:tiny",
                "--collate-fn",
                "tests.unit.test_compare:names",
            ],
            "--collate-fn raised TypeError on the first 4",
        ),
        (
            ["--dataset", "tests.unit.test_compare:names"],
            "the batches hold no tensor or numpy array",
        ),
        (
            [
                "--dataset",
                "tests.unit.test_compare:tiny",
                "--worker-init-fn",
                "tests.unit.test_compare:missing",
            ],
            "--worker-init-fn 'tests.unit.test_compare:missing': tests.unit.test_compare has no attribute 'missing'",
        ),
    ],
)
def test_bad_input_is_named_with_what_to_do(capsys, argv, message):
    status, out, err = run(capsys, *SHORT, *argv)
    assert status == 2
    assert message in err
    assert "torch DataLoader vs shmloader" not in out  # stopped before measuring


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num-workers", "0"],
            "--num-workers 0 makes both loaders torch's own single-process loader",
        ),
        (["--batch-size", "0"], "argument --batch-size: 0 is less than 1"),
        (["--step-ms", "fast"], "argument --step-ms: 'fast' is not a number"),
        (["--plot", "chart.jpg2"], "--plot chart.jpg2: name a file ending in .png, .svg, .pdf"),
    ],
)
def test_bad_options_exit_2_with_argparse_usage(capsys, argv, message):
    status, out, err = run(capsys, "--dataset", "tests.unit.test_compare:tiny", *SHORT, *argv)
    assert status == 2
    assert message in err and "usage: shmloader-compare" in err


def test_a_traceback_shows_where_the_users_code_failed(capsys):
    status, out, err = run(capsys, *SHORT, "--dataset", "tests.unit.test_compare:corrupt")
    assert status == 2
    assert 'test_compare.py", line' in err and "in __getitem__" in err
    assert "shmloader/bench" not in err  # the command's own frames are left out


def test_a_loader_that_fails_mid_run_exits_1(capsys):
    status, out, err = run(
        capsys,
        "--dataset",
        "tests.unit.test_compare:fails_later",
        *SHORT[:-4],
        "--max-batches",
        "4",
        "--memory-epochs",
        "0",
        "--batch-size",
        "2",
    )
    assert status == 1
    assert "shmloader-compare: a loader failed while measuring: OSError: " in err
    assert "cannot read sample 4" in err


@pytest.mark.parametrize(
    "module, argv",
    [
        ("matplotlib", ["--plot", "chart.png"]),
        ("psutil", ["--memory-epochs", "1"]),
    ],
)
def test_a_missing_extra_names_the_install_command(capsys, monkeypatch, module, argv):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when it is not installed
    status, out, err = run(capsys, "--dataset", "tests.unit.test_compare:tiny", *SHORT, *argv)
    assert status == 2
    assert (
        f"needs {module}, which cannot be imported" in err
        and 'pip install "shmloader[bench]"' in err
    )


def test_the_package_imports_without_the_bench_extra():
    blocked = "import sys; sys.modules.update(psutil=None, matplotlib=None, PIL=None)"
    code = (
        f"{blocked}; import shmloader, shmloader.compare, shmloader.bench.memory, shmloader.bench.plot; "
        "assert shmloader.bench.memory.psutil is None; print('imported')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


# ------------------------------------------------------------------------ progress and conclusion


class Terminal:
    """A stream that says it is a terminal, keeping what is written to it."""

    def __init__(self):
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_bar_on_a_terminal_redraws_one_line_with_rate_and_eta():
    terminal, clock = Terminal(), Clock()
    bar = ProgressBar(total=100, stream=terminal, clock=clock)
    bar("torch: timed epoch 1/3")
    for _ in range(25):
        clock.now += 0.4  # a batch every 0.4 s: each one redraws the line
        bar.tick()
    assert "\n" not in terminal.text and terminal.text.endswith("\r")
    last = terminal.text.rstrip("\r").split("\r")[-1].rstrip()
    assert (
        last
        == f"[{'#' * 6}{'.' * 18}]  25%  torch: timed epoch 1/3  25 of 100 batches  2.5 batches/s  ETA 0:30"
    )


def test_progress_without_a_terminal_writes_a_plain_line_per_step():
    stream, clock = io.StringIO(), Clock()
    bar = ProgressBar(total=None, stream=stream, clock=clock)
    bar("torch: first epoch")
    clock.now += 2
    for _ in range(10):
        bar.tick()
    bar("torch: timed epoch 1/1")
    assert (
        stream.getvalue()
        == "torch: first epoch  0 batches\ntorch: timed epoch 1/1  10 batches  5.0 batches/s\n"
    )


def record_with(
    torch_rate: float,
    shm_rate: float,
    torch_wait: float,
    shm_wait: float,
    torch_cpu_ms: float = 2.0,
    shm_cpu_ms: float = 0.5,
    spread: float = 0.01,
) -> dict:
    def figures(rate, wait, cpu_ms):
        return {
            "samples_per_s": rate,
            "throughput_spread": spread,
            "wait_fraction": wait,
            "cpu_s_per_batch": cpu_ms / 1e3,
        }

    return {
        "loaders": {
            "torch": figures(torch_rate, torch_wait, torch_cpu_ms),
            "shmloader": figures(shm_rate, shm_wait, shm_cpu_ms),
        },
        "check": {"mismatch": None},
    }


def test_conclusion_of_a_data_bound_loop_that_shmloader_unblocks():
    assert verdict.conclusion(record_with(1000, 2600, 0.62, 0.04)) == (
        "your loop waits for data 62% of the time with torch, 4% with shmloader: shmloader delivers 2.60x "
        "torch's samples/s and saves 1.50 ms of main-process CPU per batch."
    )


def test_conclusion_of_a_loop_data_bound_with_both_loaders():
    assert verdict.conclusion(record_with(1000, 1300, 0.99, 0.98)) == (
        "shmloader delivers 1.30x torch's samples/s and saves 1.50 ms of main-process CPU per batch (your loop "
        "waits for data 99% of the time with torch, 98% with shmloader)."
    )


def test_conclusion_of_a_pipeline_bound_by_the_dataset():
    assert verdict.conclusion(record_with(1000, 1020, 0.97, 0.96)) == (
        "your pipeline is bound by the dataset's own work (fetching and transforming samples in the workers): "
        "both loaders are within 2% of each other's samples/s (the epochs' own spread: 3%), and shmloader saves "
        "1.50 ms of main-process CPU per batch."
    )


def test_conclusion_of_a_pipeline_bound_by_the_training_step():
    sentence = verdict.conclusion(
        record_with(1000, 990, 0.03, 0.01, torch_cpu_ms=0.4, shm_cpu_ms=0.6, spread=0.05)
    )
    assert sentence == (
        "your pipeline is bound by your training step (your loop waits for data 3% of the time with torch, 1% "
        "with shmloader): both loaders are within 1% of each other's samples/s (the epochs' own spread: 5%), and "
        "shmloader costs 0.20 ms more main-process CPU per batch."
    )


def test_conclusion_says_when_shmloader_is_slower():
    assert verdict.conclusion(record_with(1000, 800, 0.5, 0.6)).startswith(
        "shmloader is slower on your pipeline, 0.80x torch's samples/s"
    )

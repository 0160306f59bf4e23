"""torch's DataLoader and shmloader where most training runs: a container whose /dev/shm is
small (Docker's and Kubernetes' default is 64 MB), against the same loaders with this
machine's roomy /dev/shm, in one run.

    python benchmarks/bench.py --shm-size 64m [--preset uint8-224] [--batch-size 256 64]

Each (loader, /dev/shm) pair runs in a process of its own, in a private mount namespace
(`unshare -m`, as root) whose /dev/shm is a tmpfs of its own: the small one as a container
gets it, the roomy one of tmpfs's default size (half the memory), so that what a loader's
processes use of /dev/shm is theirs alone, not the rest of the machine's. A loader runs a plain persistent loop over a few epochs, as a user's would;
its throughput is the median of the epochs after the first (which starts the workers), and
a thread samples how much of /dev/shm its process tree uses. A loader that fails is
reported with its error, not left out. The first epoch's batches of every run are checked
against torch's in the roomy /dev/shm.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import report
import torch
from workloads import PRESETS

from shmloader.bench.check import first_difference

HERE = Path(__file__).resolve().parent
# Epochs per loader (full run, --quick): the first starts the workers, the rest are timed.
EPOCHS = (4, 3)
SHM_SAMPLE_INTERVAL_S = 0.005
ROOMY = "roomy"
# One loader's run, its epochs and its workers' start: a few tens of seconds here, when it
# does not hang.
RUN_LIMIT_S = 300


class ShmUse:
    """The most of /dev/shm in use while it runs, sampled by a thread (what was in use
    when it started is left out)."""

    def __init__(self):
        self.base = self._used()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> int:
        st = os.statvfs("/dev/shm")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _sample(self) -> None:
        while not self._stop.wait(SHM_SAMPLE_INTERVAL_S):
            self.peak = max(self.peak, self._used() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._used() - self.base)


def _loader_class(name: str) -> type:
    if name == "torch":
        return torch.utils.data.DataLoader
    from shmloader import DataLoader

    return DataLoader


def _first_epoch_digest(batch) -> list:
    """Enough of a batch to compare it across processes: every tensor leaf's sum."""
    from shmloader.bench.measure import tensor_leaves

    return [float(t.double().sum()) for _, t in tensor_leaves(batch)]


def child(args: dict[str, Any]) -> dict[str, Any]:
    """One loader's epochs in this process (and its /dev/shm), as a JSON-able record."""
    preset = PRESETS[args["preset"]]
    scratch = Path(args["scratch"])
    dataset = preset.make_dataset(args["batches"] * args["batch_size"], scratch)
    loader = _loader_class(args["loader"])(
        dataset, batch_size=args["batch_size"], num_workers=args["workers"], persistent_workers=True
    )
    shm = ShmUse()
    epochs, digest = [], []
    try:
        for epoch in range(args["epochs"]):
            samples, start = 0, time.perf_counter()
            for batch in loader:
                if epoch == 0:
                    digest.append(_first_epoch_digest(batch))
                samples += (
                    len(batch[-1]) if isinstance(batch, (list, tuple)) else args["batch_size"]
                )
                del batch
            epochs.append({"samples": samples, "wall_s": time.perf_counter() - start})
    except Exception as error:
        record = {
            "failed": f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}",
            "failed_in_epoch": len(epochs),
        }
    else:
        record = {}
    st = os.statvfs("/dev/shm")
    record.update(
        epochs=epochs,
        dev_shm_peak_bytes=shm.stop(),
        digest=digest,
        dev_shm_bytes=st.f_blocks * st.f_frsize,
    )
    if hasattr(loader, "stats"):
        stats = loader.stats()
        record["ring_memory"] = stats.ring_memory
        record["outside_ring_batches"] = (
            stats.unsized_batches + stats.ring_full_batches + stats.spilled_batches
        )
    return record


def _run_child(args: dict[str, Any], shm_size: str) -> dict[str, Any]:
    size = "" if shm_size == ROOMY else f"-o size={shm_size} "
    command = [
        "unshare",
        "-m",
        "sh",
        "-c",
        f'mount -t tmpfs {size}tmpfs /dev/shm && exec "$0" "$@"',
        sys.executable,
        str(HERE / "container.py"),
        json.dumps(args),
    ]
    # A session of its own: a loader that hangs (torch's can, when /dev/shm is full) is
    # killed with its workers and reported as failing, and the runs after it still run.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return _failure(f"hung: no end within {RUN_LIMIT_S} s (killed with its workers)")
    if process.returncode != 0:
        lines = stderr.strip().splitlines() or [f"exit code {process.returncode}"]
        return _failure(lines[-1])
    return json.loads(stdout.strip().splitlines()[-1])


def _failure(why: str) -> dict[str, Any]:
    return {
        "failed": why,
        "failed_in_epoch": None,
        "epochs": [],
        "dev_shm_peak_bytes": None,
        "digest": [],
    }


def _figures(record: dict[str, Any], sample_bytes: int) -> dict[str, Any]:
    timed = record["epochs"][1:]
    if not timed:
        return record
    rate = statistics.median(e["samples"] / e["wall_s"] for e in timed)
    return {**record, "samples_per_s": rate, "gb_per_s": rate * sample_bytes / 1e9}


def check_namespace(shm_size: str) -> None:
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        sys.exit(
            f"--shm-size needs `unshare -m` and mount (root) for a private /dev/shm: "
            f"{probe.stderr.strip()}"
        )


def measure(
    preset_name: str,
    workers: int,
    batch_size: int,
    shm_size: str,
    quick: bool,
    scratch: str,
    progress,
) -> dict[str, Any]:
    """Both loaders with a roomy and with a small /dev/shm: the run's JSON record."""
    preset = PRESETS[preset_name]
    batches = preset.quick_batches if quick else preset.batches
    args = dict(
        preset=preset_name,
        workers=workers,
        batch_size=batch_size,
        batches=batches,
        epochs=EPOCHS[quick],
        scratch=scratch,
    )
    conditions = {}
    for condition in (ROOMY, shm_size):
        for loader in ("torch", "shmloader"):
            progress(f"{loader}, /dev/shm {condition}")
            record = _run_child({**args, "loader": loader}, condition)
            conditions.setdefault(condition, {})[loader] = _figures(record, preset.sample_bytes)
    reference = conditions[ROOMY]["torch"]["digest"]
    for by_loader in conditions.values():
        for record in by_loader.values():
            digest = record.pop("digest")
            if digest and reference and "failed" not in record:
                difference = first_difference(reference, digest, "first epoch")
                record["same_batches_as_torch"] = difference is None
                if difference is not None:
                    record["difference"] = difference
    return {
        "preset": preset_name,
        "sample_bytes": preset.sample_bytes,
        "workers": workers,
        "batch_size": batch_size,
        "batches_per_epoch": batches,
        "epochs": EPOCHS[quick],
        "shm_size": shm_size,
        "conditions": conditions,
    }


def table(record: dict[str, Any]) -> str:
    def rate(r):
        if "failed" in r:
            epoch = r["failed_in_epoch"]
            return f"FAILED{'' if epoch is None else f' in epoch {epoch}'}: {r['failed'][:70]}"
        return f"{r['samples_per_s']:,.0f} samples/s, {r['gb_per_s']:.2f} GB/s"

    def shm(r):
        return (
            "-"
            if r.get("dev_shm_peak_bytes") is None
            else f"{r['dev_shm_peak_bytes'] / 1e6:.1f} MB"
        )

    small, roomy = record["conditions"][record["shm_size"]], record["conditions"][ROOMY]
    rows = [["/dev/shm", "loader", "throughput", "/dev/shm used (peak)", "same batches"]]
    for condition, by_loader in ((ROOMY, roomy), (record["shm_size"], small)):
        for name, r in by_loader.items():
            rows.append(
                [
                    condition,
                    name,
                    rate(r),
                    shm(r),
                    {True: "yes", False: "NO"}.get(r.get("same_batches_as_torch"), "-"),
                ]
            )
    lines = [
        f"{record['preset']}, {report.workers_label(record['workers'])}, "
        f"batch {record['batch_size']}, {record['epochs']} epochs",
        *report.aligned(rows),
    ]
    ratios = []
    s_small, s_roomy, t_small = small["shmloader"], roomy["shmloader"], small["torch"]
    if "samples_per_s" in s_small and "samples_per_s" in s_roomy:
        ratios.append(
            f"shmloader in {record['shm_size']} / roomy: "
            f"{s_small['samples_per_s'] / s_roomy['samples_per_s']:.2f}x"
        )
    if "samples_per_s" in s_small and "samples_per_s" in t_small:
        ratios.append(
            f"shmloader / torch in {record['shm_size']}: "
            f"{s_small['samples_per_s'] / t_small['samples_per_s']:.2f}x"
        )
    return "\n".join(lines + ratios)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))

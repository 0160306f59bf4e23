"""What resumability costs: state_dict() latency, and the per-batch price of the worker
state every batch carries (see shmloader/_features/_resume.py).

    python benchmarks/resume_cost.py [--quick]

state_dict() is called after every batch of a real epoch of each preset (2 persistent
workers, after a warm-up epoch), as a loop that checkpoints every step would; its latency
is the median and worst of those calls. The per-batch price has two parts, both timed in
this process: a worker taking its state after each batch (worker_snapshot, RNG states of
random, numpy and torch), set against the time a worker spends on one batch in the same
run (its busy time in loader.stats()); and the main process
recording a yielded batch. The figures go to results/resume_cost.json.
"""

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import report
import torch
from workloads import PRESETS

import shmloader
from shmloader._features._resume_progress import Progress
from shmloader._worker._state import worker_snapshot

DEFAULT_OUT = report.RESULTS / "resume_cost.json"
WORKERS = 2


def per_call_us(fn, calls: int) -> float:
    """Median over 5 rounds of the mean time of one call, in microseconds."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def epoch_with_states(preset, batches: int) -> dict:
    dataset = preset.make_dataset(batches * preset.batch_size, Path("."))
    loader = shmloader.DataLoader(
        dataset,
        batch_size=preset.batch_size,
        shuffle=True,
        num_workers=WORKERS,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    for _ in loader:  # a warm-up epoch: the ring is sized, the workers have it
        pass
    busy_before = sum(w.busy_seconds for w in loader.stats().workers)
    latencies = []
    for _ in loader:
        t = time.perf_counter()
        state = loader.state_dict()
        latencies.append(time.perf_counter() - t)
    busy = sum(w.busy_seconds for w in loader.stats().workers) - busy_before
    saved = io.BytesIO()
    torch.save(state, saved)
    return {
        "batches": len(latencies),
        "state_dict_median_us": statistics.median(latencies) * 1e6,
        "state_dict_max_us": max(latencies) * 1e6,
        "state_bytes": saved.getbuffer().nbytes,
        # The workers' own time per batch (fetching, collating, writing it), from stats().
        "worker_ms_per_batch": busy / len(latencies) * 1e3,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches per preset")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    document = report.new_document()
    snapshot_us = per_call_us(lambda: worker_snapshot(None), 200)
    progress = Progress(worker_states=[None] * WORKERS)
    counter = iter(range(10**9))
    record_us = per_call_us(lambda: progress.batch_yielded(next(counter), 0, b"state"), 20000)
    rows = {}
    for name in ("uint8-224", "tiny", "f32-512"):
        preset = PRESETS[name]
        print(f"{name}: an epoch with state_dict() after every batch ...", file=sys.stderr)
        figures = epoch_with_states(preset, preset.quick_batches if args.quick else preset.batches)
        figures["snapshot_share"] = snapshot_us / 1e3 / figures["worker_ms_per_batch"]
        rows[name] = figures
    print(
        f"worker state per batch (worker_snapshot): {snapshot_us:.1f} us; main process "
        f"recording a yielded batch: {record_us:.2f} us\n"
    )
    print(
        f"{'preset':<12}{'batches':>8}{'state_dict median':>19}{'max':>10}{'state size':>12}"
        f"{'worker ms/batch':>17}{'snapshot share':>16}"
    )
    for name, f in rows.items():
        print(
            f"{name:<12}{f['batches']:>8}{f['state_dict_median_us']:>16.1f} us"
            f"{f['state_dict_max_us']:>7.0f} us{f['state_bytes']:>10} B"
            f"{f['worker_ms_per_batch']:>17.2f}{f['snapshot_share']:>16.2%}"
        )
    document.update(worker_snapshot_us=snapshot_us, record_batch_us=record_us, presets=rows)
    report.write_json(document, args.out)
    print(f"\nfigures written to {args.out}")


if __name__ == "__main__":
    main()

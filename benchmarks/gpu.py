"""Host-to-device: torch's DataLoader with pin_memory=True against shmloader's pinned ring
and shmloader's device="cuda", on uint8-224 and f32-512, 2 workers. Needs CUDA; without it
the script says so and measures nothing.

    python benchmarks/gpu.py [--quick]

Each loader's epoch ends with its batches on the GPU (torch and shmloader pin_memory: the
loop copies with non_blocking=True, as training code does; device="cuda": the loader
does). Figures: samples/s, GB/s to the device, main-process CPU per batch (its threads
included: torch pins in a thread of the main process), and the GB/s of a plain pinned
copy of one batch (cudaMemcpy from page-locked memory) as the ceiling. Epochs alternate
between loaders; figures are medians. Results go to results/gpu.json.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import report
import torch
import torch.utils.data
from workloads import PRESETS

import shmloader

DEFAULT_OUT = report.RESULTS / "gpu.json"
WORKERS = 2
REPS = (5, 3)  # (full, --quick) timed epochs per loader


def loaders(dataset, batch_size):
    common = dict(batch_size=batch_size, num_workers=WORKERS, persistent_workers=True)
    return {
        "torch pin_memory": (torch.utils.data.DataLoader(dataset, pin_memory=True, **common), True),
        "shmloader pin_memory": (shmloader.DataLoader(dataset, pin_memory=True, **common), True),
        "shmloader device=cuda": (shmloader.DataLoader(dataset, device="cuda", **common), False),
    }


def epoch(loader, copy: bool) -> dict:
    samples = nbytes = batches = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in loader:
        images = batch[0].to("cuda", non_blocking=True) if copy else batch[0]
        samples += images.shape[0]
        nbytes += images.nbytes
        batches += 1
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "samples_per_s": samples / wall,
        "gb_per_s": nbytes / wall / 1e9,
        "cpu_ms_per_batch": cpu / batches * 1e3,
    }


def pinned_copy_gb_per_s(batch_bytes: int) -> float:
    host = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(batch_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 20 * batch_bytes / (time.perf_counter() - start) / 1e9


def measure(name: str, quick: bool) -> dict:
    preset = PRESETS[name]
    batches = preset.quick_batches if quick else preset.batches
    dataset = preset.make_dataset(batches * preset.batch_size, Path("."))
    runs = loaders(dataset, preset.batch_size)
    for loader, copy in runs.values():  # warm-up: workers, ring sizing, CUDA context
        epoch(loader, copy)
    results = {label: [] for label in runs}
    for _ in range(REPS[quick]):
        for label, (loader, copy) in runs.items():
            results[label].append(epoch(loader, copy))
    figures = {
        label: {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        for label, reps in results.items()
    }
    ceiling = pinned_copy_gb_per_s(preset.batch_size * preset.sample_bytes)
    for f in figures.values():
        f["fraction_of_pinned_copy"] = f["gb_per_s"] / ceiling
        f["vs_torch"] = f["samples_per_s"] / figures["torch pin_memory"]["samples_per_s"]
    return {"pinned_copy_gb_per_s": ceiling, "loaders": figures}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available here: nothing to measure (this benchmark needs a GPU).")
        return
    print(f"GPU: {torch.cuda.get_device_name()}")
    document = report.new_document(gpu=torch.cuda.get_device_name(), presets={})
    for name in ("uint8-224", "f32-512"):
        print(f"{name} ...", file=sys.stderr)
        record = document["presets"][name] = measure(name, args.quick)
        print(f"{name}: plain pinned copy {record['pinned_copy_gb_per_s']:.1f} GB/s")
        for label, f in record["loaders"].items():
            print(
                f"  {label:<24}{f['samples_per_s']:>10,.0f} samples/s {f['gb_per_s']:>6.1f} GB/s "
                f"({f['fraction_of_pinned_copy']:.0%} of pinned copy)  {f['vs_torch']:.2f}x torch  "
                f"main CPU {f['cpu_ms_per_batch']:.2f} ms/batch"
            )
    report.write_json(document, args.out)
    print(f"\nfigures written to {args.out}")


if __name__ == "__main__":
    main()

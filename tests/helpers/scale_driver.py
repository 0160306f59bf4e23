"""Many workers, or many loaders, in a process of their own under a low open-files limit
(tests/robustness/test_scale.py runs it).  `python -m tests.helpers.scale_driver KIND
METHOD SOFT`, from the repository's root:

- KIND `workers:N`: one loader of N workers (prefetch_factor=4, shuffled by a seeded
  generator) runs an epoch through shmloader and through torch's DataLoader alike;
- KIND `loaders`: 8 loaders (train and val over four datasets, 2-4 workers each) alive at
  once, their epochs interleaved batch by batch, each against torch's.

under RLIMIT_NOFILE soft limit SOFT, start method METHOD.  Prints one line `RESULT {...}`
(a dict: whether each output equals torch's, the loaders' workers and the processes and
open files left once they are gone, the seconds each part took); exits 0 unless something
raised.
"""

import gc
import os
import resource
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader as TorchLoader

from shmloader import DataLoader
from tests.helpers.datasets import WhoMap, canon
from tests.helpers.procs import describe_stuck, open_fds, wait_gone

# Batches per worker in the one-loader run: every worker fetches some, most of the time
# asleep (a tiny dataset on a loaded 2-core machine).
BATCHES_PER_WORKER = 3
# torch's batches do not depend on its start method (tests/equivalence checks each against
# shmloader's); its workers under spawn or forkserver each import torch anew, a minute and
# a half for 64 of them here, so its twin runs fork.
TORCH_METHOD = "fork"
LEFT_LIMIT_S = 30.0


def _options(method: str, workers: int, seed: int) -> dict:
    return dict(
        batch_size=1,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        prefetch_factor=4,
        multiprocessing_context=method,
    )


SERVER = b"from multiprocessing.forkserver import main"


def descendants() -> list[int]:
    """This process's live descendants, less the start methods' helpers (a forkserver, the
    resource tracker) but not their children: a forkserver's workers are its children,
    and carry its command line."""
    parent_of, cmdline = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline[int(pid)] = f.read()
        except OSError:
            continue
        if fields[0] != "Z":
            parent_of[int(pid)] = int(fields[1])

    def helper(pid):
        server = SERVER in cmdline.get(pid, b"")
        forked = SERVER in cmdline.get(parent_of.get(pid, 0), b"")
        return (server and not forked) or b"resource_tracker" in cmdline.get(pid, b"")

    found, frontier = [], {os.getpid()}
    while frontier:
        children = {p for p, parent in parent_of.items() if parent in frontier}
        found += sorted(p for p in children if not helper(p))
        frontier = children
    return found


def _gone(loaders) -> tuple[list[int], float]:
    """Drop `loaders` (a list, emptied) and wait for their workers to be gone: the
    workers left after LEFT_LIMIT_S (spare and idle workers exit in their own time)."""
    pids = set(descendants())
    loaders.clear()
    gc.collect()
    left, waited = wait_gone(pids, LEFT_LIMIT_S)
    if left:  # what they are doing, for the failure's message
        print(describe_stuck(left), file=sys.stderr, flush=True)
    return left, waited


def one_loader(method: str, workers: int) -> dict:
    dataset = WhoMap(BATCHES_PER_WORKER * workers)
    start = time.monotonic()
    loaders = [DataLoader(dataset, **_options(method, workers, 7))]
    got, peak_fds, peak_workers = [], 0, 0
    for batch in loaders[0]:
        got.append(canon(batch))
        peak_fds, peak_workers = max(peak_fds, open_fds()), max(peak_workers, len(descendants()))
    shm_s = time.monotonic() - start
    left, waited = _gone(loaders)
    fds_left = open_fds()
    start = time.monotonic()
    want = [canon(b) for b in TorchLoader(dataset, **_options(TORCH_METHOD, workers, 7))]
    torch_s = time.monotonic() - start
    return dict(
        same=got == want,
        batches=len(got),
        fds_left=fds_left,
        wids=len({dict(b[1])["wid"] for b in got}),
        peak_fds=peak_fds,
        peak_workers=peak_workers,
        left=left,
        waited_s=waited,
        shm_s=round(shm_s, 1),
        torch_s=round(torch_s, 1),
    )


# (name, samples, num_workers of its train loader, of its val loader)
DATASETS = [("a", 24, 4, 2), ("b", 18, 3, 2), ("c", 12, 2, 2), ("d", 30, 4, 3)]


def eight_loaders(method: str) -> dict:
    """Train and val loaders over four datasets, all alive at once, taking a batch from
    each in turn (as a loop that validates between training steps over several
    datasets), two epochs; each loader's batches against its twin of torch's."""
    specs = []
    for k, (name, n, train_workers, val_workers) in enumerate(DATASETS):
        specs.append((f"{name}-train", WhoMap(n), train_workers, 2 * k, True))
        specs.append((f"{name}-val", WhoMap(n // 2), val_workers, 2 * k + 1, False))

    def make(cls, method=method):
        return [
            cls(
                dataset,
                **{**_options(method, workers, seed), "shuffle": shuffle},
                persistent_workers=shuffle,  # train loaders keep their workers
            )
            for _, dataset, workers, seed, shuffle in specs
        ]

    def run(loaders):
        out: dict[str, list] = {name: [] for name, *_ in specs}
        for _ in range(2):
            live = {name: iter(loader) for (name, *_), loader in zip(specs, loaders)}
            while live:
                for name in list(live):
                    try:
                        out[name].append(canon(next(live[name])))
                    except StopIteration:
                        del live[name]
        return out

    start = time.monotonic()
    loaders = make(DataLoader)
    got = run(loaders)
    shm_s = time.monotonic() - start
    workers_seen = len(descendants())
    fds_with_loaders = open_fds()
    left, waited = _gone(loaders)
    fds_left = open_fds()
    start = time.monotonic()
    want = run(make(TorchLoader, TORCH_METHOD))
    torch_s = time.monotonic() - start
    return dict(
        same=got == want,
        batches=sum(map(len, got.values())),
        differing=[name for name in got if got[name] != want[name]],
        workers_seen=workers_seen,
        fds_with_loaders=fds_with_loaders,
        fds_left=fds_left,
        left=left,
        waited_s=waited,
        shm_s=round(shm_s, 1),
        torch_s=round(torch_s, 1),
    )


def main() -> None:
    kind, method, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    warnings.simplefilter("ignore")  # (torch's "suggested max number of worker" warning)
    # The start method's one-off helpers (a forkserver, the resource tracker) first.
    warm = [DataLoader(WhoMap(2), num_workers=1, multiprocessing_context=method)]
    list(warm[0])
    _gone(warm)
    gc.collect()
    fds_before = open_fds()
    if kind.startswith("workers:"):
        result = one_loader(method, int(kind.split(":")[1]))
    else:
        result = eight_loaders(method)
    result["fds_left"] -= fds_before
    if "peak_fds" in result:
        result["peak_fds"] -= fds_before
    print("RESULT", repr(result), flush=True)


if __name__ == "__main__":
    main()

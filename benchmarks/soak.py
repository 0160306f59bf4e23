"""Soak (issue 39): does a long, hostile run leave anything behind? Memory, file
descriptors, processes and shared-memory segments of the main process, after the first
epoch and at the end of thousands of batches, and after the loaders are gone.

    python benchmarks/soak.py --quick    # 2,000 batches, 5 worker kills: seconds to a minute on 2 cores
    python benchmarks/soak.py            # 10,000 batches, 20 worker kills: about 5 times as long
    SHMLOADER_DEBUG_POISON=1 python benchmarks/soak.py --quick    # in poison mode

The run: a shmloader.DataLoader with persistent_workers=True (2 workers, prefetch 2,
shuffled, batches of 16 float32 3x64x64 images and their labels, 768 KiB: they live in
ring slots) run for --batches batches, epoch after epoch. Meanwhile the user keeps
batches: now and then a hold takes the next 0 to all-slots batches (never more than the
ring's slots kept at once, so the ring fills and batches travel outside it) and drops
them at a random later batch, often epochs later and after its loader is gone. Each kept
batch is checked when dropped (every image still equals its label). At --kills random
batches a worker gets SIGKILL: the loader must raise shmloader.WorkerDied, after which a
new loader is built and the run goes on (the old one, and the batches kept from it, go
their own ways).

Figures, read from /proc: the main process's RSS and PSS (smaps_rollup) and its workers'
PSS, its open fds, its child processes (multiprocessing's forkserver and resource tracker
left out), and the memfd segments alive in it: fds linking to "/memfd:", and the memfd
files mapped (/proc/self/smaps), those with no fd here apart. Taken after the first epoch
("start") and at the end, each with every kept batch dropped first, and once more after
the last loader is gone. Flat means: RSS less the pages of memfd segments (which slots of
its ring the main process has read so far is no leak; the segments are counted apart) at
the end within 1% of the start; fds, children and segments at the end equal to the
start's; no segment mapped without an fd (every kept batch is gone); after the loaders
are gone no child and no segment; every kill seen as WorkerDied; every batch intact. In
poison mode (SHMLOADER_DEBUG_POISON=1) its quarantine, the last few one-off segments kept
mapped after their batches, views of private memory, may stay: up to that many segments,
and a slot's bytes of RSS for each more at the end than at the start. The script prints
a table and exits 1 where anything is not flat.

Figures go to results/soak.json.
"""

import gc
import os
import random
import signal
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.utils.data

import shmloader

SEED = 0
SHAPE = (3, 64, 64)


class Labelled(torch.utils.data.Dataset):
    """Item i: a float32 image full of i, and i (a batch checks itself)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full(SHAPE, float(i)), i


@dataclass(frozen=True)
class Settings:
    batches: int  # in all, across epochs and loaders
    kills: int  # workers SIGKILLed, at random batches
    samples: int  # per epoch
    batch_size: int
    workers: int
    prefetch_factor: int
    hold_chance: float  # per batch: a new hold starts
    mean_hold: int  # batches a hold is kept past its last, on average (exponential)


FULL = Settings(
    batches=10_000,
    kills=20,
    samples=400,
    batch_size=16,
    workers=2,
    prefetch_factor=2,
    hold_chance=0.02,
    mean_hold=50,
)
QUICK = replace(FULL, batches=2_000, kills=5)


# What /proc shows.


def _pss_rss(pid: int | str) -> tuple[int, int]:
    """(PSS, RSS) in bytes, from /proc/PID/smaps_rollup."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                found[key] = int(rest.split()[0]) * 1024
    return found["Pss"], found["Rss"]


def children() -> list[int]:
    """The workers: this process's live children, less multiprocessing's long-lived
    helpers (the forkserver and the resource tracker start once and stay), and the
    forkserver's children (its workers, whose command line is the forkserver's)."""
    me, listed = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z":
            listed.append((int(pid), int(fields[1]), cmdline))
    helpers = {
        pid
        for pid, ppid, cmdline in listed
        if ppid == me and (b"forkserver" in cmdline or b"resource_tracker" in cmdline)
    }
    return sorted(
        pid for pid, ppid, _ in listed if (ppid == me and pid not in helpers) or (ppid in helpers)
    )


def open_fds() -> dict[int, str]:
    """This process's open fds: their targets."""
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own fd, closed since
            continue
    return targets


def memfds_mapped() -> dict[int, int]:
    """The memfd files mapped in this process: inode -> the RSS of their mappings."""
    files: dict[int, int] = {}
    inode = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                named = len(fields) == 6 and fields[5].startswith("/memfd:")
                inode = int(fields[4]) if named else None
                if inode is not None:
                    files.setdefault(inode, 0)
            elif inode is not None and fields[0] == "Rss:":
                files[inode] += int(fields[1]) * 1024
    return files


def snapshot() -> dict[str, int]:
    gc.collect()
    pss, rss = _pss_rss("self")
    workers_pss = 0
    kids = children()
    for pid in kids:
        try:
            workers_pss += _pss_rss(pid)[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
    fds = open_fds()
    memfds = [fd for fd, target in fds.items() if target.startswith("/memfd:")]
    with_fd = set()
    for fd in memfds:
        try:
            with_fd.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except FileNotFoundError:
            continue
    mapped = memfds_mapped()
    # Mapped with no fd here: a one-off segment a batch still views, or one that poison
    # mode keeps mapped (its quarantine); every batch is dropped before a snapshot.
    no_fd = [inode for inode in mapped if inode not in with_fd]
    return {
        "rss_bytes": rss,
        "pss_bytes": pss,
        "workers_pss_bytes": workers_pss,
        "fds": len(fds),
        "children": len(kids),
        "memfd_fds": len(memfds),
        "memfds_mapped": len(mapped),
        "memfds_mapped_no_fd": len(no_fd),
        # Less the pages of the segments: which of a ring's slots this process has read
        # so far (no leak: the segments are counted apart).
        "rss_less_segments_bytes": rss - sum(mapped.values()),
    }


# The run.


@dataclass
class Hold:
    """Batches the user keeps: the next `take` batches, dropped at batch `drop_at`."""

    take: int
    drop_at: int
    batches: list


def check(batch) -> bool:
    images, labels = batch
    return torch.equal(images, labels.to(images.dtype).view(-1, 1, 1, 1).expand_as(images))


class Soak:
    def __init__(self, settings: Settings, seed: int, method: str | None):
        self.s = settings
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.method = method
        self.dataset = Labelled(settings.samples)
        self.holds: list[Hold] = []
        self.served = 0
        self.epochs = 0
        self.loaders = 0
        self.kills: list[float] = []  # when each kill was sent (perf_counter)
        self.died: list[float] = []  # seconds from a kill to its WorkerDied
        self.bad_batches = 0
        self.kept_counts: dict[int, int] = {}  # batches kept after a batch: how often
        self.warnings: dict[str, int] = {}
        self.slots = settings.prefetch_factor * settings.workers + 4  # the default ring's
        self.loader: Any = None
        self.stats: dict[str, float] = {}
        self.pending_kills = 0  # (one at a time: each seen as WorkerDied before the next)

    def new_loader(self) -> None:
        self.loader = None  # (the last one goes first)
        self.loader = shmloader.DataLoader(
            self.dataset,
            batch_size=self.s.batch_size,
            shuffle=True,
            generator=self.generator,
            num_workers=self.s.workers,
            prefetch_factor=self.s.prefetch_factor,
            persistent_workers=True,
            multiprocessing_context=self.method,
            timeout=120,  # (a hang would be a failure of its own: a RuntimeError then)
        )
        self.loaders += 1

    def kept(self) -> int:
        return sum(len(h.batches) for h in self.holds)

    def drop(self, hold: Hold) -> None:
        self.bad_batches += sum(not check(b) for b in hold.batches)
        self.holds.remove(hold)

    def drop_all(self) -> None:
        for hold in list(self.holds):
            self.drop(hold)

    def on_batch(self, batch) -> None:
        self.served += 1
        if not check(batch):
            self.bad_batches += 1
        for hold in [h for h in self.holds if h.drop_at <= self.served]:
            self.drop(hold)
        if self.rng.random() < self.s.hold_chance:
            take = self.rng.randint(0, self.slots)
            self.holds.append(
                Hold(
                    take, self.served + take + round(self.rng.expovariate(1 / self.s.mean_hold)), []
                )
            )
        for hold in self.holds:
            if len(hold.batches) < hold.take and self.kept() < self.slots:
                hold.batches.append(batch)
        kept = self.kept()
        self.kept_counts[kept] = self.kept_counts.get(kept, 0) + 1

    def kill_a_worker(self) -> None:
        workers = children()
        if not workers:
            raise RuntimeError("soak.py found no worker to kill")
        os.kill(self.rng.choice(workers), signal.SIGKILL)
        self.kills.append(time.perf_counter())

    def epoch(self, kill_at: set[int]) -> None:
        """One epoch of the current loader; a WorkerDied makes a new loader."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for batch in self.loader:
                    self.on_batch(batch)
                    self.pending_kills += self.served in kill_at
                    if self.pending_kills and len(self.died) == len(self.kills):
                        self.pending_kills -= 1
                        self.kill_a_worker()
                    del batch
                for w in caught:
                    key = str(w.message)[:70]
                    self.warnings[key] = self.warnings.get(key, 0) + 1
        except shmloader.WorkerDied:
            if len(self.died) == len(self.kills):
                raise  # (no kill of ours to explain it)
            self.died.append(time.perf_counter() - self.kills[len(self.died)])
            self.collect_stats()
            self.new_loader()
            return
        self.epochs += 1

    def collect_stats(self) -> None:
        stats = self.loader.stats()
        for key in (
            "batches",
            "slot_batches",
            "ring_full_batches",
            "spilled_batches",
            "wait_seconds",
        ):
            self.stats[key] = self.stats.get(key, 0) + getattr(stats, key)

    def run(self, status) -> dict[str, Any]:
        s = self.s
        per_epoch = -(-s.samples // s.batch_size)
        # Kills after the start's figures and with some epochs left after the last.
        first, last = 2 * per_epoch, max(2 * per_epoch + 1, s.batches - 3 * per_epoch)
        kill_at = set(self.rng.sample(range(first, last), min(s.kills, last - first)))
        self.new_loader()
        self.epoch(set())
        self.drop_all()
        start = snapshot()
        timeline = [{"batches": self.served, "epochs": self.epochs, **start}]
        began = time.perf_counter()
        while self.served < s.batches:
            if self.epochs % 20 == 0 and self.epochs != timeline[-1]["epochs"]:
                timeline.append({"batches": self.served, "epochs": self.epochs, **snapshot()})
            status(
                f"batch {self.served:,}/{s.batches:,}, epoch {self.epochs}, loader {self.loaders}, "
                f"kills {len(self.kills)}, kept {self.kept()}"
            )
            self.epoch(kill_at)
        seconds = time.perf_counter() - began
        self.drop_all()
        end = snapshot()
        self.collect_stats()
        ring_slots, slot_bytes = self.loader.stats().ring_slots, self.loader.stats().slot_bytes
        self.loader = None
        gone = snapshot()
        return {
            "figures": {"start": start, "end": end, "gone": gone},
            "timeline": timeline,
            "events": {
                "batches": self.served,
                "epochs": self.epochs,
                "loaders": self.loaders,
                "kills": len(self.kills),
                "worker_died": len(self.died),
                "kill_to_error_s_max": max(self.died, default=None),
                "kept_counts": dict(sorted(self.kept_counts.items())),
                "ring_slots": ring_slots,
                "slot_bytes": slot_bytes,
                "bad_batches": self.bad_batches,
                "warnings": self.warnings,
                "loader_stats": self.stats,
                "seconds": seconds,
            },
        }


# The verdict.

MiB = 2**-20
ROWS = [
    ("RSS MiB", "rss_bytes", MiB),
    ("PSS MiB", "pss_bytes", MiB),
    ("workers' PSS MiB", "workers_pss_bytes", MiB),
    ("open fds", "fds", 1),
    ("child processes", "children", 1),
    ("memfd fds", "memfd_fds", 1),
    ("memfd files mapped", "memfds_mapped", 1),
    ("of them with no fd", "memfds_mapped_no_fd", 1),
    ("RSS less memfd pages MiB", "rss_less_segments_bytes", MiB),
]


def checks(result: dict[str, Any], quarantine: int) -> list[tuple[str, bool]]:
    """What must hold: see the module's docstring.  `quarantine`: the one-off segments
    poison mode keeps mapped after their batches are gone (0 outside it), each of a
    slot's bytes at most, its view private memory filled with the pattern."""
    start, end, gone = (result["figures"][k] for k in ("start", "end", "gone"))
    events = result["events"]
    page = os.sysconf("SC_PAGESIZE")
    slot = -(-events["slot_bytes"] // page) * page
    more_quarantined = max(0, end["memfds_mapped_no_fd"] - start["memfds_mapped_no_fd"])
    rss_start, rss_end = start["rss_less_segments_bytes"], end["rss_less_segments_bytes"]

    def with_fd(figures):
        return figures["memfds_mapped"] - figures["memfds_mapped_no_fd"]

    kept = f" (poison mode: its quarantine of {quarantine} at most)" if quarantine else ""
    return [
        (
            "RSS less memfd pages at the end within 1% of the start"
            + (", plus a slot for each segment more in quarantine" if quarantine else ""),
            abs(rss_end - rss_start) <= rss_start / 100 + more_quarantined * slot,
        ),
        ("open fds at the end equal the start's", end["fds"] == start["fds"]),
        ("child processes at the end equal the start's", end["children"] == start["children"]),
        (
            "memfd segments at the end equal the start's",
            (end["memfd_fds"], with_fd(end)) == (start["memfd_fds"], with_fd(start)),
        ),
        (
            "no memfd mapped without an fd, at the start and the end" + kept,
            max(start["memfds_mapped_no_fd"], end["memfds_mapped_no_fd"]) <= quarantine,
        ),
        ("no child process after the loaders are gone", gone["children"] == 0),
        ("no memfd fd after the loaders are gone", gone["memfd_fds"] == 0),
        ("no memfd mapped after the loaders are gone" + kept, gone["memfds_mapped"] <= quarantine),
        ("every kill seen as WorkerDied", events["worker_died"] == events["kills"]),
        ("every batch and kept batch intact", events["bad_batches"] == 0),
    ]


def table(result: dict[str, Any]) -> list[list[str]]:
    figures = result["figures"]
    rows = [["", "after epoch 1", "at the end", "loaders gone"]]
    for heading, key, scale in ROWS:
        cells = [figures[k][key] * scale for k in ("start", "end", "gone")]
        rows.append([heading, *(f"{c:,.1f}" if scale != 1 else f"{c:,}" for c in cells)])
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    import report

    from shmloader.bench.progress import StatusLine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 batches, 4 kills")
    parser.add_argument("--batches", type=int, help=f"default {FULL.batches:,}")
    parser.add_argument("--kills", type=int, help=f"default {FULL.kills}")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--method", choices=("fork", "forkserver", "spawn"), help="start method (default: Python's)"
    )
    parser.add_argument("--out", type=Path, default=report.RESULTS / "soak.json")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    for name in ("batches", "kills"):
        if getattr(args, name) is not None:
            settings = replace(settings, **{name: getattr(args, name)})

    poison = os.environ.get("SHMLOADER_DEBUG_POISON", "") not in ("", "0")
    quarantine = 0
    if poison:  # (it keeps the mappings of its last few one-off segments)
        try:
            from shmloader._shm._poison import QUARANTINE as quarantine
        except ImportError:  # (a shmloader without poison mode)
            pass
    document = report.new_document(
        benchmark="soak",
        settings=asdict(settings),
        seed=args.seed,
        method=args.method,
        poison=poison,
    )
    status = StatusLine("soak.py")
    result = Soak(settings, args.seed, args.method).run(status)
    status.clear()
    document.update(result)
    verdict = checks(result, quarantine)
    document["checks"] = {what: ok for what, ok in verdict}
    document["flat"] = all(ok for _, ok in verdict)
    report.write_json(document, args.out)

    e = result["events"]
    counts, ring = e["kept_counts"], e["ring_slots"]
    print(
        f"{e['batches']:,} batches of {settings.batch_size} in {e['epochs']} epochs, "
        f"{e['loaders']} loaders (persistent, {settings.workers} workers), {e['kills']} workers "
        f"killed, {e['worker_died']} WorkerDied, {e['seconds']:.0f} s"
        f"{'; poison mode' if poison else ''}"
    )
    print(
        f"batches kept: none {counts.get(0, 0) / e['batches']:.0%} of the time, all {ring} slots' "
        f"{counts.get(ring, 0) / e['batches']:.0%}; {e['loader_stats'].get('ring_full_batches', 0):,} "
        "batches travelled outside the ring while every slot was held"
    )
    print("\n".join(report.aligned(table(result))))
    print("(PSS: a page shared with the workers counts half; once they are gone, whole)")
    for what, ok in verdict:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    print(f"wrote {args.out}")
    return 0 if document["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())

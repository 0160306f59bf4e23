"""The files a loader's workers keep open in the main process, and a clear
error where the open-files limit (RLIMIT_NOFILE, `ulimit -n`) cannot hold them.

NOTE [open files: per worker]
The main process holds 4 files per worker for the worker's whole life: its
task pipe, its result socket, and the two pipes every start method keeps
(fork's and spawn's popen, shmloader's forkserver alike): the sentinel that
wakes the wait when the worker dies, and the write end whose closing tells the
worker that the main process is gone.  Besides those, at least 4: the ring's
memfd and eventfd, and a starting worker's own ends of its pipe and socket, held
until it runs.  (Under spawn and forkserver a non-persistent loader also starts
its next epoch's workers during each epoch from its second on, 4 files each
again; they are optional: where they do not fit, none start, see _spare.py.)
Measured in tests/robustness/test_scale.py; documented in docs/reliability.md,
"Scale".

The limit is a count of descriptor numbers: a new file gets the lowest free
number, and none at or above the soft limit.  Two checks, neither refusing
what would work: at construction (and each iter()), whether the workers alone
fit under the limit (the process's other files may close before they start);
as workers start (check_room_for_workers, for the pool to call), whether they
fit beside the files open then.
"""

from __future__ import annotations

import errno
import os
import resource

FDS_PER_WORKER = 4
FDS_FIXED = 4


def fds_needed(num_workers: int) -> int:
    """The files `num_workers` workers keep open in the main process, at least."""
    return FDS_PER_WORKER * num_workers + FDS_FIXED


def limit_words() -> str:
    """The open-files limit, named as a message names it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return f"the open-files limit (RLIMIT_NOFILE, `ulimit -n`: {soft} here, hard limit {hard_text})"


def _how_to_raise(at_least: int) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << max(at_least - 1, 1).bit_length()  # the next power of two
    if hard != resource.RLIM_INFINITY and target > hard:
        return (
            f"Raise the limit to at least {at_least}: the hard limit too, which takes root "
            "(/etc/security/limits.conf, systemd's LimitNOFILE, `docker run --ulimit "
            "nofile=...`)"
        )
    return (
        f"Raise the limit (`ulimit -n {target}` in the shell that starts Python, or "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({target}, hard)) before the loader "
        "starts: no privilege is needed up to the hard limit)"
    )


def check_num_workers(num_workers) -> None:
    """At construction (and each iter()): OSError(EMFILE) where `num_workers`
    workers alone need more files than the soft limit allows: they could never
    start here.  Anything else is left to the start (check_room_for_workers)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not isinstance(num_workers, int) or num_workers <= 0 or soft == resource.RLIM_INFINITY:
        return
    needed = fds_needed(num_workers)
    if needed <= soft:
        return
    most = max(0, (soft - FDS_FIXED) // FDS_PER_WORKER)
    raise OSError(
        errno.EMFILE,
        f"num_workers={num_workers} cannot run under {limit_words()}: the main process "
        f"keeps {FDS_PER_WORKER} files open per worker (its task pipe and result socket, its "
        f"process's two pipes) and {FDS_FIXED} more (the ring's two, and two while a worker "
        f"starts), {needed} in all. {_how_to_raise(needed)}, or use num_workers <= {most}.",
    )


def open_below(limit: int) -> int:
    """How many of this process's descriptor numbers under `limit` are taken
    (those at or above it, left from before the limit was lowered, take no
    room); `limit` itself when not even the count can be opened."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return limit
        return 0  # no /proc: nothing known, nothing refused
    return max(0, sum(1 for n in names if int(n) < limit) - 1)  # less the listing's own


def check_room_for_workers(count: int) -> None:
    """Before `count` workers start: OSError(EMFILE) where they cannot fit
    beside the files open now (other loaders' workers, your files), rather
    than a bare "Too many open files" from whichever call ran out first."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if count <= 0 or soft == resource.RLIM_INFINITY:
        return
    needed = fds_needed(count)
    taken = open_below(soft)
    if taken + needed <= soft:
        return
    room = max(0, (soft - taken - FDS_FIXED) // FDS_PER_WORKER)
    raise OSError(
        errno.EMFILE,
        f"shmloader cannot start {count} DataLoader workers: they need {needed} more open "
        f"files in this process ({FDS_PER_WORKER} a worker, {FDS_FIXED} more), and {taken} are "
        f"open already (other loaders' workers, your files) under {limit_words()}, which "
        f"leaves room for {room} workers. {_how_to_raise(taken + needed)}, use fewer workers, "
        "or end other loaders' iterators first (persistent workers stay until their loader "
        "is gone).",
    )


def too_many_open_files(doing: str) -> str:
    """The words for this process having run out of files while `doing`
    something (receiving a batch, say): the limit, what is open, what to do."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:  # (then the system's table is full: ENFILE)
        return f"Too many open files while {doing}: the system's limit (fs.file-max) is reached."
    return (
        f"Too many open files while {doing}: {open_below(soft)} are open under "
        f"{limit_words()}. {_how_to_raise(2 * soft)}, or keep fewer files open: "
        "fewer loaders' iterators alive at once, or fewer workers."
    )

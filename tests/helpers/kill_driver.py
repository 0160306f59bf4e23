"""One kill/fault scenario of tests/robustness/test_kill_matrix.py, in a process of its own.

Run from the repository root:

    python -m tests.helpers.kill_driver main   --how HOW --when WHEN --ctx CTX --persistent 0|1
    python -m tests.helpers.kill_driver worker --fault FAULT --ctx CTX --persistent 0|1

Every line the test reads is "KD " + one JSON object with an "event" key; anything
else on stdout/stderr (workers' tracebacks, the segfault message) is for humans.

`main`: start a loader with two workers, bring it mid-epoch (8 batches into an
endless epoch of slow samples, so the main process sleeps in the ring's wait)
or between epochs (one epoch done, the loader and its iterator kept), emit
"ready" with the worker pids, then end: HOW=return falls off the end of the
script with the loader and iterator still referenced from a module global (as
a training script's top level does); HOW=exception raises an uncaught
RuntimeError; HOW=sigint/sigterm/sigkill waits (iterating, or sleeping between
epochs) for the test to send that signal.

`worker`: one worker fails once (see tests/helpers/datasets.py, FaultOnce &
co.), by FAULT = sigkill, sigsegv, exit (os._exit(1)), init (worker_init_fn
raises LookupError), iter (IterableDataset.__iter__ raises KeyError), getitem
(__getitem__ raises ValueError), or idle-sigkill (the driver SIGKILLs a
persistent worker between epochs and, 0.5 s later, calls iter(loader), which
must say so; that time counts from the call).  The
driver reports the error the main process raised and how long after the fault
it came (time.monotonic() of the fault is written by the failing worker; a
figure for humans, no test bound), then checks what must hold afterwards:
dead-worker cases leave no worker (waited for up to GONE_S), the rest of a
__getitem__-failed epoch and the next epoch are complete, and at the end no
process, fd or /dev/shm entry of the loader is left.
"""

import argparse
import faulthandler
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time

# At the top, as in a training script: a forkserver then imports torch once (see
# preload_forkserver) and spawned workers import this module as __mp_main__ anyway.
from shmloader import DataLoader
from tests.helpers.datasets import (
    FaultOnce,
    Images,
    InitFailsOnce,
    Sleepy,
    StreamFailsOnce,
)
from tests.helpers.procs import alive, open_fds, own_children, wait_gone
from tests.helpers.procs import our_segments as segments

BATCHES = 32  # of the `worker` loaders: 64 samples, batch_size 2
DEATHS = ("sigkill", "sigsegv", "exit", "idle-sigkill")
# Between epochs, wait this long for a signal; +5 s: dump stacks, exit 1.  Past the test's
# bounds on a main scenario (test_kill_matrix.py: STARTUP_S + EVENT_S = 150 s), short of
# its DRIVER_S (200 s): its bounds decide, and a hung worker scenario shows its stacks.
# Generous: spawn workers take seconds to import torch, far more on a loaded machine.
WATCHDOG_S = 165.0
# Processes that should be gone are polled for up to this long: gone at once when all is
# well, and a loaded machine may take seconds to run their exit.
GONE_S = 60.0


def emit(event, **fields):
    print("KD " + json.dumps({"event": event, **fields}), flush=True)


def preload_forkserver():
    """`python train.py` gets a forkserver that imports the script, and with it
    torch, once, so that its workers fork with torch loaded; `python -m` does not
    (the forkserver preloads only a main module given by path), so say it."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(["shmloader", "tests.helpers.datasets"])


def start_helpers(ctx):
    """Start multiprocessing's helper processes before counting fds: they keep
    an fd or two open in this process for good, which is not the loader's."""
    if ctx in ("spawn", "forkserver"):
        from multiprocessing import resource_tracker

        from shmloader._main import _forkserver

        resource_tracker.ensure_running()
        _forkserver.own_server(ctx).ensure_running()  # the one its workers fork from
    if ctx == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


# ---- the main process ends ----------------------------------------------------

_KEEP = []  # the loader and its iterator live until the interpreter exits


def main_ends(args):
    kw = {
        "batch_size": 4,
        "num_workers": 2,
        "persistent_workers": bool(args.persistent),
        "multiprocessing_context": args.ctx,
    }
    if args.when == "mid":
        loader = DataLoader(Sleepy(10**6, 0.01), **kw)
        if not args.persistent:  # the second iterator starts spare workers (spawn, forkserver)
            next(iter(loader))
        it = iter(loader)
        _KEEP.extend([loader, it])
        for _ in range(8):  # past the first batches, which size the ring
            next(it)
    else:
        loader = DataLoader(Images(32), **kw)
        if not args.persistent:
            next(iter(loader))
        it = iter(loader)
        _KEEP.extend([loader, it])
        for _ in it:
            pass
    # With the spare workers a non-persistent loader starts for its next
    # epoch (spawn, forkserver): idle, they must go as the others do.
    spare = loader._spare_workers._own()
    spare_pids = spare.pids if spare is not None else []
    pids = list(it._pool.pids) + spare_pids
    emit(
        "ready",
        pid=os.getpid(),
        workers=pids,
        spare=spare_pids,
        workers_alive=[p for p in pids if alive(p)],
        ring=it._ring is not None or loader._ring_handover.spare_ring is not None,
    )
    if args.how == "return":
        return
    if args.how == "exception":
        raise RuntimeError("kill_driver: the training loop failed")
    # Wait where a training script would be when the signal comes.
    if args.when == "mid":
        for _ in it:
            pass
    else:
        time.sleep(WATCHDOG_S)
    emit("no_signal")
    sys.exit(3)


# ---- a worker fails -------------------------------------------------------------


def _read_stamp(path):
    try:
        with open(path) as f:
            t, pid = f.read().split()
        return float(t), int(pid)
    except (FileNotFoundError, ValueError):
        return None, None


def _describe(e):
    return {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)}


def _epoch(it, limit=4 * BATCHES):
    """Batches and errors (type names) of the rest of an epoch; stops at the
    first error unless it is the dataset's own ValueError (torch lets the
    epoch go on after a sample failed)."""
    batches, errors = 0, []
    for _ in range(limit):
        try:
            next(it)
            batches += 1
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - reported, the test decides
            errors.append(_describe(e))
            if not isinstance(e, ValueError):
                break
    return batches, errors


def worker_fails(args):
    start_helpers(args.ctx)
    gc.collect()
    fds0, kids0, segs0 = open_fds(), own_children(), segments()
    tmp = tempfile.mkdtemp(prefix="kill_driver-")
    stamp = os.path.join(tmp, "stamp")
    fault = args.fault
    kw = {
        "batch_size": 2,
        "num_workers": 2,
        "persistent_workers": bool(args.persistent),
        "multiprocessing_context": args.ctx,
    }
    if fault in ("sigkill", "sigsegv", "exit", "getitem"):
        # Sample 22 is in batch 11, which round robin gives to worker 1.
        how = "raise" if fault == "getitem" else fault
        loader = DataLoader(FaultOnce(64, at=22, how=how, stamp=stamp), **kw)
    elif fault == "init":
        loader = DataLoader(
            FaultOnce(64, at=-1, how="raise", stamp=stamp),
            worker_init_fn=InitFailsOnce(1, stamp),
            **kw,
        )
    elif fault == "iter":
        loader = DataLoader(StreamFailsOnce(64, bad_worker=1, stamp=stamp), **kw)
    else:  # idle-sigkill
        assert args.persistent, "idle-sigkill needs persistent workers"
        loader = DataLoader(FaultOnce(64, at=-1, how="raise", stamp=stamp), **kw)

    seen = set()
    it = iter(loader)
    pids = list(it._pool.pids)
    seen.update(pids)
    emit("workers", pids=pids)

    t_event = victim = None
    if fault == "idle-sigkill":
        first, errors = _epoch(it)
        emit("first_epoch", batches=first, errors=errors)
        victim = pids[1]
        t_event = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_gone([victim], GONE_S)
        time.sleep(0.5)  # the loop comes back to the loader a little later
        t_event = time.monotonic()  # the error is due from the next call on

    error, batches = None, 0
    try:
        if fault == "idle-sigkill":
            it = iter(loader)
        while True:
            try:
                next(it)  # no batch kept: a held batch keeps its slot and the ring
            except StopIteration:
                break
            batches += 1
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        t_error = time.monotonic()
        error = _describe(e)
        del e
    if error is None:
        emit("no_error", batches=batches)
    else:
        if t_event is None:
            t_event, victim = _read_stamp(stamp)
        elapsed = None if t_event is None else round(t_error - t_event, 4)
        emit("error", victim=victim, elapsed_s=elapsed, batches_before=batches, **error)

    if fault in DEATHS:
        left, waited = wait_gone(pids, GONE_S)
        emit("workers_gone", left=left, waited_s=waited)
    elif fault == "getitem" and error is not None:
        rest, errors = _epoch(it)
        emit("rest_of_epoch", batches=rest, errors=errors)
    del it

    # The fault fired once; the next epoch must be whole.
    t0 = time.monotonic()
    try:
        it = iter(loader)
        seen.update(it._pool.pids)
        n, errors = _epoch(it)
    except Exception as e:  # noqa: BLE001 - reported, the test decides
        n, errors = 0, [_describe(e)]
    emit("next_epoch", batches=n, errors=errors, seconds=round(time.monotonic() - t0, 3))
    it = None
    del loader, it
    gc.collect()
    left, waited = wait_gone(sorted(seen), GONE_S)
    emit("all_gone", pids=sorted(seen), left=left, waited_s=waited)
    shutil.rmtree(tmp, ignore_errors=True)
    gc.collect()
    emit(
        "final",
        fds_before=fds0,
        fds_after=open_fds(),
        fd_list=sorted(os.listdir("/proc/self/fd")),
        children_before=kids0,
        children_after=own_children(),
        new_segments=sorted(set(segments()) - set(segs0)),
    )


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("main")
    m.add_argument(
        "--how", required=True, choices=["return", "exception", "sigint", "sigterm", "sigkill"]
    )
    m.add_argument("--when", required=True, choices=["mid", "between"])
    w = sub.add_parser("worker")
    w.add_argument(
        "--fault",
        required=True,
        choices=["sigkill", "sigsegv", "exit", "init", "iter", "getitem", "idle-sigkill"],
    )
    for p in (m, w):
        p.add_argument("--ctx", required=True, choices=["fork", "spawn", "forkserver"])
        p.add_argument("--persistent", type=int, default=0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(WATCHDOG_S + 5, exit=True)
    preload_forkserver()
    if args.mode == "main":
        main_ends(args)
    else:
        worker_fails(args)


if __name__ == "__main__":
    main()

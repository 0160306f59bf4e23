"""Kill matrix (docs/design.md, contract 5): however the main process ends, and however a
worker dies or fails, nothing hangs, nothing is left behind, and the error is clear.

Every scenario runs in a process of its own, `python -m tests.helpers.kill_driver ...` (see
that module), with hard time limits (STARTUP_S to get ready, EVENT_S from the event to
the exit, DRIVER_S for a whole worker scenario; the driver also dumps its stacks and
exits after 170 s): a hang fails the test instead of stalling the run.  They bound hangs
only, generously: on a loaded 2-core machine a spawn scenario alone takes tens of seconds.

(a) The main process ends - by return (falling off the end of the script with the
    loader and a live iterator referenced from a module global), by an uncaught
    exception, by KeyboardInterrupt (SIGINT sent to it), by SIGTERM, by SIGKILL - both
    mid-epoch (8 batches into an endless epoch of slow samples: the main process sleeps
    in the ring's wait) and between epochs (one epoch done, the loader kept).
    Checked: the exit status (0, 1, -SIGINT, -SIGTERM, -SIGKILL), the exit within
    EVENT_S of the event; no worker, and no other descendant of the driver (forkserver,
    resource tracker), alive GONE_S after the exit; no "shmloader*" entry in /dev/shm; no
    "Exception ignored" noise on stderr.
(b) A worker fails, once (tests/helpers/datasets.py, FaultOnce & co.): SIGKILL, a
    real segfault (SIGSEGV), os._exit(1), an exception in worker_init_fn, in an
    IterableDataset's __iter__, in __getitem__.  Checked: the main process raises
    WorkerDied naming the worker's pid and its signal or exit code, or the worker's
    exception re-raised like torch (same type, the original message, "Caught X in
    DataLoader worker process N", "Original Traceback"); the driver measures how long
    after the fault it came (time.monotonic() written by the failing worker), a figure
    in its "error" line and the KILL_MATRIX_REPORT, never asserted (docs/design.md asks for
    about a second; a hang fails by DRIVER_S); after a death no worker is alive GONE_S
    after the error; after a __getitem__ error the rest of the epoch is
    delivered; the next epoch is whole (the fault fired once); and when the loader is
    deleted: no worker left, open fds of the main process not above their count
    before the loader, its children back to what they were, nothing new in /dev/shm.

Which combinations run (67 scenarios) and why:
  * fork, the cheap start method (~1.5 s a scenario alone), runs the full product:
    (a) 5 endings x 2 moments x persistent on/off = 20, (b) 6 faults x persistent
    on/off = 12.
  * spawn costs ~1 s of CPU per worker start (each worker imports torch; a (b)
    scenario starts four workers and takes 10-20 s on 2 loaded cores) and forkserver a
    forkserver (the driver preloads torch there, as `python train.py` would), so each
    runs every ending and every fault once, not the product with persistence:
    (a) 5 endings x 2 moments = 10 each, mid-epoch without persistent workers and
    between epochs with them (between epochs without persistent workers no worker is
    alive, which fork covers; mid-epoch with persistent workers is also covered by
    test_lifecycle's test_main_process_killed_workers_exit for SIGINT/SIGTERM/SIGKILL);
    (b) 6 faults each, split so that every fault runs once with and once without
    persistent workers over the two (spawn: sigkill/exit/iter without, sigsegv/init/
    getitem with; forkserver the other way round).  So every item of the list is
    covered for all three start methods, and with and without persistent workers.
  * Additions that add coverage, fork only (the paths do not depend on the start
    method): Ctrl-C at a terminal, i.e. SIGINT to the whole process group (workers
    get it too), mid-epoch, persistent on/off (2); a persistent worker SIGKILLed
    while idle between epochs, noticed by the next iter(loader) (1).
  Total: (a) 20 + 10 + 10 + 2 = 42, (b) 12 + 6 + 6 + 1 = 25.

Scenarios run three at a time (KILL_MATRIX_JOBS; they mostly wait on start-up,
sleeps and exits): a module fixture starts every selected scenario in test order and
each test judges its own.  Set KILL_MATRIX_REPORT=<path> to append one JSON line of
figures per scenario (exit and gone times, the error's delay, wall time).
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import alive, our_segments

# Each case names its start method, and what it checks (exits, what is left behind, the
# error) is not what poison mode changes: CI's second run leaves them out.
pytestmark = pytest.mark.one_mode

# Hang bounds, not speed checks (polled: each returns as soon as its event comes).  Within
# the driver's own WATCHDOG_S + 5 = 170 s, and STARTUP_S + EVENT_S + GONE_S within conftest's
# hang guard of 240 s.
STARTUP_S = 90.0  # until the driver is ready (spawn on a loaded 2-core machine)
EVENT_S = 60.0  # from the event to the exit: more is a hang
GONE_S = 60.0  # workers must be gone within this long after the main process exits
DRIVER_S = 200.0  # a whole `worker` scenario (the driver's stack dump at 170 s comes first)

HOWS = ("return", "exception", "sigint", "sigterm", "sigkill")
WHENS = ("mid", "between")
FAULTS = ("sigkill", "sigsegv", "exit", "init", "iter", "getitem")
DEATHS = {
    "sigkill": "is killed by signal: Killed.",
    "sigsegv": "is killed by signal: Segmentation fault.",
    "exit": "exited unexpectedly with exit code 1.",
    "idle-sigkill": "is killed by signal: Killed.",
}
EXCEPTIONS = {
    "init": ("LookupError", "worker_init_fn failed in worker 1 (InitFailsOnce)"),
    "iter": ("KeyError", "__iter__ failed in worker 1 (StreamFailsOnce)"),
    "getitem": ("ValueError", "sample 22 is broken (FaultOnce)"),
}
EXIT_STATUS = {
    "return": 0,
    "exception": 1,
    "sigint": -signal.SIGINT,
    "sigterm": -signal.SIGTERM,
    "sigkill": -signal.SIGKILL,
}
SIGNALS = {
    "sigint": signal.SIGINT,
    "sigterm": signal.SIGTERM,
    "sigkill": signal.SIGKILL,
    "sigint_group": signal.SIGINT,
}
BATCHES = 32  # of the driver's `worker` loaders


def _p(persistent):
    return "p" if persistent else "np"


def _main_matrix():
    cases = []
    for how in HOWS:
        for when in WHENS:
            for persistent in (0, 1):
                cases.append(("fork", persistent, how, when))
            for ctx in ("spawn", "forkserver"):
                cases.append((ctx, int(when == "between"), how, when))
    cases += [("fork", 0, "sigint_group", "mid"), ("fork", 1, "sigint_group", "mid")]
    return [pytest.param(*c, id=f"{c[0]}-{_p(c[1])}-{c[2]}-{c[3]}") for c in cases]


def _worker_matrix():
    cases = [("fork", p, f) for f in FAULTS for p in (0, 1)]
    for fault in FAULTS:
        with_persistent = fault in ("sigsegv", "init", "getitem")
        cases.append(("spawn", int(with_persistent), fault))
        cases.append(("forkserver", int(not with_persistent), fault))
    cases.append(("fork", 1, "idle-sigkill"))
    return [pytest.param(*c, id=f"{c[0]}-{_p(c[1])}-{c[2]}") for c in cases]


# ---- /proc, /dev/shm ------------------------------------------------------------


def _descendants(root):
    """Live descendants of `root`, from /proc."""
    parent_of = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent_of[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier} - found
        found |= frontier
    return sorted(p for p in found if alive(p))


# ---- running the driver ----------------------------------------------------------
# Scenarios are mostly waiting (interpreter and torch start-up in three processes,
# sleeps, exits), so a few run at once: a module fixture starts every selected one
# on a small thread pool, in test order, and each test waits for its own and judges
# it.  KILL_MATRIX_JOBS=1 runs them one at a time.

JOBS = max(1, int(os.environ.get("KILL_MATRIX_JOBS", "3")))


def _events(text):
    return [json.loads(line[3:]) for line in text.splitlines() if line.startswith("KD ")]


def _read(path):
    with open(path, "rb") as f:
        return f.read().replace(b"\0", b"").decode(errors="replace")


def _start(workdir, *args):
    cmd = [sys.executable, "-m", "tests.helpers.kill_driver", *map(str, args)]
    for attempt in range(2):
        with open(workdir / "out", "wb") as out, open(workdir / "err", "wb") as err:
            # A session of its own: signals for its group reach the driver and its
            # workers only, and cleanup can kill the whole group.
            try:
                return subprocess.Popen(
                    cmd, cwd=ROOT, stdout=out, stderr=err, start_new_session=True
                )
            except OSError as e:
                # Once in CI, starting the driver (vfork + exec of the interpreter, from
                # this module's thread pool) failed with EFAULT on sys.executable, before
                # any shmloader code ran in it; not in three reruns of this module.  Nothing
                # started, so one more try is safe; anything else is the test's failure.
                if e.errno != errno.EFAULT or attempt:
                    raise


def _kill_all(proc, pids):
    """Cleanup after a failure: the driver's group and anything it left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _gone_times(pids, limit):
    """{pid: seconds until it was gone, or None if still alive after `limit`}."""
    start, times = time.monotonic(), {}
    while True:
        now = round(time.monotonic() - start, 3)
        for p in pids:
            if p not in times and not alive(p):
                times[p] = now
        if len(times) == len(pids) or now >= limit:
            return {p: times.get(p) for p in pids}
        time.sleep(0.02)


def _finish(result, workdir, proc):
    result["wall_s"] = round(time.monotonic() - result.pop("t_start"), 3)
    result["out"], result["err"] = _read(workdir / "out"), _read(workdir / "err")
    result["status"] = proc.returncode
    result["new_segments"] = sorted(
        n for n in set(our_segments()) - result.pop("segments0") if str(proc.pid) in n
    )
    result["any_new_segments"] = sorted(set(our_segments()) - set(result.get("segments_all0", ())))
    return result


def run_main(workdir, ctx, persistent, how, when):
    """One (a) scenario: start the driver, end it by `how` once it is ready."""
    result = {
        "test": "main",
        "ctx": ctx,
        "persistent": persistent,
        "how": how,
        "when": when,
        "segments0": set(our_segments()),
        "t_start": time.monotonic(),
    }
    result["segments_all0"] = sorted(result["segments0"])
    proc = _start(
        workdir,
        "main",
        "--how",
        "sigint" if how == "sigint_group" else how,
        "--when",
        when,
        "--ctx",
        ctx,
        "--persistent",
        persistent,
    )
    watched = []
    try:
        deadline = time.monotonic() + STARTUP_S
        ready = None
        while ready is None and time.monotonic() < deadline:
            exited = proc.poll() is not None
            ready = next(
                (e for e in _events(_read(workdir / "out")) if e["event"] == "ready"), None
            )
            if ready is None and exited:
                break
            if ready is None:
                time.sleep(0.02)
        result["ready"] = ready
        if ready is None:
            result["failure"] = "the driver never got ready"
            return result
        t_event = time.monotonic()
        watched = sorted(set(ready["workers"]) | set(_descendants(proc.pid)))
        if how == "sigint_group":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal
        elif how in SIGNALS:
            os.kill(proc.pid, SIGNALS[how])
        try:
            proc.wait(EVENT_S)
        except subprocess.TimeoutExpired:
            result["failure"] = f"the main process did not exit within {EVENT_S} s of {how}"
            return result
        result["exit_s"] = round(time.monotonic() - t_event, 3)
        result["watched"] = watched
        result["gone_s"] = _gone_times(watched, GONE_S)
        return result
    finally:
        _kill_all(proc, watched)
        _finish(result, workdir, proc)


def run_worker(workdir, ctx, persistent, fault):
    """One (b) scenario: the driver runs it to the end by itself."""
    result = {
        "test": "worker",
        "ctx": ctx,
        "persistent": persistent,
        "fault": fault,
        "segments0": set(our_segments()),
        "t_start": time.monotonic(),
    }
    result["segments_all0"] = sorted(result["segments0"])
    proc = _start(workdir, "worker", "--fault", fault, "--ctx", ctx, "--persistent", persistent)
    watched = []
    try:
        try:
            proc.wait(DRIVER_S)
        except subprocess.TimeoutExpired:
            result["failure"] = f"the driver hung (> {DRIVER_S} s)"
            watched = [p for e in _events(_read(workdir / "out")) for p in e.get("pids", [])]
        return result
    finally:
        _kill_all(proc, watched)
        _finish(result, workdir, proc)


def _key(name, params):
    if name == "test_main_process_ends":
        return ("main", params["ctx"], params["persistent"], params["how"], params["when"])
    return ("worker", params["ctx"], params["persistent"], params["fault"])


class _Runner:
    def __init__(self, factory):
        self._pool = ThreadPoolExecutor(max_workers=JOBS, thread_name_prefix="kill-matrix")
        self._factory = factory
        self._futures = {}

    def submit(self, key):
        if key not in self._futures:
            workdir = self._factory.mktemp("-".join(map(str, key)))
            fn = run_main if key[0] == "main" else run_worker
            self._futures[key] = self._pool.submit(fn, workdir, *key[1:])
        return self._futures[key]

    def result(self, key):
        return self.submit(key).result()

    def close(self):
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def scenarios(request, tmp_path_factory):
    runner = _Runner(tmp_path_factory)
    me = sys.modules[__name__]
    for item in request.session.items:  # every selected scenario, in test order
        if getattr(item, "module", None) is me and hasattr(item, "callspec"):
            runner.submit(_key(item.originalname, item.callspec.params))
    yield runner
    runner.close()


def _output(result):
    return (
        f"\n--- driver stdout ---\n{result['out']}\n--- driver stderr ---\n{result['err'][-6000:]}"
    )


def _report(result):
    path = os.environ.get("KILL_MATRIX_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({k: v for k, v in result.items() if k not in ("out", "err")}) + "\n")


# ---- the tests -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("ctx, persistent, how, when", _main_matrix())
def test_main_process_ends(scenarios, ctx, persistent, how, when):
    r = scenarios.result(("main", ctx, persistent, how, when))
    _report(r)
    assert "failure" not in r, r.get("failure", "") + _output(r)

    problems = []
    expected = EXIT_STATUS["sigint" if how == "sigint_group" else how]
    if r["status"] != expected:
        problems.append(f"exit status {r['status']}, expected {expected}")
    if how == "exception" and "kill_driver: the training loop failed" not in r["err"]:
        problems.append("the user's exception is not on stderr")
    if how.startswith("sigint") and "KeyboardInterrupt" not in r["err"]:
        problems.append("no KeyboardInterrupt on stderr")
    if "Exception ignored" in r["err"]:
        problems.append("'Exception ignored' on stderr at exit")
    ready = r["ready"]
    if not ready["ring"]:
        problems.append("the loader had no ring at the event: the scenario missed the ring path")
    if ctx != "fork" and not persistent and not ready["spare"]:
        problems.append("no spare workers at the event: the scenario missed them")
    if (when == "mid" or persistent) and sorted(ready["workers_alive"]) != sorted(ready["workers"]):
        problems.append(f"workers not all alive at the event: {ready}")
    left = [p for p, t in r["gone_s"].items() if t is None]
    if left:
        problems.append(
            f"processes still alive {GONE_S} s after the main process exited: "
            f"{left} (workers {ready['workers']})"
        )
    if r["new_segments"] or r["any_new_segments"]:
        problems.append(f"left in /dev/shm: {r['new_segments'] or r['any_new_segments']}")
    assert not problems, "; ".join(problems) + f" (exit after {r['exit_s']} s)" + _output(r)


@pytest.mark.slow
@pytest.mark.parametrize("ctx, persistent, fault", _worker_matrix())
def test_worker_fails(scenarios, ctx, persistent, fault):
    r = scenarios.result(("worker", ctx, persistent, fault))
    events = {e["event"]: e for e in _events(r["out"])}
    error = events.get("error")
    _report(
        dict(
            r,
            error=error and {k: error[k] for k in ("type", "elapsed_s", "victim")},
            next_epoch=events.get("next_epoch"),
            final=events.get("final"),
        )
    )
    assert "failure" not in r, r.get("failure", "") + _output(r)
    assert "workers" in events, "the driver did not start its workers" + _output(r)

    problems = []
    if error is None:
        problems.append(f"no error raised: {events.get('no_error')}")
    elif fault in DEATHS:
        if error["type"] != "WorkerDied":
            problems.append(f"raised {error['type']}, not WorkerDied")
        for part in (f"pid {error['victim']}", DEATHS[fault]):
            if part not in error["message"]:
                problems.append(f"the error does not say {part!r}: {error['message']!r}")
    else:
        kind, text = EXCEPTIONS[fault]
        if error["type"] != kind:
            problems.append(
                f"raised {error['type']}, not the worker's {kind}: {error['message'][:300]!r}"
            )
        for part in (text, f"Caught {kind} in DataLoader worker process 1", "Original Traceback"):
            if part not in error["message"]:
                problems.append(f"the error does not say {part!r}")
    if error is not None and error["elapsed_s"] is None:
        problems.append("the fault's time was not found: the fault never fired")
    if fault in DEATHS and events.get("workers_gone", {}).get("left") != []:
        problems.append(f"workers alive {GONE_S} s after the error: {events.get('workers_gone')}")
    if fault == "getitem" and error is not None:
        rest = events.get("rest_of_epoch", {})
        if rest.get("batches") != BATCHES - 12 or rest.get("errors"):
            problems.append(f"rest of the epoch after the error: {rest}")
    nxt = events.get("next_epoch", {})
    if nxt.get("batches") != BATCHES or nxt.get("errors"):
        problems.append(f"next epoch not whole: {nxt}")
    if events.get("all_gone", {}).get("left") != []:
        problems.append(
            f"workers alive {GONE_S} s after the loader was deleted: {events.get('all_gone')}"
        )
    final = events.get("final")
    if final is None:
        problems.append("the driver did not finish")
    else:
        if final["fds_after"] > final["fds_before"]:
            problems.append(f"open fds grew: {final['fds_before']} -> {final['fds_after']}")
        if final["children_after"] != final["children_before"]:
            problems.append(f"children {final['children_before']} -> {final['children_after']}")
        if final["new_segments"]:
            problems.append(f"left in /dev/shm: {final['new_segments']}")
    if r["status"] != 0:
        problems.append(f"driver exit status {r['status']}")
    if r["new_segments"] or r["any_new_segments"]:
        problems.append(f"left in /dev/shm: {r['new_segments'] or r['any_new_segments']}")
    assert not problems, "; ".join(problems) + _output(r)

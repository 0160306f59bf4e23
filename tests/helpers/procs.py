"""Processes in the tests: what the failure and churn tests look at, read from /proc and
/dev/shm; hard time limits; a job run in a session of its own; a free port for a rendezvous;
a caught loader error let go of at once."""

import faulthandler
import os
import signal
import time

# A loader that deadlocks must fail the run, not hang it: conftest's guard dumps every
# thread's stack and exits after this long in one test (see rearm_hang_guard).
HANG_TIMEOUT_S = float(os.environ.get("SHMLOADER_TEST_HANG_TIMEOUT", "240"))


def rearm_hang_guard(seconds: float = HANG_TIMEOUT_S) -> None:
    """Restart conftest's hang guard: `seconds` from now.  A long test calls it as it makes
    progress (each sample of a churn run, each hypothesis example), so that the guard bounds
    a stall, not the whole test's time on a loaded machine."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def forget(e: BaseException) -> None:
    """Drop a caught loader error's traceback, for either loader.  The traceback holds the
    iterator's frames, and torch's re-raise holds the error (a cycle): left to the cyclic GC,
    the iterator is finalized at some later moment, inside a later loader's freshly forked
    worker, or after the GC has finalized its queues first, so that torch's __del__ then
    waits 5 s per worker for workers its stop message never reaches (seconds of a later
    test).  Test harness hygiene: nothing is asserted of it."""
    e.__traceback__ = None


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited, only its status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids, limit: float):
    """(sorted pids still alive after up to `limit` s, seconds waited)."""
    start = time.monotonic()
    while time.monotonic() - start < limit and any(alive(p) for p in pids):
        time.sleep(0.02)
    return sorted(p for p in pids if alive(p)), round(time.monotonic() - start, 3)


def wait_until(predicate, limit: float, what: str):
    """Poll `predicate` until it returns something true (returned), for up to `limit` s,
    else fail naming `what`: for a state other processes reach in their own time (a
    quiet point: workers done prefetching, a process gone).  Limits are generous, for a
    loaded 2-core machine, and still fail a real hang."""
    start = time.monotonic()
    while not (value := predicate()):
        if time.monotonic() - start > limit:
            raise AssertionError(f"not within {limit} s: {what}")
        time.sleep(0.01)
    return value


def preload_library(folder, name: str, source: str) -> str:
    """Build C `source` into `folder`/`name`.so, for LD_PRELOAD: to make a libc call fail
    as it does on machines this one is not (a full /dev/shm, a kernel or seccomp filter
    that refuses memfd_create)."""
    import subprocess

    path = os.path.join(folder, name)
    with open(path + ".c", "w") as f:
        f.write(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", path + ".so", path + ".c"], check=True)
    return path + ".so"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _live_children():
    """(pid, command line) of this process's live children (not zombies)."""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[1] == me and fields[0] != "Z":
            yield int(pid), cmdline


def own_children():
    """This process's live children, less multiprocessing's long-lived helpers
    (the forkserver and the resource tracker start once and stay)."""
    return sorted(
        pid
        for pid, cmdline in _live_children()
        if b"forkserver" not in cmdline and b"resource_tracker" not in cmdline
    )


def shmloader_servers():
    """This process's children that are servers of shmloader's (the workers
    forked from them are the servers' children, not its)."""
    return sorted(
        pid
        for pid, cmdline in _live_children()
        if b"forkserver import main" in cmdline and b"_worker._loop" in cmdline
    )


def our_segments():
    """Entries of ours in /dev/shm (there should never be any)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("shmloader"))


class Hang(Exception):
    pass


class deadline:
    """Raise Hang in the main thread after `seconds`: a deadlocked or spinning loader then
    fails its own test instead of tripping conftest's whole-run hang guard."""

    def __init__(self, seconds):
        self.seconds = seconds

    def _fire(self, signum, frame):
        raise Hang(f"no progress within {self.seconds} s (deadlock or busy loop)")

    def __enter__(self):
        self._old = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._old)
        return False


def describe_stuck(pids) -> str:
    """What processes that should have exited are doing: state, kernel wait channel and,
    where py-spy is installed, their Python stacks (for a failure message)."""
    import shutil
    import subprocess

    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
        except OSError as e:
            out.append(f"pid {pid}: {e}")
            continue
        out.append(f"pid {pid}: state {state}, waiting in {wchan}")
        if shutil.which("py-spy"):
            dump = subprocess.run(
                ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            out.append(dump.stdout + dump.stderr)
    return "\n".join(out)


def run_job(command, limit: float, **kwargs):
    """subprocess.run(command) in a session of its own, output (stderr too) captured:
    past `limit` s the whole session (a launcher, its ranks, their workers) is killed and
    the test fails, never hangs; whatever of the session outlives the command is killed."""
    import subprocess

    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{command} did not end within {limit} s:\n{output[-4000:]}") from None
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # stragglers left in its session
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(command, process.returncode, output)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Failures and cleanup (docs/design.md, contract 5): worker errors and deaths,
timeouts, and that no worker or segment outlives the loader however the main
process ends.  Anything that could hang runs under a hard timeout."""

import contextlib
import functools
import gc
import os
import pickle
import re
import resource
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader, WorkerDied
from shmloader._main import _torch_api
from shmloader._main._pool import reap_leaving
from shmloader._shm._ring import CLAIMED
from tests.helpers import ROOT
from tests.helpers.datasets import Dying, EnvironMark, Failing, Images, PickleCounted, Sleepy
from tests.helpers.procs import (
    alive,
    deadline,
    describe_stuck,
    open_fds,
    our_segments,
    own_children,
    rearm_hang_guard,
    shmloader_servers,
    wait_gone,
    wait_until,
)

# Slots held by batches are what these tests are about: small leaves stay views.
pytestmark = pytest.mark.usefixtures("views_only")

# Seconds after which a wait counts as hung (a bound on hangs, generous: a subprocess
# importing torch takes tens of seconds on a loaded 2-core machine).
HANG = 120


@pytest.mark.slow
@pytest.mark.parametrize("how", ["delete", "break", "exhaust", "exception"])
def test_workers_gone_and_nothing_left(how):
    fds = open_fds()
    loader = DataLoader(Images(64), batch_size=4, num_workers=2)
    it = iter(loader)
    pids = it._pool.pids
    next(it)
    if how == "delete":
        del it
    elif how == "break":
        for batch in it:
            break
        del it, batch  # a batch of torch's transport keeps its fd open
    elif how == "exhaust":
        list(it)
        del it  # an exhausted iterator still refers to the loader's ring
    else:

        def consume():
            for i, _ in enumerate(it):
                if i == 3:
                    raise KeyError("user code failed")

        with pytest.raises(KeyError) as info:
            consume()
        del it, info  # the traceback holds consume's frame and its batch
    gc.collect()
    assert wait_gone(pids, HANG)[0] == []
    assert our_segments() == []
    del loader  # it keeps its ring (two fds) for its next iterator
    gc.collect()
    assert open_fds() <= fds


@pytest.mark.slow
def test_persistent_workers_gone_when_loader_deleted():
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, persistent_workers=True)
    for _ in range(2):
        list(loader)
    pids = loader._iterator._pool.pids
    del loader
    gc.collect()
    assert wait_gone(pids, HANG)[0] == []
    assert our_segments() == []


@pytest.mark.slow
def test_kept_batches_outlive_loader_unchanged():
    loader = DataLoader(Images(40), batch_size=4, num_workers=2, slot_bytes=1 << 16)
    kept = list(loader)
    expected = [torch.stack([Images(40)[i] for i in range(b * 4, b * 4 + 4)]) for b in range(10)]
    del loader
    gc.collect()
    for got, want in zip(kept, expected):
        assert torch.equal(got, want)


def _report_first_batch(batch, go, answer):
    """In a forked child: once the parent has moved on, send back what `batch` holds."""
    go.wait(HANG)
    answer.put(batch[0].tolist())  # plain values: no shared memory between the two


def test_child_forked_while_batch_held_keeps_it():
    """A child forked while the training process holds a batch keeps that batch, as with
    torch's shared memory, while the parent drops it and its slot is refilled; and the
    parent's own later batches (through that slot, mapped back) are right."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    loader = DataLoader(Images(48), batch_size=4, num_workers=2, slot_bytes=1 << 16, num_slots=4)
    it = iter(loader)
    batch = [next(it)]
    want = batch[0].clone()
    go, answer = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_report_first_batch, args=(batch, go, answer))
    child.start()
    del batch
    rest = list(it)  # 11 batches through 4 slots: the held batch's slot is reused
    go.set()
    seen = answer.get(timeout=HANG)
    child.join(HANG)
    assert child.exitcode == 0
    assert seen == want.tolist(), "the child's batch changed when the parent moved on"
    images = Images(48)
    for b, got in enumerate(rest, 1):
        assert torch.equal(got, torch.stack([images[i] for i in range(b * 4, b * 4 + 4)])), b


def _expected_batches(n, batch_size=4):
    images = Images(n)
    return [
        torch.stack([images[i] for i in range(b, b + batch_size)]).tolist()
        for b in range(0, n, batch_size)
    ]


def _in_forked_child(work):
    """Start work() in a child forked now, which exits without running the parent's
    atexit handlers; returns a function that waits for the child and returns what
    work() returned, or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = ("ok", work())
        except BaseException as e:
            result = ("error", repr(e))
        os.write(write, pickle.dumps(result))
        os._exit(0)
    os.close(write)

    def result():
        with os.fdopen(read, "rb") as answer:
            if not select.select([answer], [], [], HANG)[0]:
                os.kill(pid, signal.SIGKILL)
            data = answer.read()
        os.waitpid(pid, 0)
        return pickle.loads(data) if data else ("hung", None)

    return result


@pytest.mark.slow
def test_forked_child_dropping_its_loader_leaves_the_parents_batches():
    """A child forked between epochs (to save a checkpoint, say) that drops its copy of
    the loader must not touch the ring the parent's next epoch fills: torch's parent
    gets every batch."""
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, timeout=HANG)
    for _ in loader:  # the loader keeps its ring for the next epoch
        pass
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # the parent's workers have published batches by now
        del loader
        gc.collect()
        os._exit(0)
    os.close(go_read)
    it = iter(loader)
    got = [next(it).tolist()]
    ring = it._ring  # the batches in flight are published (no slot left CLAIMED): they wait
    wait_until(
        lambda: CLAIMED not in map(ring.slot_state, range(ring.nslots)),
        HANG,
        "the batches in flight published",
    )
    os.write(go_write, b"x")
    os.waitpid(pid, 0)
    got += [batch.tolist() for batch in it]
    assert got == _expected_batches(32)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["non_persistent", "persistent"])
def test_forked_child_iterating_its_loader_uses_workers_of_its_own(persistent):
    """A child forked between epochs that iterates its copy of the loader gets every
    batch from workers and a ring of its own, while the parent's next epoch runs."""
    loader = DataLoader(
        Images(64), batch_size=4, num_workers=2, timeout=HANG, persistent_workers=persistent
    )
    for _ in loader:  # the loader keeps its ring, or its iterator, for the next epoch
        pass
    child = _in_forked_child(lambda: [batch.tolist() for batch in loader])
    parent = [batch.tolist() for batch in loader]
    assert child() == ("ok", _expected_batches(64))
    assert parent == _expected_batches(64)


def test_forked_child_cannot_take_the_parents_batches_through_its_iterator():
    """A child that calls next() on an iterator it inherited mid-epoch gets a clear error
    instead of the parent's batches; the parent's epoch is whole."""
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, timeout=HANG)
    it = iter(loader)
    first = [next(it).tolist()]
    child = _in_forked_child(lambda: next(it))
    outcome, error = child()
    assert outcome == "error" and "made by the process this one was forked from" in error
    assert first + [batch.tolist() for batch in it] == _expected_batches(32)


def test_forked_child_numbers_its_epochs_as_the_parent_does():
    """A persistent loader that prefetched its next epoch, forked between epochs: the
    child's own iterator numbers that epoch as the parent's does (seed_per_sample's
    epoch, the state's epoch)."""
    loader = DataLoader(
        Images(16),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        prefetch_next_epoch=True,
        seed_per_sample=True,
    )
    for _ in loader:
        pass

    def epoch_then_state():
        for _ in loader:
            pass
        return loader._progress.epoch, loader.state_dict()["epoch"]

    child = _in_forked_child(epoch_then_state)
    assert child() == ("ok", (1, 2))
    assert epoch_then_state() == (1, 2)


class _Zeros(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.zeros(2 << 20)  # 8 MiB


def test_own_workers_keep_the_batches_held_when_forked():
    """A dataset that keeps earlier batches of its own loader (a replay buffer): the next
    epoch's workers are forked while the parent holds them, and keep them while the parent
    drops them and the loader refills their slots, as torch's workers keep theirs."""
    holder = []
    loader = DataLoader(
        _ReplayImages(holder), batch_size=4, num_workers=2, slot_bytes=1 << 16, num_slots=6
    )
    holder += [batch for i, batch in enumerate(loader) if 2 <= i < 6]
    want = [int(batch.sum()) for batch in holder]
    it = iter(loader)  # the workers are forked holding the buffer
    holder.clear()
    got = [batch[:, 1].tolist() for batch in it]
    assert [s for batch in got for s in batch] == [want[i % 4] for i in range(48)]


@pytest.mark.slow
def test_fork_while_a_thread_writes_a_held_batch_loses_no_write():
    """Before a fork the held slots become private memory. A thread that writes the batch
    meanwhile (torch lets go of the GIL in its kernels) must find every write it made in the
    parent's batch: none may land in shared pages already copied and then swapped out."""
    import threading

    loader = DataLoader(
        _Zeros(),
        batch_size=4,
        num_workers=1,
        prefetch_factor=1,
        num_slots=3,
        persistent_workers=True,
    )
    it = iter(loader)
    for trial in range(4):
        batch = next(it)
        started = threading.Event()

        def add_ones():
            started.set()
            for _ in range(40):
                batch.add_(1)  # noqa: F821  (bound by the loop around add_ones)

        writer = threading.Thread(target=add_ones)
        writer.start()
        started.wait()
        while writer.is_alive() and batch[0, 0] == 0:  # into the writes: the first has begun
            time.sleep(0)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        writer.join()
        assert batch.min() == batch.max() == 40, f"trial {trial}: in-place writes were lost"
        del batch


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_batch_kept_after_its_loader_is_gone_keeps_only_its_slot(persistent):
    """A batch kept past its loader (one logged batch of a validation loader) keeps its own
    slot's memory in /dev/shm, as a torch batch keeps its own, not the whole ring's; once it
    goes, that memory goes too. (A persistent loader's iterator gives the ring up when it
    goes, with the loader.)"""
    gc.collect()
    fds_before = open_fds()
    loader = DataLoader(
        Images(16, shape=(1024, 1024)), batch_size=2, num_workers=2, persistent_workers=persistent
    )
    for i, batch in enumerate(loader):
        if i == 6:  # past the batches that size the ring
            kept = batch[0, :4]
    ring = loader._iterator._ring if persistent else loader._ring_handover.spare_ring
    ring.reserve_all()  # what the background reservation does soon after the first batches

    def allocated():
        return os.fstat(ring.fds[0]).st_blocks * 512

    assert allocated() >= ring.nslots * ring.slot_bytes
    del loader, batch
    gc.collect()
    assert allocated() < 2 * ring.slot_bytes, "the loader's free slots kept their memory"
    assert open_fds() == fds_before + 1, "the kept batch holds more than the segment fd"
    del kept
    gc.collect()
    assert allocated() < ring.slot_bytes


class _ReplayImages(torch.utils.data.Dataset):
    """Images(48) until `holder` (a list of batches) has some; then item i is (i, the sum of
    batch i % len(holder))."""

    def __init__(self, holder):
        self.holder = holder
        self.images = Images(48)

    def __len__(self):
        return 48

    def __getitem__(self, i):
        if self.holder:
            return torch.tensor([i, int(self.holder[i % len(self.holder)].sum())])
        return self.images[i]


class _Cached(torch.utils.data.Dataset):
    """Items are copies of the batches in `holder` (a list), read in the worker."""

    def __init__(self, holder):
        self.holder = holder

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.holder[i].clone()


def test_other_loaders_workers_keep_the_batches_held_when_forked():
    """Loader B's workers are forked while the training process holds batches of loader A
    (a cache B's dataset reads). They keep those batches, as torch's shared memory would,
    while the parent drops them and A refills their slots."""
    a = DataLoader(
        Images(48),
        batch_size=4,
        num_workers=2,
        slot_bytes=1 << 16,
        num_slots=4,
        persistent_workers=True,
    )
    it = iter(a)
    holder = [next(it), next(it)]
    want = [batch.clone() for batch in holder]
    del it
    b = DataLoader(_Cached(holder), batch_size=None, num_workers=1, persistent_workers=True)
    assert all(torch.equal(x, y) for x, y in zip(b, want))  # B's worker is forked here
    holder.clear()
    for _ in range(2):
        for _ in a:  # 12 batches an epoch through A's 4 slots
            pass
    got = list(b)
    assert all(torch.equal(x, y) for x, y in zip(got, want)), "B's worker saw A's later batches"


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_worker_exception_reraised_and_next_epoch_works(context):
    loader = DataLoader(
        Failing(24, bad=9),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=True,
    )
    for _ in range(2):
        seen = []
        it = iter(loader)
        while True:
            try:
                seen.append(next(it)[0].item())
            except StopIteration:
                break
            except ValueError as e:
                assert "sample 9 is broken" in str(e)
                assert "Caught ValueError in DataLoader worker process 0" in str(e)
                assert "Original Traceback" in str(e)
                seen.append("error")
        assert seen == [0, 4, "error", 12, 16, 20]


def test_a_finished_non_persistent_iterator_kept_has_no_workers():
    """torch's iterator ends its workers when its epoch ends, whether or not the loop keeps
    the iterator: so must shmloader's (their processes, and the ring they map)."""
    loader = DataLoader(Images(16), batch_size=4, num_workers=2)
    it = iter(loader)
    workers = set(it._pool.pids)  # (a forkserver's children, not this process's, under it)
    assert len(workers) == 2
    assert len(list(it)) == 4
    assert wait_gone(list(workers), HANG)[0] == [], describe_stuck(workers)
    del it


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM])
def test_worker_killed_by_signal_names_pid_and_signal(signum):
    loader = DataLoader(Dying(64, at=20, signum=int(signum)), batch_size=2, num_workers=2)
    with pytest.raises(WorkerDied) as e:
        for _ in loader:
            pass
    message = str(e.value)
    # torch's SIGCHLD handler's words first (torch's own test_segfault matches them), then which
    # worker and signal
    assert re.match(
        r"DataLoader worker \(pid \d+\) is killed by signal: "
        + re.escape(signal.strsignal(signum))
        + r"\. ",
        message,
    ), message
    assert f"by {signum.name};" in message, message


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_worker_whose_pipes_break_before_it_dies_is_named_dead(start_method):
    """A pipe to a dead worker breaks (a task's write fails with EPIPE, its results end)
    before its exit shows: a forkserver's worker's once the server has reaped it.  The error
    is still the worker's death, in torch's words, not the broken pipe."""
    dataset = Dying(64, at=20, signum=int(signal.SIGKILL), linger=2.0)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context=start_method)
    with pytest.raises(WorkerDied, match=r"^DataLoader worker \(pid \d+\) is killed by signal: "):
        list(loader)


def test_worker_exit_names_exit_code():
    loader = DataLoader(Dying(64, at=20, signum=0), batch_size=2, num_workers=2)
    with pytest.raises(
        WorkerDied,
        match=r"^DataLoader worker \(pid \d+\) exited unexpectedly "
        r"with exit code 1\. Details are lost",
    ):
        list(loader)


def test_worker_exit_with_code_0_reads_as_torchs():
    """A worker that ends with exit code 0 mid-epoch (os._exit(0), a SystemExit(0)) has no
    code to name: torch's SIGCHLD handler passes it over and its watchdog says "DataLoader
    worker (pid(s) N) exited unexpectedly", and so does shmloader, without "exit code 0.
    Details are lost".  (Not compared with a run of torch's: under forkserver its loader may
    first fail reading the dead worker's queue, an EOFError, as the timing falls.)"""
    loader = DataLoader(Dying(64, at=20, signum=0, code=0), batch_size=2, num_workers=2)
    with pytest.raises(
        WorkerDied, match=r"^DataLoader worker \(pid \d+\) exited unexpectedly \(worker "
    ):
        list(loader)


def _open_few_more_files(room, worker_id):
    """worker_init_fn: this worker can open `room` more files (its fd limit is its lowest
    free fd number plus that)."""
    import resource

    lowest_free = os.dup(0)
    os.close(lowest_free)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free + room, hard))


@pytest.mark.parametrize("room", [0, 1])
def test_worker_out_of_file_descriptors_is_named(room):
    """A worker that has no room for the ring's fds (too many open files: none at all, or
    too few for the two fds, which the kernel then drops) exits, and the main process says
    so and what to do, instead of a bare exit code."""
    loader = DataLoader(
        Images(8),
        batch_size=2,
        num_workers=2,
        slot_bytes=1 << 16,
        worker_init_fn=functools.partial(_open_few_more_files, room),
    )
    with pytest.raises(
        WorkerDied, match=r"could not receive the ring's file descriptors.*ulimit -n"
    ):
        list(loader)


def test_worker_death_then_new_epoch_works():
    loader = DataLoader(
        Dying(64, at=20, signum=int(signal.SIGKILL)),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
    )
    it = iter(loader)
    with pytest.raises(WorkerDied):
        list(it)
    # The iterator stays ended, saying why, on every later next() (torch's goes on timing
    # out or raising for the dead worker).
    for _ in range(2):
        with pytest.raises(WorkerDied, match=r"iterator ended when a worker died: .*SIGKILL"):
            next(it)
    loader.dataset.at = -1  # the fresh workers of the next epoch do not die
    assert len(list(loader)) == 32


@pytest.mark.slow
def test_timeout_raises_like_torch():
    # No batch ever comes within the timeout (the shutdown terminates the sleeping workers).
    loader = DataLoader(Sleepy(8, seconds=600), batch_size=2, num_workers=2, timeout=0.3)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
        next(iter(loader))


@pytest.mark.slow
def test_many_iterators_do_not_grow_fds_or_children():
    loader = DataLoader(Images(16), batch_size=4, num_workers=2)
    list(loader)  # sizes the ring, which the loader then keeps
    list(loader)  # (spawn, forkserver: starts the spare workers the loader then keeps)
    loader._spare_workers._own()  # (their start, in a thread, over: both counts see it done)
    gc.collect()
    fds = open_fds()
    for _ in range(5):
        it = iter(loader)
        next(it)
        del it
    loader._spare_workers._own()
    gc.collect()
    assert open_fds() <= fds
    assert our_segments() == []


def test_pipe_ends_finalized_first_leave_the_files_that_reuse_their_numbers(tmp_path):
    """The garbage collector may finalize the workers' pipe ends before the iterator (a
    re-raised worker error's traceback puts them in one reference cycle), and a thread may
    open files under their numbers meanwhile: the iterator's shutdown then neither writes
    to those files nor closes them, and the workers still go."""
    loader = DataLoader(Images(16), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    pool = it._pool
    reused = []
    for k, conn in enumerate(pool._tasks + pool._results):
        number = conn.fileno()
        conn.__del__()  # as the collector may, before the iterator's __del__
        path = tmp_path / f"file{k}"
        other = os.open(path, os.O_RDWR | os.O_CREAT)
        if other != number:  # another thread's file, under the freed number
            os.dup2(other, number)
            os.close(other)
        reused.append((number, path))
    it._shutdown_workers()
    try:
        for number, path in reused:
            assert os.readlink(f"/proc/self/fd/{number}") == str(path), "closed"
            assert path.stat().st_size == 0, "written to"
        assert wait_gone(pool.pids, HANG)[0] == []
    finally:
        for number, _ in reused:
            os.close(number)


# ---- the main process ends abruptly: a separate process we kill ----

MAIN_SCRIPT = textwrap.dedent("""
    import multiprocessing.util, sys, time
    from shmloader import DataLoader
    from tests.helpers.datasets import WorkerTempDirs
    loader = DataLoader(WorkerTempDirs(10**6), batch_size=4, num_workers=2,
                        persistent_workers=True, multiprocessing_context=sys.argv[1])
    it = iter(loader)
    worker_dirs = {next(it)[1][0] for _ in range(2)}  # batch k is worker k % 2's
    print(" ".join(map(str, it._pool.pids)), flush=True)
    # The temp dirs workers made (not inherited from this process: forkserver's).
    print(" ".join(worker_dirs - {multiprocessing.util.get_temp_dir()}), flush=True)
    for _ in it:
        time.sleep(0.01)
""")


@contextlib.contextmanager
def main_process(script, *args):
    """A training process running `script`, which prints its workers' pids first: yields
    (the process, those pids); it is killed at the end if still there."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        yield proc, [int(p) for p in line.split()]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.one_mode  # names its start method; what a kill leaves behind
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_main_process_killed_workers_exit(context, signum):
    with main_process(MAIN_SCRIPT, context) as (proc, pids):
        worker_dirs = proc.stdout.readline().split()
        os.kill(proc.pid, signum)
        proc.wait(HANG)
    left = wait_gone(pids, HANG)[0]
    assert left == [], describe_stuck(left)
    assert our_segments() == []
    if signum != signal.SIGINT:  # SIGINT: the main process exits, and multiprocessing's exit
        # handlers terminate its workers (torch's handler exits them at once, dirs left)
        assert [d for d in worker_dirs if os.path.exists(d)] == []


SIGCHLD_IGNORED_SCRIPT = textwrap.dedent("""
    import signal
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # as servers do, to have children reaped
    from shmloader import DataLoader
    from tests.helpers.datasets import Images
    loader = DataLoader(Images(32), batch_size=4, num_workers=2)
    print([sum(1 for _ in loader) for _ in range(3)], flush=True)
""")


@pytest.mark.slow
def test_ignored_sigchld_leaves_every_epoch_whole_like_torch():
    """A process that ignores SIGCHLD: torch's iterator puts its own SIGCHLD handler in
    place, so exited workers can be waited for; every epoch ends cleanly."""
    done = subprocess.run(
        [sys.executable, "-c", SIGCHLD_IGNORED_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[8, 8, 8]"), done.stderr
    assert "Traceback" not in done.stderr


LIMITED_SCRIPT = textwrap.dedent("""
    import os, resource, sys, torch
    from shmloader import DataLoader
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 96
        def __getitem__(self, i):
            x = torch.full((3, 16, 16), float(i))
            return {"a": x, "b": x[0].clone(), "c": torch.arange(5000.0), "y": i}
    if sys.argv[1] == "files":
        kw, keep = {}, 0
    else:  # an address space too small for a ring of 8 slots of 100 MiB
        size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (300 << 20), resource.RLIM_INFINITY))
        kw, keep = dict(slot_bytes=100 << 20, num_slots=8), 0
    kept = []
    try:
        it = iter(DataLoader(Dicts(), batch_size=4, num_workers=3, **kw))
        if sys.argv[1] == "files":
            # No file left to receive the fds of the first batches' one-off segments.
            limit = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for batch in it:
            kept = (kept + [batch])[:keep]
    except Exception as e:
        print(type(e).__name__, e, flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["files", "address_space"])
def test_resource_limits_give_errors_that_name_them(limit):
    """Too few open files (batches outside the ring bring their segment's fds) or too
    little address space (for the ring): the error names the limit to raise, as torch's
    does for files,
    never an internal message ("received 0 items of ancdata")."""
    done = subprocess.run(
        [sys.executable, "-c", LIMITED_SCRIPT, limit],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    out = done.stdout
    if limit == "files":
        assert "Too many open files" in out or "RLIMIT_NOFILE" in out, (out, done.stderr)
        assert "ancdata" not in out
    else:
        assert out.startswith("SharedMemoryError") and "RLIMIT_AS" in out, (out, done.stderr)


def test_a_worker_that_cannot_map_the_ring_names_the_address_space_limit():
    from shmloader._main._pool import _exit_description
    from shmloader._worker._protocol import NO_RING_MAPPING_EXIT

    class Exited:
        exitcode = NO_RING_MAPPING_EXIT

    assert "could not map the ring" in _exit_description(Exited())
    assert "RLIMIT_AS, `ulimit -v`" in _exit_description(Exited())


WATCHED_SCRIPT = textwrap.dedent("""
    import os, resource, sys
    from shmloader import DataLoader
    from tests.helpers.datasets import Sleepy
    class Busy(Sleepy):
        def __getitem__(self, i):
            # (in the worker, its watchdog started) One write: under PYTHONUNBUFFERED,
            # print() writes the word and the newline apart, and two workers' could interleave.
            os.write(2, b"busy\\n")
            return super().__getitem__(i)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    files = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    # (Busy lives in this script's __main__: workers forked, as the test is about)
    it = iter(DataLoader(Busy(8, seconds=120), batch_size=2, num_workers=2,
                         multiprocessing_context="fork"))
    print(" ".join(map(str, it._pool.pids)), flush=True)
    next(it)
""")


@pytest.mark.slow
def test_workers_leave_a_main_process_with_many_files_open_when_it_dies():
    """A worker forked from a process with more than 1024 files open watches it through an
    fd above select()'s limit; busy in __getitem__ when the process is killed, it leaves
    at once all the same, and says nothing."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("needs a hard RLIMIT_NOFILE of 1200 or more")
    with main_process(WATCHED_SCRIPT) as (proc, pids):
        busy = 0
        while busy < len(pids):  # every worker is in __getitem__
            line = proc.stderr.readline()
            assert line, "the script ended before its workers were busy"
            busy += line.strip() == "busy"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(HANG)
    left = wait_gone(pids, HANG)[0]
    assert left == [], describe_stuck(left)
    assert "Traceback" not in proc.stderr.read()


class _Unpicklable(Images):
    def __init__(self, n):
        super().__init__(n)
        self.transform = lambda x: x  # lambdas cannot be pickled for spawn


class _HandleError(TypeError):
    def __init__(self, what, reason):
        super().__init__(f"cannot pickle {what}: {reason}")


class _HoldsAHandle(Images):
    def __reduce__(self):
        raise _HandleError(type(self).__name__, "holds a database handle")


def _torchs_pickle_warning():
    """Expects torch's warning as a worker's arguments fail to pickle, where the installed
    torch gives one (torch 2.6 gives none; test_equivalence compares warnings with torch's)."""
    if _torch_api.PICKLE_ERROR_WARNING is None:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match="Got pickle error when attempting to start a worker")


def test_unpicklable_dataset_raising_its_own_error_class_like_torch():
    """A pickling error whose class takes other arguments than a message arrives as torch
    raises it, with shmloader's advice as a note."""
    raised = []
    for cls in (tud.DataLoader, DataLoader):
        with pytest.raises(_HandleError) as e, _torchs_pickle_warning():
            iter(
                cls(_HoldsAHandle(8), batch_size=4, num_workers=2, multiprocessing_context="spawn")
            )
        raised.append(e.value)
    assert (
        str(raised[1]) == str(raised[0]) == "cannot pickle _HoldsAHandle: holds a database handle"
    )
    assert "multiprocessing_context='fork'" in raised[1].__notes__[0]


@pytest.mark.slow
@pytest.mark.one_mode  # names its start method; an error at start and what it leaves
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_unpicklable_dataset_is_clear_error_and_leaves_nothing(context):
    loader = DataLoader(
        _Unpicklable(8), batch_size=4, num_workers=2, multiprocessing_context=context
    )
    children = set(own_children())
    with (
        pytest.raises((TypeError, AttributeError, pickle.PicklingError)) as e,
        _torchs_pickle_warning(),
    ):
        iter(loader)  # torch's warning too, then the error
    message = str(e.value)
    assert "cannot be pickled" in message and f"multiprocessing_context={context!r}" in message
    assert "multiprocessing_context='fork'" in message
    gc.collect()
    assert wait_gone(list(set(own_children()) - children), HANG)[0] == []


INTERRUPTED_SHUTDOWN_SCRIPT = textwrap.dedent("""
    import os, signal, threading, time, sys
    import torch
    import {module} as lib
    from tests.helpers.procs import open_fds, own_children, wait_gone

    class SlowAfterFirstBatch(torch.utils.data.Dataset):
        def __init__(self, busy):
            self.busy = busy  # a pipe's write end, which the forked workers inherit
        def __len__(self):
            return 32
        def __getitem__(self, i):
            if i >= 4:
                os.write(self.busy, b"x")
                time.sleep(3)  # the shutdown waits for the worker to finish it
            return i

    busy_read, busy_write = os.pipe()
    fds = open_fds()
    loader = lib.DataLoader(SlowAfterFirstBatch(busy_write), batch_size=4, num_workers=2,
                            multiprocessing_context="fork")  # (workers inherit the pipe)
    it = iter(loader)
    next(it)
    os.read(busy_read, 1)  # a worker is in a slow sample (else its tasks are skipped at once)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C
    try:
        it._shutdown_workers()  # what the end of an epoch, `del it` or a break runs
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    left, _ = wait_gone(own_children(), 60.0)
    del it, loader
    print("workers left", len(left), "fds", open_fds() - fds, flush=True)
""")


@pytest.mark.slow
def test_ctrl_c_while_shutting_down_still_ends_the_workers():
    """As torch's shutdown (terminate in a finally): Ctrl-C while the shutdown waits for a
    worker busy in a slow sample still ends every worker, and closes their fds (torch
    leaves 4 open until its iterator is collected)."""
    outs = {}
    for module in ("torch.utils.data", "shmloader"):
        done = subprocess.run(
            [sys.executable, "-c", INTERRUPTED_SHUTDOWN_SCRIPT.format(module=module)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=HANG,
        )
        outs[module] = done.stdout.split()
        assert done.returncode == 0, done.stderr[-2000:]
    assert outs["torch.utils.data"][:4] == ["interrupted", "workers", "left", "0"], outs
    assert outs["shmloader"] == ["interrupted", "workers", "left", "0", "fds", "0"], outs


BACKGROUND_THREAD_AT_EXIT_SCRIPT = textwrap.dedent("""
    import queue, threading, time
    import torch
    import shmloader

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 400
        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.full((16,), float(i)), i

    loader = shmloader.DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True)
    batches = queue.Queue()

    def feed():  # a prefetching thread, as many training loops have
        while True:
            for batch in loader:
                batches.put(batch)

    threading.Thread(target=feed, daemon=True).start()
    for _ in range(3):
        batches.get()
    time.sleep(0.3)
    # The program returns while the thread waits in next().
""")


_TWO_THREADS = """
import threading
from shmloader import DataLoader


def one_round(errors, keep):
    first = DataLoader(list(range(8)), batch_size=2, num_workers=2)
    list(first)
    keep.append(first)  # its epoch is over, its workers left to exit; the loader lives on
    loaders = [DataLoader(list(range(10)), batch_size=2, num_workers=1) for _ in range(2)]
    barrier = threading.Barrier(2)

    def iterate(loader):
        barrier.wait()
        try:
            assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        except BaseException as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=iterate, args=(loader,)) for loader in loaders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a thread's loader hung"


if __name__ == "__main__":
    errors, keep = [], []
    for _ in range(6):
        one_round(errors, keep)
    print(errors)
"""


def test_loaders_starting_in_two_threads_at_once_each_start_cleanly(tmp_path):
    """Loaders iterated from threads (a validation loader in a thread of its own): after an
    epoch whose workers were left to exit, two threads start loaders at the same moment, and
    each start reaps the workers left before.  Both reaped the same ones ("process object is
    closed", in 2 to 5 rounds of 5), where torch's loader raises nothing."""
    script = tmp_path / "two_threads.py"
    script.write_text(_TWO_THREADS)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow
def test_a_background_thread_iterating_at_exit_leaves_multiprocessing_its_exit():
    """The main thread returns while a daemon thread iterates: multiprocessing's exit
    handler ends the workers; the thread's iterator must not close them under it (which
    made that handler fail: "process object is closed"), as torch's does not."""
    for _ in range(4):
        rearm_hang_guard()  # (a bound on each run: four take minutes on a loaded machine)
        done = subprocess.run(
            [sys.executable, "-c", BACKGROUND_THREAD_AT_EXIT_SCRIPT],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=HANG,
        )
        assert done.returncode == 0
        assert "atexit" not in done.stderr and "is closed" not in done.stderr, done.stderr


TRAINING_THREAD_OUTLIVING_MAIN_SCRIPT = textwrap.dedent("""
    import sys
    import threading
    import torch
    import shmloader
    from tests.helpers.procs import own_children, wait_until

    DataLoader = shmloader.DataLoader if sys.argv[1] == "shm" else torch.utils.data.DataLoader
    loader = DataLoader([torch.zeros(4)] * 64, batch_size=4, num_workers=2)

    def train():
        threading.main_thread().join()  # the main thread has returned
        for _ in range(3):
            batches = sum(1 for _ in loader)
            # (shmloader's workers exit as the epoch ends, not waited for: see
            # WorkerPool.leave_idle; the bound only fails a real leak)
            try:
                wait_until(lambda: not own_children(), 60, "the epoch's workers gone")
            except AssertionError:
                pass
            print(batches, len(own_children()), flush=True)

    threading.Thread(target=train).start()
""")


@pytest.mark.slow
def test_a_training_thread_outliving_the_main_thread_ends_each_epochs_workers():
    """A non-daemon thread that trains after the main thread returned: the interpreter is
    not exiting yet, so each epoch's workers are shut down as usual."""

    def train(loader):
        return subprocess.run(
            [sys.executable, "-c", TRAINING_THREAD_OUTLIVING_MAIN_SCRIPT, loader],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=HANG,
        )

    torchs, done = train("torch"), train("shm")
    assert done.returncode == 0, done.stderr[-2000:]
    # Some Pythons (3.12.1 here) refuse to fork once the main thread has returned: torch's
    # loader then fails the first epoch too, and shmloader's must fail as it does.
    refused = "RuntimeError: can't fork at interpreter shutdown"
    if refused in torchs.stderr:
        assert done.stdout == "" and refused in done.stderr, done.stderr[-2000:]
        return
    assert torchs.stdout.split()[::2] == ["16"] * 3, torchs.stderr[-2000:]
    assert done.stdout.split() == ["16", "0"] * 3, done.stdout


class _InterruptingBatchSampler(tud.Sampler):
    """Batches of 2 over range(n); the `at`-th draw of the first epoch raises a
    KeyboardInterrupt in the main process, as a Ctrl-C landing there would (the iterator
    draws while it hands a batch over, between taking it from its record and returning it)."""

    def __init__(self, n, at):
        self.n, self.at, self.epochs = n, at, 0

    def __iter__(self):
        first, self.epochs = self.epochs == 0, self.epochs + 1
        for i, start in enumerate(range(0, self.n, 2)):
            if first and i == self.at:
                raise KeyboardInterrupt
            yield [start, start + 1]

    def __len__(self):
        return self.n // 2


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("at", [1, 6])
def test_an_interrupted_next_ends_its_iterator_instead_of_losing_a_batch(persistent, at):
    """A caught KeyboardInterrupt that landed inside next() (at iter() for draw 1, mid-epoch
    for draw 6) leaves no iterator that goes on short of a batch: the next next() raises,
    saying why, and iter(loader) starts a whole epoch with fresh workers."""
    loader = DataLoader(
        list(range(20)),
        batch_sampler=_InterruptingBatchSampler(20, at),
        num_workers=2,
        persistent_workers=persistent,
    )
    got = []
    with pytest.raises(KeyboardInterrupt):
        it = iter(loader)
        for batch in it:
            got.append(batch.tolist())
    if at > 1:
        with pytest.raises(RuntimeError, match="KeyboardInterrupt interrupted its next()"):
            next(it)
    assert got == [[i, i + 1] for i in range(0, 2 * len(got), 2)]
    assert [b.tolist() for b in loader] == [[i, i + 1] for i in range(0, 20, 2)]
    del loader
    assert wait_gone(own_children(), HANG)[0] == []


def test_the_liveness_check_both_watchers_use(monkeypatch):
    """NOTE [worker: two watchers of the main process]: the inbox and the watchdog ask one
    check whether the main process lives; a pidfd where the kernel has them, else is_alive,
    which a process that is gone fails and one that lives (ours, or another user's) passes."""
    from shmloader._worker import _watch as _worker_watch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert _worker_watch.is_alive(os.getpid()) and _worker_watch.is_alive(1)
    assert not _worker_watch.is_alive(gone.pid)
    if hasattr(os, "pidfd_open"):
        fd = _worker_watch.open_pidfd(os.getpid())
        assert fd is not None
        os.close(fd)
        with pytest.raises(ProcessLookupError):
            _worker_watch.open_pidfd(gone.pid)
        monkeypatch.delattr(os, "pidfd_open")
    assert _worker_watch.open_pidfd(os.getpid()) is None


@pytest.mark.one_mode  # names its start method; how a worker's objects travel
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_objects_are_pickled_once_per_iterator_not_per_worker(context):
    """Issue 38: under spawn and forkserver the dataset (with collate_fn and
    worker_init_fn) is pickled once for all of an iterator's workers, which
    unpickle their own copies; what multiprocessing sends by fd (a tensor's
    shared storage, a SharedList, a Lock) still reaches every worker, and the
    batches are torch's.  torch pickles it once per worker."""
    torchs_dataset, ours = PickleCounted(), PickleCounted()
    PickleCounted.pickled = 0
    expected = list(
        tud.DataLoader(torchs_dataset, batch_size=4, num_workers=3, multiprocessing_context=context)
    )
    assert PickleCounted.pickled == 3  # torch's: one per worker
    PickleCounted.pickled = 0
    loader = DataLoader(ours, batch_size=4, num_workers=3, multiprocessing_context=context)
    fds = []
    for epoch in range(4):  # non-persistent: new workers, pickled again, once
        got = list(loader)
        assert [b.tolist() for b in got] == [b.tolist() for b in expected]
        assert PickleCounted.pickled == epoch + 1
        del got
        loader._spare_workers._own()  # (their start, in a thread, over)
        reap_leaving(wait=True)  # (the epoch's workers gone, not only told to go)
        fds.append(len(os.listdir("/proc/self/fd")))
    # (the ring stays the loader's, and from the second epoch on its spare workers) each
    # pickle's fds closed
    assert fds[2:] == fds[1:2] * 2


OWN_FORKSERVER_SCRIPT = textwrap.dedent("""
    import multiprocessing, sys
    from multiprocessing import forkserver
    from shmloader import DataLoader
    from shmloader._main import _forkserver
    from tests.helpers.datasets import ParentPid
    multiprocessing.set_forkserver_preload(["__main__", "json"])  # the user's own setting
    method = multiprocessing.get_start_method(allow_none=True)
    loader = DataLoader(ParentPid(8), batch_size=4, num_workers=2,
                        multiprocessing_context="forkserver", persistent_workers=True)
    parents = {int(p) for batch in loader for p in batch}
    server = _forkserver.own_server()._forkserver_pid
    assert parents == {server}, (parents, server)
    # (A module named besides __main__ is taken to import torch, and none names numpy.random:
    # only numpy's generator starts afresh in each worker, NOTE [forkserver: fresh generators].)
    assert _forkserver.own_server()._preload_modules == [
        "__main__", "json", "torch", "shmloader._worker._loop",
        "shmloader._worker._fresh_numpy_generator"]
    # The user's settings: as they left them; their forkserver never started.
    assert forkserver._forkserver._preload_modules == ["__main__", "json"]
    assert forkserver._forkserver._forkserver_pid is None
    # (As it was, or the platform's default where it was unset: torch's loader sets that too.)
    default = multiprocessing.get_all_start_methods()[0]
    assert multiprocessing.get_start_method(allow_none=True) in (method, method or default)
    with open(f"/proc/{server}/maps") as f:
        assert "libtorch" in f.read()  # imported once, in the server
    print(server, *loader._iterator._pool.pids, flush=True)
    sys.stdin.read()  # until killed
""")


def test_forkserver_workers_fork_from_shmloaders_server_which_has_torch():
    """Issue 38: under forkserver, workers fork from a server of shmloader's that
    imported torch and the worker loop once (no import per worker), preloading the
    user's own list too, without touching the user's forkserver or start method;
    after a SIGKILL of the main process the server and the workers are gone."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWN_FORKSERVER_SCRIPT],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and all(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    left = wait_gone(pids, HANG)[0]
    assert left == [], describe_stuck(left)


SPAWN_SERVER_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys
    import torch
    with open(os.environ["MARKS"], "a") as f:  # the main module's imports: where, as what
        f.write(f"{os.getpid()} {__name__}\\n")

    class Where(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.tensor([os.getpid(), os.getppid()])

    if __name__ == "__main__":
        import torch.utils.data as tud
        from shmloader import DataLoader
        from shmloader._main import _forkserver
        method = multiprocessing.get_start_method(allow_none=True)
        for cls in (tud.DataLoader, DataLoader):
            loader = cls(Where(), batch_size=4, num_workers=2, multiprocessing_context="spawn",
                         persistent_workers=True)
            rows = [r for batch in loader for r in batch.tolist()]
            print(*sorted({pid for pid, _ in rows}), "parents",
                  *sorted({parent for _, parent in rows}), flush=True)
        server = _forkserver.own_server("spawn")
        assert server._preload_modules == [
            "torch", "shmloader._worker._loop", "shmloader._worker._fresh_torch_generator",
            "shmloader._worker._fresh_numpy_generator"]
        with open(f"/proc/{server._forkserver_pid}/maps") as f:
            assert "libtorch" in f.read()  # imported once, in the server
        # (As it was, or the platform's default where it was unset: torch's loader sets that too.)
        default = multiprocessing.get_all_start_methods()[0]
        assert multiprocessing.get_start_method(allow_none=True) in (method, method or default)
        print(server._forkserver_pid, *loader._iterator._pool.pids, flush=True)
        sys.stdin.read()  # until killed
""")


def test_a_changing_environment_keeps_a_few_spawn_servers_not_one_per_change(monkeypatch):
    """A spawned worker has the environment of its start, so shmloader's spawn server is
    started again where os.environ changed; the one replaced lives while workers forked from
    it may, then stops.  A loop that sets a variable every epoch keeps a few servers, not one
    per epoch (each a process with torch imported: hundreds of MB)."""
    loader = DataLoader(Images(8), batch_size=4, num_workers=1, multiprocessing_context="spawn")
    seen = set()
    for epoch in range(6):
        monkeypatch.setenv("SHMLOADER_TEST_EPOCH", str(epoch))
        assert len(list(loader)) == 2
        servers = shmloader_servers()
        seen.update(servers)
    assert len(seen) >= 5, seen  # a server for (nearly) every environment
    assert len(servers) <= 3, servers


def test_a_replaced_spawn_server_stops_while_fork_workers_hold_its_pipes(monkeypatch):
    """Fork workers of another loader, started after a spawn server, inherit the pipe whose
    closing tells that server to exit: stopping it once replaced must not wait for that."""
    spawn = dict(batch_size=4, num_workers=1, multiprocessing_context="spawn")
    assert len(list(DataLoader(Images(8), **spawn))) == 2
    gc.collect()
    held = DataLoader(
        Images(8),
        batch_size=4,
        num_workers=1,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    for epoch in range(3):  # the first spawn server is replaced, then stopped
        monkeypatch.setenv("SHMLOADER_TEST_EPOCH", str(epoch))
        with deadline(HANG):
            assert len(list(held)) == 2
            assert len(list(DataLoader(Images(8), **spawn))) == 2
        gc.collect()


def test_spawn_workers_fork_from_a_clean_server_and_start_as_spawned_ones(tmp_path):
    """Issue 38: under spawn, workers fork from a server of shmloader's that imported
    torch and the worker loop once, and nothing of the user's; each then prepares
    itself as torch's spawned workers do, importing the user's main module afresh as
    __mp_main__; after a SIGKILL of the main process the server and workers are gone."""
    script, marks = tmp_path / "train.py", tmp_path / "marks"
    script.write_text(SPAWN_SERVER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env={**os.environ, "MARKS": str(marks), "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stdout.readline().split() for _ in range(3)]
        assert all(lines), proc.stderr.read()
        torchs, ours, pids = lines
        server, workers = int(pids[0]), [int(p) for p in pids[1:]]
        assert ours[ours.index("parents") + 1 :] == [str(server)]
        assert {int(p) for p in ours[: ours.index("parents")]} == set(workers)
        assert torchs[torchs.index("parents") + 1 :] == [str(proc.pid)]
        imported = [line.split() for line in marks.read_text().splitlines()]
        assert imported[0] == [str(proc.pid), "__main__"]
        # Once as __mp_main__ in each worker, torch's and shmloader's; never in the server.
        worker_pids = torchs[: torchs.index("parents")] + ours[: ours.index("parents")]
        assert sorted(imported[1:]) == sorted([pid, "__mp_main__"] for pid in worker_pids)
        assert all(alive(p) for p in [server, *workers])
    finally:
        proc.kill()
        proc.wait()
    left = wait_gone([server, *workers], HANG)[0]
    assert left == [], describe_stuck(left)


@pytest.mark.one_mode  # names its start method; the workers' environment
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_workers_have_the_environment_their_start_method_gives(monkeypatch, context):
    """A spawned worker has the environment of the moment it starts, as torch's do, though
    it forks from a server: a changed os.environ starts a new one.  A forkserver's workers
    have the server's, as under Python's own forkserver (and torch's loader)."""

    def marks(cls):
        loader = cls(EnvironMark(2), batch_size=2, num_workers=1, multiprocessing_context=context)
        return [b.tolist() for b in loader]

    got = {}
    for mark in ("1", "2"):
        monkeypatch.setenv("SHMLOADER_TEST_MARK", mark)
        got[mark] = marks(DataLoader), marks(tud.DataLoader)
    if context == "spawn":
        assert got == {"1": ([[1, 1]], [[1, 1]]), "2": ([[2, 2]], [[2, 2]])}
    else:  # (each loader's server started before this test, or with its first mark)
        assert got["1"][0] == got["2"][0] and got["1"][1] == got["2"][1]

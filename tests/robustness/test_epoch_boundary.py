"""Issue 38: what a non-persistent loader does around an epoch boundary so that the
next epoch's first batch comes soon, with each epoch still torch's.

- Its workers exit as soon as the epoch has nothing left for them, not at its end
  (NOTE [pool: finished workers] in shmloader/_main/_pool.py).
- Where it has more workers than cores less one, worker k sets up once worker
  k - (cores - 1) has answered its first task, or a bound after it got its config
  (NOTE [worker: start turns] in shmloader/_worker/_turns.py)."""

import os
import time

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset, get_worker_info

from shmloader import DataLoader
from shmloader._main import _pool
from tests.helpers.datasets import WorkerTrace
from tests.helpers.procs import alive, wait_gone

PID = -1  # WorkerTrace's pid column
METHODS = ["fork", "spawn", "forkserver"]


@pytest.mark.parametrize("context", METHODS)
def test_a_worker_exits_once_its_last_batch_is_taken_not_at_the_epochs_end(context):
    """2 workers, 4 batches: worker 0 makes batches 0 and 2, worker 1 batches 1 and 3.
    Once batch 2 is taken, worker 0 has nothing left and exits while batch 3 is still
    to come; worker 1 lives until its batch 3 is taken.  The batches are torch's."""
    kw = dict(batch_size=4, num_workers=2, multiprocessing_context=context)
    torch.manual_seed(0)
    theirs = torch.cat(list(tud.DataLoader(WorkerTrace(), **kw)))
    torch.manual_seed(0)
    it = iter(DataLoader(WorkerTrace(), **kw))
    first = [next(it) for _ in range(3)]
    worker0, worker1 = int(first[0][0, PID]), int(first[1][0, PID])
    assert wait_gone([worker0], 30.0)[0] == [], "worker 0 lived on with nothing left to do"
    assert alive(worker1), "worker 1 left before its last batch was taken"
    ours = torch.cat([*first, *it])
    assert torch.equal(ours[:, :PID], theirs[:, :PID])


@pytest.mark.parametrize("context", METHODS)
def test_persistent_workers_and_fetch_sample_keep_their_workers_to_the_end(context):
    """Persistent workers serve the next epoch; with fetch="sample" every worker may
    still write any slot until the epoch ends.  Neither lets a worker go early."""
    for kw in ({"persistent_workers": True}, {"fetch": "sample"}):
        it = iter(
            DataLoader(
                WorkerTrace(), batch_size=4, num_workers=2, multiprocessing_context=context, **kw
            )
        )
        first = [next(it) for _ in range(3)]
        time.sleep(0.5)  # (what an early exit would have taken; no time is asserted)
        assert all(alive(int(p)) for b in first for p in b[:, PID]), kw
        list(it)


# ---- start turns ------------------------------------------------------------------

_INIT: dict = {}


class FirstSampleMarks(Dataset):
    """Each worker's first sample takes a while, then leaves a mark (a file); each
    item says whether, when its worker's worker_init_fn ran, the worker before it in
    its turn had left its mark."""

    def __init__(self, folder, first_turn):
        self.folder = folder
        self.first_turn = first_turn

    def __len__(self):
        return 24

    def mark(self, worker_id):
        return os.path.join(self.folder, f"sampled-{worker_id}")

    def __getitem__(self, i):
        info = get_worker_info()
        if not os.path.exists(self.mark(info.id)):
            time.sleep(0.3)
            open(self.mark(info.id), "w").close()
        return torch.tensor([i, info.id, _INIT.get("after_its_turn", -1)])


def note_turn(worker_id):
    dataset = get_worker_info().dataset
    before = worker_id - dataset.first_turn
    _INIT["after_its_turn"] = int(before < 0 or os.path.exists(dataset.mark(before)))


@pytest.fixture
def two_cores():
    """This process on (at most) two cores, so that the first turn is one worker."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(cores)[:2])
    yield max(1, len(os.sched_getaffinity(0)) - 1)
    os.sched_setaffinity(0, cores)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_worker_sets_up_once_the_one_before_its_turn_has_answered(
    context, tmp_path, monkeypatch, two_cores
):
    """With a bound far longer than any set-up, every worker past the first turn runs
    worker_init_fn only after the worker before it made its first batch; the first
    samples take 0.3 s, so workers set up all at once would not see those marks.  The
    batches are torch's."""
    monkeypatch.setattr(_pool, "TURN_WAIT_S", 60.0)
    kw = dict(batch_size=2, num_workers=two_cores + 2, multiprocessing_context=context)
    ours = torch.cat(
        list(DataLoader(FirstSampleMarks(str(tmp_path), two_cores), worker_init_fn=note_turn, **kw))
    )
    assert ours[:, 2].tolist() == [1] * len(ours), "a worker set up before its turn"
    theirs = torch.cat(list(tud.DataLoader(FirstSampleMarks(str(tmp_path), two_cores), **kw)))
    assert torch.equal(ours[:, :2], theirs[:, :2])


class WaitsForTheNextWorker(Dataset):
    """Worker 0's first sample waits until worker 1 has run worker_init_fn: a worker
    waiting for worker 0's first batch without a bound would never start."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        if info.id == 0:
            while not os.path.exists(os.path.join(self.folder, "init-1")):
                time.sleep(0.01)
        return torch.tensor([i, info.id])


def touch_init(worker_id):
    open(os.path.join(get_worker_info().dataset.folder, f"init-{worker_id}"), "w").close()


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_worker_waits_for_its_turn_no_longer_than_the_bound(context, tmp_path, two_cores):
    """A first batch that waits (on I/O, on another worker) holds the next worker
    back by the bound at most (timeout: the loader's own error, not a hang)."""
    kw = dict(batch_size=2, num_workers=two_cores + 1, multiprocessing_context=context)
    ours = torch.cat(
        list(
            DataLoader(
                WaitsForTheNextWorker(str(tmp_path)), worker_init_fn=touch_init, timeout=60, **kw
            )
        )
    )
    theirs = torch.cat(
        list(tud.DataLoader(WaitsForTheNextWorker(str(tmp_path)), worker_init_fn=touch_init, **kw))
    )
    assert torch.equal(ours, theirs)

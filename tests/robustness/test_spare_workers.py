"""Issue 38: a non-persistent loader starts its next epoch's workers while an
epoch runs (spawn and forkserver, from its second epoch on; NOTE [pool:
configured after start] in shmloader/_main/_pool.py), and each epoch is still torch's: fresh processes,
the dataset as it is at iter(), torch's seeds, worker_init_fn and
get_worker_info().  Idle spare workers go with the loader (and, in
tests/robustness/test_kill_matrix.py, with a main process killed)."""

import copy
import gc
import os
import pickle
import signal

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader
from tests.helpers.datasets import WorkerTrace, mark_init_fn
from tests.helpers.procs import alive, wait_gone

PID = -1  # WorkerTrace's pid column
METHODS = ["fork", "spawn", "forkserver"]


def _epochs(make, context, epochs=3, before_epoch=None, **kw):
    """Each epoch's samples (WorkerTrace's rows), the dataset's epoch set before
    each iter(), as a training script's set_epoch does; before_epoch(loader,
    epoch), if given, runs before each iter() too."""
    dataset = WorkerTrace()
    torch.manual_seed(0)
    loader = make(
        dataset,
        batch_size=4,
        num_workers=2,
        shuffle=True,
        worker_init_fn=mark_init_fn,
        multiprocessing_context=context,
        **kw,
    )
    out = []
    for epoch in range(epochs):
        dataset.epoch = 10 + epoch
        if before_epoch is not None:
            before_epoch(loader, epoch)
        out.append(torch.cat(list(loader)))
    return torch.stack(out)


def _live_pids():
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def _worker_pids(batches):
    return {int(p) for b in batches for p in b[:, PID]}


@pytest.mark.parametrize("context", METHODS)
def test_epochs_of_a_non_persistent_loader_are_torchs(context):
    theirs = _epochs(tud.DataLoader, context)
    ours = _epochs(DataLoader, context)
    assert torch.equal(ours[..., :PID], theirs[..., :PID])
    pids = [set(epoch[:, PID].tolist()) for epoch in ours]
    assert all(len(p) == 2 for p in pids)
    assert pids[0].isdisjoint(pids[1]) and pids[1].isdisjoint(pids[2])  # fresh processes


@pytest.mark.parametrize("context", METHODS)
def test_next_epochs_workers_start_while_an_epoch_runs(context):
    """Under spawn and forkserver the next epoch's workers already run before its
    iter(), from the loader's second epoch on (its first iterator may be its only
    one); under fork they are forked at iter(), so that they see the process as it
    is then."""
    loader = DataLoader(WorkerTrace(), batch_size=4, num_workers=2, multiprocessing_context=context)
    first = list(loader)
    before_second = _live_pids()
    second = list(loader)
    loader._spare_workers._own()  # (their start, in a thread, over: no race with the snapshot)
    before_third = _live_pids()
    third = _worker_pids(list(loader))
    assert _worker_pids(second).isdisjoint(before_second)
    assert third.isdisjoint(_worker_pids(first) | _worker_pids(second))
    if context == "fork":
        assert third.isdisjoint(before_third)
    else:
        assert third <= before_third


def _two_epochs(loader):
    """Run two epochs: the second starts the spare workers."""
    list(loader)
    return list(loader)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spare_workers_exit_with_the_loader(context):
    loader = DataLoader(WorkerTrace(), batch_size=4, num_workers=2, multiprocessing_context=context)
    _two_epochs(loader)
    spare = list(loader._spare_workers._own().pids)
    assert all(alive(p) for p in spare)
    del loader
    gc.collect()
    assert wait_gone(spare, 30)[0] == []


@pytest.mark.one_mode  # names its start method; what a kill leaves behind
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_spare_worker_killed_while_it_waits_is_replaced(context):
    """A spare worker that died idle (the OOM killer, say) is no error: the next
    epoch starts fresh workers, and is torch's."""
    killed = []

    def kill_a_spare_worker(loader, epoch):
        if epoch == 2:  # (the second epoch started the spare workers)
            spare = list(loader._spare_workers._own().pids)
            os.kill(spare[1], signal.SIGKILL)
            assert wait_gone(spare[1:], 30)[0] == []
            killed.extend(spare)

    ours = _epochs(DataLoader, context, before_epoch=kill_a_spare_worker)
    assert torch.equal(ours[..., :PID], _epochs(tud.DataLoader, context)[..., :PID])
    assert killed and _worker_pids([ours[2]]).isdisjoint(killed)
    assert wait_gone(killed, 30)[0] == []  # the one left alive was stopped


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spare_workers_of_another_count_are_not_used(context):
    loader = DataLoader(WorkerTrace(), batch_size=4, num_workers=2, multiprocessing_context=context)
    _two_epochs(loader)
    spare = list(loader._spare_workers._own().pids)
    loader.num_workers = 3
    got = list(loader)
    assert len(_worker_pids(got)) == 3
    assert _worker_pids(got).isdisjoint(spare)
    assert [int(i) for b in got for i in b[:, 0]] == list(range(16))
    assert wait_gone(spare, 30)[0] == []


def _unpicklable():
    pass


@pytest.mark.one_mode  # names its start method; an error at start and what it leaves
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_dataset_made_unpicklable_between_epochs_fails_as_torchs(context):
    """The dataset is pickled at each iter(), as torch pickles it: changed so
    that it cannot be, the next epoch fails with torch's error, and no worker,
    spare or not, is left behind."""
    errors = []
    for make in (tud.DataLoader, DataLoader):
        dataset = WorkerTrace()
        loader = make(dataset, batch_size=4, num_workers=2, multiprocessing_context=context)
        _two_epochs(loader)
        spare = list(loader._spare_workers._own().pids) if make is DataLoader else []
        dataset.handle = lambda: None
        with pytest.raises(Exception) as error:
            list(loader)
        errors.append(error)
    assert errors[1].type is errors[0].type
    assert "lambda" in str(errors[1].value) or "pickle" in str(errors[1].value)
    assert wait_gone(spare, 30)[0] == []


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_a_copy_of_a_loader_with_spare_workers_starts_its_own(copy_of):
    loader = DataLoader(WorkerTrace(), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    first = _two_epochs(loader)
    spare = set(loader._spare_workers._own().pids)
    twin = copy_of(loader)
    assert _worker_pids(list(twin)).isdisjoint(spare)
    assert _worker_pids(list(loader)) == spare  # the original's are still its own
    # (the same samples; seeds are drawn anew for each iterator)
    assert [b[:, :2].tolist() for b in first] == [b[:, :2].tolist() for b in list(twin)]

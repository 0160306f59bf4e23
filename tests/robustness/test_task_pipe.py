"""A worker's task pipe (main -> worker, every message: see shmloader/_main/_pool.py)
must never make the training thread wait for a busy worker: a task bigger than a pipe
holds (a batch of 100,000 indices: ~500 KB pickled) grows the pipe to hold it."""

import sys
import textwrap

import pytest

from tests.helpers.procs import run_job

# One worker.  Its second batch waits for a file that the script makes only once the first
# next() has returned, and that next() sends the third task while the worker is in the
# second batch: had the write waited for the worker to read it, next() would never
# return.  The batches are then checked against torch's DataLoader's.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch.utils.data import DataLoader as TorchLoader, Dataset
    from shmloader import DataLoader

    class WaitsForFlag(Dataset):
        def __init__(self, flag):
            self.flag = flag
        def __len__(self):
            return 10**7
        def __getitems__(self, indices):
            while indices[0] == SECOND and not os.path.exists(self.flag):
                time.sleep(0.01)
            return indices

    def as_tensor(batch):
        return torch.tensor(batch)

    BATCHES = [list(range(10**6 + k * 100_000, 10**6 + (k + 1) * 100_000)) for k in range(3)]
    SECOND = BATCHES[1][0]

    if __name__ == "__main__":
        method, flag = sys.argv[1], sys.argv[2]
        options = dict(batch_sampler=BATCHES, collate_fn=as_tensor, num_workers=1,
                       prefetch_factor=2, multiprocessing_context=method)
        it = iter(DataLoader(WaitsForFlag(flag), **options))
        got = [next(it)]
        open(flag, "w").close()
        got += list(it)
        expected = list(TorchLoader(WaitsForFlag(flag), **options))
        assert len(got) == len(expected) == 3
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b)
        print("ok")
    """
)


@pytest.mark.one_mode  # names its start method; the task pipe
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_task_bigger_than_a_pipe_holds_does_not_wait_for_its_busy_worker(tmp_path, method):
    script = tmp_path / "big_tasks.py"
    script.write_text(_SCRIPT)
    done = run_job([sys.executable, str(script), method, str(tmp_path / "flag")], limit=60)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout

"""transformers' Trainer with ShmloaderTrainer: training and resuming from a mid-epoch
checkpoint through shmloader's ring, against the same Trainer with its own loaders.

tests/helpers/trainer_driver.py trains both ways (uninterrupted, then resumed from the
checkpoint mid-way through the second epoch) and writes what each model saw, in one
process and in two ranks under torchrun.
"""

import json
import os
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import run_job

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integrations, pytest.mark.slow]


def _train(tmp_path, launcher):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = run_job(
        [*launcher, "-m", "tests.helpers.trainer_driver", str(tmp_path)], 300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-6000:]
    ranks = sorted(f for f in os.listdir(tmp_path) if f.startswith("trainer"))
    return [json.load(open(tmp_path / f)) for f in ranks]


def _check(runs):
    torch_run, shm_run = runs["torch"], runs["shm"]
    steps, resume_from = runs["steps_per_epoch"], runs["resume_from"]
    # The same batches, noise included, and so the same training.
    assert len(shm_run["seen"]) == 2 * steps and shm_run["seen"] == torch_run["seen"]
    assert (shm_run["loss"], shm_run["weights"]) == (torch_run["loss"], torch_run["weights"])
    # Resumed mid-way through epoch 1: the Trainer's own skip and shmloader's give the same
    # batches, the uninterrupted run's indices.
    resumed, torch_resumed = runs["shm_resumed"], runs["torch_resumed"]
    assert resumed["seen"] == torch_resumed["seen"]
    assert [b[0] for b in resumed["seen"]] == [b[0] for b in shm_run["seen"][resume_from:]]
    # Every batch came from shmloader's loaders, in ring slots, options kept: resumed in
    # the last epoch, the Trainer's loader trains nothing, its skipping one the rest.
    assert torch_run["loaders"] == ["torch.utils.data.dataloader"]
    assert shm_run["loaders"] == ["shmloader.dataloader"]
    assert resumed["loaders"] == ["shmloader.dataloader"] * 2
    assert resumed["options"] == [1 << 16] * 2
    assert shm_run["batches"] == shm_run["slot_batches"] == [2 * steps]
    rest = 2 * steps - resume_from
    assert resumed["batches"] == resumed["slot_batches"] == [0, rest]


def test_trainer_trains_and_resumes_through_the_ring(tmp_path):
    (runs,) = _train(tmp_path, [sys.executable])
    assert runs["world"] == 1
    _check(runs)


# Once (one_mode): the Trainer under forkserver is the one-process test's part in CI's second
# run; the ranks' split is the same under every start method.
@pytest.mark.one_mode
def test_two_ranks_train_and_resume_through_the_ring(tmp_path):
    # The Trainer's set_epoch() reaches the sampler inside shmloader's loader: each epoch
    # the ranks share every sample out anew, as with the Trainer's own loaders.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    ranks = _train(tmp_path, [*launcher, "--nproc-per-node=2"])
    assert [r["world"] for r in ranks] == [2, 2]
    for runs in ranks:
        _check(runs)
    steps = ranks[0]["steps_per_epoch"]
    epochs = [
        [
            i
            for r in ranks
            for batch in r["shm"]["seen"][e * steps : (e + 1) * steps]
            for i in batch[0]
        ]
        for e in range(2)
    ]
    assert all(set(epoch) == set(range(36)) for epoch in epochs)
    assert epochs[0] != epochs[1]  # another shuffle for epoch 1

"""transformers' Trainer with ShmloaderTrainer: training and resuming from a mid-epoch
checkpoint through shmloader's ring, against the same Trainer with its own loaders.

tests/trainer_driver.py trains both ways (uninterrupted, then resumed from the
checkpoint at step 12 of 18) and writes what each model saw.
"""

import json
import os
import sys

import pytest

from tests.procs import run_job

pytest.importorskip("transformers")
pytestmark = [pytest.mark.integrations, pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trainer_trains_and_resumes_through_the_ring(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = run_job(
        [sys.executable, "-m", "tests.trainer_driver", str(tmp_path)], 300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-6000:]
    runs = json.load(open(tmp_path / "trainer.json"))
    torch_run, shm_run = runs["torch"], runs["shm"]
    # The same 18 batches, noise included, and so the same training.
    assert len(shm_run["seen"]) == 18 and shm_run["seen"] == torch_run["seen"]
    assert (shm_run["loss"], shm_run["weights"]) == (torch_run["loss"], torch_run["weights"])
    # Resumed at step 12: the Trainer's own skip and shmloader's give the same batches,
    # the uninterrupted run's indices.
    resumed, torch_resumed = runs["shm_resumed"], runs["torch_resumed"]
    assert resumed["seen"] == torch_resumed["seen"]
    assert [b[0] for b in resumed["seen"]] == [b[0] for b in shm_run["seen"][12:]]
    # Every batch came from shmloader's loaders, in ring slots, options kept: resumed
    # in the last epoch, the Trainer's loader trains nothing, its skipping one the
    # 6 batches left.
    assert torch_run["loaders"] == ["torch.utils.data.dataloader"]
    assert shm_run["loaders"] == ["shmloader.dataloader"]
    assert resumed["loaders"] == ["shmloader.dataloader"] * 2
    assert resumed["options"] == [1 << 16] * 2
    assert shm_run["batches"] == shm_run["slot_batches"] == [18]
    assert resumed["batches"] == resumed["slot_batches"] == [0, 6]

"""Hugging Face Accelerate: shmloader.integrations.accelerate against Accelerate's own
loader (a torch DataLoader inside its DataLoaderShard), one process and two
(`accelerate launch`), and the warning of the plain accelerator.prepare(loader).

tests/helpers/accelerate_driver.py runs each scenario both ways in one program and writes what
every rank saw; here the two are compared, and shmloader's stats() must count every
batch as carried in a ring slot.
"""

import json
import os
import sys
import warnings

import pytest
import torch

from tests.helpers import ROOT
from tests.helpers.procs import run_job

accelerate = pytest.importorskip("accelerate")

from shmloader import DataLoader, RingBypassedWarning  # noqa: E402
from shmloader.integrations.accelerate import (  # noqa: E402
    prepare_data_loader,
    skip_first_batches,
)

pytestmark = pytest.mark.integrations
LIMIT_S = 240


def _driver(tmp_path, launcher):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = run_job(launcher + [str(tmp_path)], LIMIT_S, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-6000:]
    ranks = sorted(f for f in os.listdir(tmp_path) if f.startswith("rank"))
    return [json.load(open(tmp_path / f)) for f in ranks]


def _check(ranks, world):
    assert len(ranks) == world and all(r["world"] == world for r in ranks)
    for r in ranks:
        for name, run in r["sharding"].items():
            # Accelerate's DataLoaderShard, with shmloader's loader inside ...
            assert (run["class"], run["base"]) == ("DataLoaderShard", "shmloader.dataloader")
            # ... the batches Accelerate's own loader gives this rank, noise included ...
            assert run["ours"] == run["theirs"], name
            # ... every one of them carried in a slot of shmloader's ring.
            count = sum(len(epoch) for epoch in run["ours"])
            assert run["batches"] == run["slot_batches"] == count, name
        resumed = r["resume"]
        assert resumed["got"] == resumed["expected"]
        assert resumed["batches"] == resumed["slot_batches"] == len(resumed["got"])
        skipped = r["skip"]
        assert skipped["ours"] == skipped["theirs"] and skipped["base"] == "shmloader.dataloader"
        assert skipped["batches"] == skipped["slot_batches"] == len(skipped["ours"])
    if world > 1:
        # The ranks' shares of each epoch: disjoint and, with even_batches, every
        # sample (padded from the start) ...
        for name in ("even", "split"):
            for epoch in zip(*(r["sharding"][name]["ours"] for r in ranks)):
                indices = [i for rank in epoch for batch in rank for i in batch[0]]
                assert set(indices) == set(range(37)), name
        # ... and without even_batches, exactly every sample once.
        for epoch in zip(*(r["sharding"]["uneven"]["ours"] for r in ranks)):
            indices = sorted(i for rank in epoch for batch in rank for i in batch[0])
            assert indices == list(range(37))


@pytest.mark.slow
@pytest.mark.one_mode  # under forkserver, the two-process test's part in CI's second run
def test_one_process_through_the_ring(tmp_path):
    _check(_driver(tmp_path, [sys.executable, "-m", "tests.helpers.accelerate_driver"]), 1)


@pytest.mark.slow
def test_two_processes_through_the_ring(tmp_path):
    # `accelerate launch` runs several CPU processes through torch.distributed.run when
    # told --multi_gpu (its CPU launcher needs MPI); Accelerate then trains on gloo.
    launcher = [
        *(sys.executable, "-m", "accelerate.commands.launch"),
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1"),
        *("--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"),
        *("-m", "tests.helpers.accelerate_driver"),
    ]
    _check(_driver(tmp_path, launcher), 2)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * i


def test_plain_prepare_warns_once_at_the_users_line():
    accelerator = accelerate.Accelerator(cpu=True)
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, seed_per_sample=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = accelerator.prepare(loader)
        line = sys._getframe().f_lineno - 1
        accelerator.prepare(loader)  # told once per loader
    assert [w.category for w in caught] == [RingBypassedWarning]
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)
    message = str(caught[0].message)
    assert (
        "seed_per_sample=True" in message and "prepare_data_loader(accelerator, loader)" in message
    )
    # What the warning says: Accelerate's loader holds a torch DataLoader, not the ring.
    assert type(prepared.base_dataloader) is torch.utils.data.DataLoader


def test_listing_a_loaders_attributes_does_not_warn():
    """Only Accelerate's reading of _is_accelerate_prepared means the plain path: a tool that
    lists every attribute (inspect.getmembers, a debugger, pydoc) reads it too, and must not
    be told about Accelerate; the loader's later plain prepare is still told."""
    import inspect

    loader = DataLoader(Squares(), batch_size=2, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inspect.getmembers(loader)
        assert hasattr(loader, "_is_accelerate_prepared")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerate.Accelerator(cpu=True).prepare(loader)
    assert [w.category for w in caught] == [RingBypassedWarning]


def test_supported_path_is_silent_and_passes_through_prepare():
    accelerator = accelerate.Accelerator(cpu=True)
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, num_slots=9, fetch="sample")
    model = torch.nn.Linear(1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = prepare_data_loader(accelerator, loader)
        again = prepare_data_loader(accelerator, prepared)
        _, passed = accelerator.prepare(model, prepared)
        # A torch DataLoader is made a shmloader one with the same arguments.
        from_torch = prepare_data_loader(
            accelerator, torch.utils.data.DataLoader(Squares(), batch_size=2, num_workers=2)
        )
    assert again is prepared and passed is prepared
    base = prepared.base_dataloader
    assert isinstance(prepared, DataLoader) and type(base) is DataLoader
    assert (base.num_slots, base.fetch, base.num_workers) == (9, "sample", 2)
    assert type(from_torch.base_dataloader) is DataLoader
    assert [b.tolist() for b in prepared] == [[0, 1], [4, 9], [16, 25], [36, 49]]
    assert [b.tolist() for b in from_torch] == [[0, 1], [4, 9], [16, 25], [36, 49]]


def test_refusals_name_what_to_do():
    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="expects a DataLoader, but got list"):
        prepare_data_loader(accelerator, [1, 2])
    torch_prepared = accelerator.prepare(torch.utils.data.DataLoader(Squares(), batch_size=2))
    with pytest.raises(ValueError, match="prepared by Accelerate already, around a torch"):
        prepare_data_loader(accelerator, torch_prepared)
    with pytest.raises(TypeError, match="made by shmloader's prepare_data_loader"):
        skip_first_batches(torch_prepared, 1)


def test_skip_first_batches_of_an_unprepared_loader():
    loader = DataLoader(Squares(), batch_size=2, num_workers=2, num_slots=9)
    skipped = skip_first_batches(loader, 2)
    assert type(skipped) is DataLoader and skipped.num_slots == 9
    assert [b.tolist() for b in skipped] == [[16, 25], [36, 49]]


def test_dispatched_batches_come_from_the_ring():
    # dispatch_batches=True: Accelerate's DataLoaderDispatcher iterates the loader on the
    # main process and hands the batches out; shmloader's loader is the one it iterates.
    config = accelerate.DataLoaderConfiguration(dispatch_batches=True)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    theirs = accelerator.prepare(torch.utils.data.DataLoader(Squares(), batch_size=2))
    ours = prepare_data_loader(accelerator, DataLoader(Squares(), batch_size=2, num_workers=2))
    assert type(ours) is type(theirs) is accelerate.data_loader.DataLoaderDispatcher
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]
    assert ours.base_dataloader.stats().batches == 4

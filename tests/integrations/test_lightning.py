"""Lightning's Trainer (lightning.pytorch, on the CPU) with shmloader's DataLoader: the batches
it trains travel through shmloader's ring (the loader Lightning iterated counts them in its
stats()) and are those the same Trainer run trains from torch's own DataLoader, same seeds;
under DDP (strategy "ddp" and "ddp_spawn", 2 processes, gloo) Lightning rebuilds the loader
with a DistributedSampler as type(loader)(...), which keeps shmloader's class and options;
and a checkpoint resumed with trainer.fit(ckpt_path=...) trains what the uninterrupted run
did, mid-epoch and at an epoch's last step (ModelCheckpoint(every_n_train_steps=N), N
dividing the epoch's batches, which Lightning resumes into the next epoch).

The DDP runs go through this file as a program, in a subprocess under a hard timeout:

    python -m tests.integrations.test_lightning STRATEGY LOADER OUT

(LOADER "shm" or "torch"): Lightning's "ddp" launcher runs that command again for rank 1;
each rank writes OUT/STRATEGY_LOADER_rankR.json with the batches it trained and the loader it
iterated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.integrations
pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from tests.helpers import ROOT  # noqa: E402

DDP_TIMEOUT_S = 180
N = 16  # samples; batch_size 4 -> 4 batches an epoch (2 per rank under DDP)
BATCH = 4
SEED = 0


class Noisy(torch.utils.data.Dataset):
    """Sample i: its index and a draw from the worker's torch RNG (an augmentation)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"index": i, "noise": torch.rand(1)}


def make_loader(kind: str, **kw):
    import shmloader

    cls = shmloader.DataLoader if kind == "shm" else torch.utils.data.DataLoader
    extra = dict(slot_bytes=1 << 16) if kind == "shm" else {}
    return cls(
        Noisy(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(SEED),
        **extra,
        **kw,
    )


class Recorder(pl.LightningModule):
    """Records every batch it trains, and the loader Lightning iterated."""

    def __init__(self, out=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list = []
        self.out = out

    def training_step(self, batch, batch_idx):
        self.seen.append(
            [batch["index"].tolist(), [round(x, 6) for x in batch["noise"].flatten().tolist()]]
        )
        return (self.w * batch["noise"].sum()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self):
        if self.out is None:
            return
        loader = self.trainer.train_dataloader
        stats = loader.stats().batches if hasattr(loader, "stats") else None
        record = dict(
            seen=self.seen,
            loader=f"{type(loader).__module__}.{type(loader).__name__}",
            sampler=type(loader.sampler).__name__,
            slot_bytes=getattr(loader, "slot_bytes", None),
            num_workers=loader.num_workers,
            persistent_workers=loader.persistent_workers,
            ring_batches=stats,
        )
        path = os.path.join(self.out, f"rank{self.global_rank}.json")
        with open(path, "w") as f:
            json.dump(record, f)


def trainer(**kw):
    kw.setdefault("max_epochs", 2)
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def fit(kind, tmp_path, ckpt_every=None, ckpt_path=None, max_epochs=2):
    """(the module's recorded batches, the loader the Trainer iterated)."""
    pl.seed_everything(SEED, verbose=False)
    callbacks = []
    if ckpt_every is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=tmp_path, every_n_train_steps=ckpt_every, save_top_k=-1, filename="{step}"
            )
        )
    t = trainer(max_epochs=max_epochs, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    model = Recorder()
    t.fit(model, train_dataloaders=make_loader(kind), ckpt_path=ckpt_path)
    return model.seen, t.train_dataloader


def _through_the_ring(loader, trained: int):
    import shmloader

    assert isinstance(loader, shmloader.DataLoader)
    assert loader.stats().batches == trained


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Both loaders' uninterrupted 3-epoch runs (12 steps)."""
    runs = {}
    for kind in ("torch", "shm"):
        seen, loader = fit(kind, tmp_path_factory.mktemp(kind), max_epochs=3)
        runs[kind] = seen
        if kind == "shm":
            _through_the_ring(loader, len(seen))
    return runs


@pytest.mark.slow
def test_the_trainer_trains_torchs_batches_through_the_ring(uninterrupted):
    assert len(uninterrupted["shm"]) == 3 * N // BATCH
    assert uninterrupted["shm"] == uninterrupted["torch"]


# Once (one_mode): Lightning's resume of the loop is the same under every start method;
# resumed workers under forkserver are the resume matrix's (tests/equivalence/test_resume.py).
@pytest.mark.slow
@pytest.mark.one_mode
@pytest.mark.parametrize(
    "step", [3, 4, 8], ids=["mid_epoch_0", "last_step_of_epoch_0", "last_step_of_epoch_1"]
)
def test_a_checkpoint_resumes_the_uninterrupted_run(uninterrupted, tmp_path, step):
    """A checkpoint at `step` resumed with trainer.fit(ckpt_path=...): the rest of the run
    is the uninterrupted one's (torch's loader's batches too), through the ring.  At an
    epoch's last step (4, 8), Lightning resumes into the next epoch, which must be trained
    whole (before shmloader made such a state the epoch's end, it was empty)."""
    fit("shm", tmp_path, ckpt_every=step, max_epochs=3)
    ckpt = tmp_path / f"step={step}.ckpt"
    assert ckpt.exists(), sorted(os.listdir(tmp_path))
    seen, loader = fit("shm", tmp_path / "resumed", ckpt_path=str(ckpt), max_epochs=3)
    assert seen == uninterrupted["torch"][step:]
    _through_the_ring(loader, len(seen))


# ------------------------------------------------------------------------------ DDP
def _ddp_run(strategy: str, kind: str, out: str) -> None:
    """This file as a program: one Trainer run under `strategy` on 2 CPU processes."""
    if strategy == "ddp_spawn":
        # The Trainer's tensors travel to the spawned ranks pickled; shared by file
        # descriptor (torch's default), rebuilding one failed in the rank on the machine
        # these tests were written on ("unable to resize file ...: Invalid argument").
        torch.multiprocessing.set_sharing_strategy("file_system")
    pl.seed_everything(SEED, verbose=False)
    t = trainer(strategy=strategy, devices=2, enable_checkpointing=False)
    t.fit(Recorder(out=out), train_dataloaders=make_loader(kind))


def _ddp(strategy, kind, tmp_path):
    out = tmp_path / f"{strategy}_{kind}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.test_lightning", strategy, kind, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DDP_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = []
    for rank in range(2):
        with open(out / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
    return ranks


@pytest.fixture(scope="module")
def torchs_ddp(tmp_path_factory):
    """torch's loader under "ddp": what each rank trains under either strategy (the same
    DistributedSampler and seeds; a second torch run under "ddp_spawn" would cost ~40 s)."""
    return _ddp("ddp", "torch", tmp_path_factory.mktemp("ddp_torch"))


# "ddp" once (one_mode): CI's second run has Lightning's DDP under forkserver in "ddp_spawn".
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.one_mode), "ddp_spawn"])
def test_ddp_keeps_shmloader_and_trains_torchs_batches_per_rank(strategy, torchs_ddp, tmp_path):
    theirs = torchs_ddp
    ours = _ddp(strategy, "shm", tmp_path)
    for rank, (got, want) in enumerate(zip(ours, theirs)):
        assert got["loader"] == "shmloader.dataloader.DataLoader", rank
        assert got["sampler"] == "DistributedSampler", rank
        assert (got["slot_bytes"], got["num_workers"], got["persistent_workers"]) == (
            1 << 16,
            2,
            True,
        )
        assert len(got["seen"]) == 2 * N // BATCH // 2  # 2 epochs, half the batches each
        assert got["ring_batches"] == len(got["seen"]), rank
        assert got["seen"] == want["seen"], rank
    assert ours[0]["seen"] != ours[1]["seen"]


if __name__ == "__main__":
    _ddp_run(*sys.argv[1:4])

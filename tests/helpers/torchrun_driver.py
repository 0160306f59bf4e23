"""Training script that tests/integrations/test_torchrun.py runs under real torchrun.

    torchrun ... -m tests.helpers.torchrun_driver OUT [--torch-ref] [--save-at E,K] [--resume]
                                              [--raise-at R@E,K] [--pause-at R@E,K] [--epochs N]

Every rank trains a tiny DDP model (gloo, CPU) on AugDataset, a synthetic map-style dataset
whose __getitem__ draws a random flip and noise from torch's global RNG (so from the loader
worker's seed), through shmloader.DataLoader over a DistributedSampler(shuffle=True, fixed
seed) with 2 workers, set_epoch each epoch.  It writes OUT/rank{RANK}.json: every batch it
trained on (indices and augmented values, exactly, as python floats), the loss of each step,
the final parameters, the loader's stats() after each epoch, and the indices of every rank
gathered over the process group.

--torch-ref  first runs the same training with torch's DataLoader, from the same seeds and a
             fresh model, and records it alongside (the test compares the two).
--save-at E,K  after the K-th step of epoch E, save OUT/ckpt/rank{RANK}.pt: the model, the
             optimizer, torch's RNG state and loader.state_dict(); training goes on.
--ckpt DIR   where the checkpoints are (default OUT/ckpt).
--resume     load DIR/rank{RANK}.pt and train the rest from where it was saved; the
             batches recorded are those from the saved step onwards.
--raise-at R@E,K  rank R raises after the K-th step of epoch E, its iterator and workers
             alive.
--pause-at R@E,K  rank R, after the K-th step of epoch E, writes OUT/paused/rank{RANK} (with this
             process's pid and its children's: the loader's workers) and sleeps (the iterator
             and its workers alive) for $TORCHRUN_DRIVER_PAUSE s (default 120), for the
             test to kill something, then trains on.

Every batch also appends to OUT/progress/rank{RANK} the pids of this rank and its children.
A rank that makes no progress for WATCHDOG_S dumps its stacks and exits (a hang then ends
the job instead of blocking the test).
"""

import argparse
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data as tud
from torch.nn.parallel import DistributedDataParallel as DDP

import shmloader

N = 48  # divisible by 2 and 4 ranks: DistributedSampler pads nothing ("exactly once")
FEATURES = 6
BATCH = 4
EPOCHS = 3
SAMPLER_SEED = 11
SEED = 1234  # torch's global RNG at start-up: rank r seeds SEED + r
WATCHDOG_S = float(os.environ.get("TORCHRUN_DRIVER_WATCHDOG", "60"))
# How long --pause-at sleeps: longer than the test waits for the job to end after its kill.
PAUSE_S = float(os.environ.get("TORCHRUN_DRIVER_PAUSE", "120"))


class AugDataset(tud.Dataset):
    """Sample i: a fixed vector (from i), randomly flipped plus noise drawn from torch's
    global RNG, as a random augmentation in a worker would."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        flip = bool(torch.rand(()) < 0.5)
        if flip:
            x = x.flip(0)
        x = x + 0.1 * torch.randn(FEATURES)
        return {"index": i, "x": x, "y": i % 2, "flip": flip}


def _point(text, rank=None):
    """ "E,K" -> (E, K); "R@E,K" -> (E, K) on rank R only, else None."""
    if text is None:
        return None
    if "@" in text:
        r, text = text.split("@")
        if int(r) != rank:
            return None
    e, k = text.split(",")
    return int(e), int(k)


def _children():
    me = str(os.getpid())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    found.append(int(pid))
        except OSError:
            continue
    return sorted(found)


def _write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _record(batch):
    return {
        "index": batch["index"].tolist(),
        "x": batch["x"].tolist(),
        "y": batch["y"].tolist(),
        "flip": batch["flip"].tolist(),
    }


def _stats(loader):
    if not isinstance(loader, shmloader.DataLoader):
        return None
    s = loader.stats()
    return {
        "batches": s.batches,
        "samples": s.samples,
        "slot_batches": s.slot_batches,
        "unsized_batches": s.unsized_batches,
        "ring_full_batches": s.ring_full_batches,
        "spilled_batches": s.spilled_batches,
        "fallback_leaves": s.fallback_leaves,
        "ring_slots": s.ring_slots,
    }


def train(cls, args, rank, out):
    """One training run with loader class `cls`; returns what it recorded."""
    torch.manual_seed(SEED + rank)
    model = nn.Linear(FEATURES, 2)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = AugDataset()
    sampler = tud.DistributedSampler(dataset, shuffle=True, seed=SAMPLER_SEED)
    loader = cls(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    ckpt = os.path.join(args.ckpt or os.path.join(out, "ckpt"), f"rank{rank}.pt")
    first_epoch, done = 0, 0
    if args.resume:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        torch.set_rng_state(state["rng"])
        loader.load_state_dict(state["loader"])
        first_epoch, done = state["epoch"], state["step"]
    save_at = _point(args.save_at) if cls is shmloader.DataLoader else None
    raise_at = _point(args.raise_at, rank) if cls is shmloader.DataLoader else None
    pause_at = _point(args.pause_at, rank) if cls is shmloader.DataLoader else None
    epochs, losses, stats = {}, {}, []
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        k = done if epoch == first_epoch else 0
        batches = epochs[str(epoch)] = []
        for batch in loader:
            loss = nn.functional.cross_entropy(ddp(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            k += 1
            batches.append(_record(batch))
            losses[f"{epoch},{k}"] = loss.item()
            faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
            pids = {"rank": os.getpid(), "agent": os.getppid(), "children": _children()}
            with open(os.path.join(out, "progress", f"rank{rank}"), "a") as f:
                f.write(json.dumps(pids) + "\n")
            if (epoch, k) == save_at:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optim": opt.state_dict(),
                        "rng": torch.get_rng_state(),
                        "loader": loader.state_dict(),
                        "epoch": epoch,
                        "step": k,
                    },
                    ckpt,
                )
            if (epoch, k) == raise_at:
                raise RuntimeError(f"rank {rank} fails on purpose at epoch {epoch} step {k}")
            if (epoch, k) == pause_at:
                _write(os.path.join(out, "paused", f"rank{rank}"), pids)
                faulthandler.cancel_dump_traceback_later()
                time.sleep(PAUSE_S)
                faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        stats.append(_stats(loader))
    return {
        "epochs": epochs,
        "losses": losses,
        "params": {n: p.tolist() for n, p in model.state_dict().items()},
        "stats": stats,
        "len": len(loader),
    }


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--torch-ref", action="store_true")
    p.add_argument("--save-at")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ckpt", help="the checkpoints' folder (default OUT/ckpt)")
    p.add_argument("--raise-at")
    p.add_argument("--pause-at")
    p.add_argument("--epochs", type=int, default=EPOCHS)
    args = p.parse_args(argv)
    out = args.out
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    os.makedirs(os.path.join(out, "progress"), exist_ok=True)
    os.makedirs(os.path.join(out, "ckpt"), exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=WATCHDOG_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "pid": os.getpid()}
    result["env"] = {k: os.environ.get(k) for k in ("LOCAL_RANK", "GROUP_RANK", "OMP_NUM_THREADS")}
    if args.torch_ref:
        result["torch"] = train(tud.DataLoader, args, rank, out)
    result["shm"] = train(shmloader.DataLoader, args, rank, out)
    mine = {e: [i for b in bs for i in b["index"]] for e, bs in result["shm"]["epochs"].items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    result["gathered"] = gathered
    dist.barrier()
    dist.destroy_process_group()
    _write(os.path.join(out, f"rank{rank}.json"), result)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1:])

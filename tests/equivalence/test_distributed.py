"""shmloader under torch.distributed and with several loaders alive at once.

- 2 ranks (gloo on localhost, free port picked at run time, hard timeout) each iterate a
  shmloader.DataLoader over a DistributedSampler(shuffle=True) with 2 workers for 2 epochs; the
  ranks' indices must cover the dataset exactly once per epoch and equal torch's DataLoader with
  the same sampler, batch for batch, worker RNG draws included.
- Several loaders iterated at once in one process (interleaved next()), and 2 processes doing that
  at the same moment, must produce exactly torch's data: no segment-name collision, no crosstalk.
"""

import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.utils.data as tud

from shmloader import DataLoader as ShmDataLoader
from tests.helpers import ROOT
from tests.helpers import datasets as D
from tests.helpers.procs import free_port

TorchDataLoader = tud.DataLoader
HARD_TIMEOUT_S = 150
WORLD = 2
N = 40  # divisible by WORLD: DistributedSampler then pads nothing, so "exactly once" holds
EPOCHS = 2
SAMPLER_SEED = 7


def _to_jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    return x


def _join_all(procs, what):
    """Join with a hard deadline; a hang (or a crash) fails the test instead of blocking it."""
    deadline = time.monotonic() + HARD_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
    for p in hung:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"{what}: {len(hung)} process(es) still running after {HARD_TIMEOUT_S}s (hang)"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * len(procs), f"{what}: exit codes {codes}"


# --------------------------------------------------------------------------- distributed ranks
def _rank_loader_run(cls, rank):
    torch.manual_seed(1000 + rank)
    dataset = D.RNGMap(N)
    sampler = tud.DistributedSampler(dataset, shuffle=True, seed=SAMPLER_SEED)  # world from the pg
    loader = cls(dataset, batch_size=3, sampler=sampler, num_workers=2)
    epochs = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        epochs.append([_to_jsonable(b) for b in loader])
    return {"len": len(loader), "epochs": epochs, "rng_after": torch.rand(2).tolist()}


def _rank_main(rank, port, out_dir):
    """Entry point of one rank (a fresh interpreter started by _launch_ranks)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # (A bound on waiting for the other rank, which starts as slowly as this one: generous.)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    result = {
        "torch": _rank_loader_run(TorchDataLoader, rank),
        "shm": _rank_loader_run(ShmDataLoader, rank),
    }
    # The process group still works alongside the loaders' workers: gather every rank's view.
    mine = [[i for b in ep for i in b["index"]] for ep in result["shm"]["epochs"]]
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    result["gathered"] = gathered
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _expected_indices(rank, epoch):
    """What torch's DataLoader yields on `rank` with the same sampler (explicit world/rank)."""
    sampler = tud.DistributedSampler(
        range(N), num_replicas=WORLD, rank=rank, shuffle=True, seed=SAMPLER_SEED
    )
    sampler.set_epoch(epoch)
    loader = TorchDataLoader(D.IndexMap(N), batch_size=3, sampler=sampler)
    return [i for idx, _ in loader for i in idx.tolist()]


def _launch_ranks(out_dir):
    """Start the ranks as fresh interpreters, like torchrun does (so the workers' default start
    method is the platform's, fork on Linux), and wait for them with a hard deadline."""
    port = free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    procs = []
    for rank in range(WORLD):
        code = f"import tests.equivalence.test_distributed as T; T._rank_main({rank}, {port}, {str(out_dir)!r})"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + HARD_TIMEOUT_S
    outputs, hung = [], []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            hung.append(p.pid)
            p.kill()
            outputs.append(p.communicate()[0])
    report = "".join(
        f"--- rank {r} (exit {p.returncode}) ---\n{o[-4000:]}\n"
        for r, (p, o) in enumerate(zip(procs, outputs, strict=True))
    )
    assert not hung, f"ranks {hung} still running after {HARD_TIMEOUT_S}s (hang)\n{report}"
    assert all(p.returncode == 0 for p in procs), report


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_distributed_sampler_two_ranks(tmp_path):
    _launch_ranks(tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    for epoch in range(EPOCHS):
        per_rank = []
        for r, res in enumerate(results):
            seen = [i for b in res["shm"]["epochs"][epoch] for i in b["index"]]
            assert seen == _expected_indices(r, epoch), (
                f"rank {r} epoch {epoch}: wrong indices/order"
            )
            assert res["gathered"][r] == [
                [i for b in ep for i in b["index"]] for ep in res["shm"]["epochs"]
            ]
            per_rank.append(seen)
        union = sorted(per_rank[0] + per_rank[1])
        assert union == list(range(N)), (
            f"epoch {epoch}: ranks do not cover the dataset exactly once"
        )
        assert results[0]["gathered"] == results[1]["gathered"]
    assert results[0]["shm"]["epochs"][0] != results[0]["shm"]["epochs"][1], (
        "set_epoch had no effect"
    )
    for r, res in enumerate(results):
        # Batch for batch identical to torch in the same rank: indices, worker ids, seeds, RNG draws.
        assert res["shm"] == res["torch"], f"rank {r}: shmloader output differs from torch's"


# --------------------------------------------------------------------------- loaders at once
def _loader_specs():
    return [
        (D.IndexMap(30), dict(batch_size=4, num_workers=2)),
        (
            D.RichMap(10),
            dict(
                batch_size=3,
                num_workers=2,
                shuffle=True,
                generator=torch.Generator().manual_seed(1),
            ),
        ),
        (D.ShardedIterable(13), dict(batch_size=2, num_workers=1)),
        (
            D.RNGMap(12),
            dict(
                batch_size=2,
                num_workers=2,
                persistent_workers=True,
                generator=torch.Generator().manual_seed(2),
            ),
        ),
        (D.GrowingMap(10), dict(batch_size=None, num_workers=2)),
        (D.IndexMap(7), dict(batch_size=2)),
    ]


def interleave(cls, epochs=2):
    """Iterate several loaders at once, one next() each in turn, keeping every batch alive."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    loaders = [cls(ds, **kw) for ds, kw in _loader_specs()]
    out = [[] for _ in loaders]
    for _ in range(epochs):
        its = [iter(l) for l in loaders]
        per_epoch = [[] for _ in loaders]
        live = set(range(len(its)))
        while live:
            for k in sorted(live):
                try:
                    per_epoch[k].append(next(its[k]))
                except StopIteration:
                    live.discard(k)
        for k in range(len(loaders)):
            out[k].append(per_epoch[k])
    return out


@pytest.mark.slow
def test_loaders_interleaved_in_one_process():
    expected = interleave(TorchDataLoader)
    got = interleave(ShmDataLoader)
    D.assert_same(expected, got, "loaders")


def _owned(x):
    """Deep copy with every tensor cloned into its own storage, so the result can be torch.save'd
    whatever storage the loader's tensors view (serialization is tested in test_equivalence)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return type(x)((k, _owned(v)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_owned(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_owned(v) for v in x)
    return x


def _child_interleave(out_path, barrier):
    # A forked child must not use the parent's intra-op thread pool (libgomp is not fork-safe:
    # a large clone() segfaults or hangs); torch's own workers do the same.
    torch.set_num_threads(1)
    try:
        barrier.wait(60)  # both processes create their loaders at the same moment
        torch.save(_owned(interleave(ShmDataLoader)), out_path)
    except BaseException:
        with open(out_path + ".error", "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.slow
def test_loaders_in_two_processes_at_once(tmp_path):
    # fork: both children start from the same interpreter state (same RNG states, same counters),
    # the worst case for segment-name collisions.
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    paths = [str(tmp_path / f"child{k}.pt") for k in range(2)]
    procs = [ctx.Process(target=_child_interleave, args=(p, barrier)) for p in paths]
    for p in procs:
        p.start()
    try:
        _join_all(procs, "concurrent processes")
    finally:
        for p in paths:
            if os.path.exists(p + ".error"):
                print(open(p + ".error").read())
    expected = interleave(TorchDataLoader)
    for p in paths:
        D.assert_same(expected, torch.load(p, weights_only=False), os.path.basename(p))

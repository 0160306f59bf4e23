"""Driver for tests/equivalence/test_resume.py: every loader of those tests runs here, in a process of
its own, so that a state is saved by one process and resumed by another (fresh) one.

    python -m tests.helpers.resume_driver full OUT SCEN[,SCEN...]
        For each scenario: the uninterrupted run (EPOCHS epochs, no state_dict() call) and a
        second, identical run that saves a checkpoint at every interrupt point to
        OUT/SCEN__POINT.pt (torch.save of {"loader": loader.state_dict(), "torch_rng":
        torch.get_rng_state()}); both runs' batches go to OUT/full.pkl.
    python -m tests.helpers.resume_driver interrupt OUT SCEN POINT
        Runs SCEN's training loop up to POINT, saves the checkpoint to OUT/SCEN__POINT.pt
        and exits at once (sys.exit with the iterator and its workers
        alive, as a killed job would leave them).
    python -m tests.helpers.resume_driver resume OUT SCEN[,SCEN...]
        For every OUT/SCEN__*.pt, in turn: the driver's RNGs seeded as at start-up, a new
        loader, load_state_dict() of the checkpoint read by torch.load(weights_only=True),
        then the training loop from the user's epoch of that point to the end; batches,
        warnings and errors go to OUT/resume.pkl.

Interrupt points: "pre" (a new loader, before any iter()), "e{E}k{K}" (epoch E, after K
batches were yielded; K = 0 right after iter(); K = the epoch's length before the
iterator has raised StopIteration), "end{E}" (after epoch E's StopIteration).  A user who
checkpoints at e{E}k{K} restarts at epoch E (its rest first); at end{E}, and at e{E}k{K}
with K the epoch's length for a map-style dataset (see ends_epoch), at epoch E + 1.

A batch is recorded as plain python (tensors as lists), so equality is exact.  Every
sample carries `index` plus draws from random, numpy and torch's global RNGs made in
__getitem__ / __iter__ (the "augmentations").

A hang dumps the stacks and exits: no scenario (its runs, or all its resumes) may take
longer than RESUME_DRIVER_TIMEOUT seconds (default 120), a bound on a stall rather than on
the whole run, which takes minutes on a loaded machine.
"""

import faulthandler
import glob
import io
import os
import pickle
import random
import sys
import time
import traceback
import warnings

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    get_worker_info,
)

from tests.helpers.datasets import EpochRandomSampler

EPOCHS = 3
SEED = 1234  # the driver's global RNGs, at start-up and before every run
GEN_SEED = 77  # the loader's generator=
N = 22  # map-style dataset length; batch_size 4 -> 6 batches (the last one of 2)
BATCH = 4
CTX = "fork"


def seed_all():
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)


def augment(i):
    return {"index": i, "py": random.random(), "np": np.random.rand(2), "torch": torch.rand(2)}


# ------------------------------------------------------------------------------ datasets
class AugMap(Dataset):
    """Sample i = augment(i); indices in `slow` take 30 ms (so that with in_order=False batches
    really arrive out of order; nothing asserts on it)."""

    def __init__(self, n=N, slow=()):
        self.n = n
        self.slow = frozenset(slow)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.slow:
            time.sleep(0.03)
        return augment(i)


class ShardIterable(IterableDataset):
    """Uneven shards: with 2 workers, worker 0 yields 0..13 (5 batches of 3, the last of 2),
    worker 1 yields 14..22 (3 batches), so worker 1 runs out first; in one process, 0..22.
    No state_dict: a resume has to replay."""

    n = 23
    split = 14

    def __init__(self):
        self._pos = 0  # position in this worker's shard of the next item
        self._start = 0  # where the next __iter__ starts (load_state_dict)

    def _shard(self):
        info = get_worker_info()
        if info is None or info.num_workers == 1:
            return list(range(self.n))
        assert info.num_workers == 2
        return list(range(self.split)) if info.id == 0 else list(range(self.split, self.n))

    def __iter__(self):
        shard = self._shard()
        self._pos, self._start = self._start, 0
        while self._pos < len(shard):
            i = shard[self._pos]
            self._pos += 1
            yield augment(i)


class StatefulShardIterable(ShardIterable):
    """ShardIterable that can say where it is (torchdata's protocol)."""

    def state_dict(self):
        return {"pos": self._pos}

    def load_state_dict(self, state):
        self._start = state["pos"]


# ------------------------------------------------------------------------------ samplers
class CountingSampler(Sampler):
    """Shuffles with its own generator seeded from how many epochs it has begun (its count);
    state_dict()/load_state_dict() save and restore the count.  __iter__ is a generator
    function, as most samplers' are."""

    def __init__(self, n=N, seed=11):
        self.n = n
        self.seed = seed
        self.epochs = 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epochs)
        self.epochs += 1
        yield from torch.randperm(self.n, generator=g).tolist()

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


class EagerCountingBatchSampler(Sampler):
    """A batch_sampler like CountingSampler whose __iter__ draws the epoch's batches at once
    and returns an iterator over them (not a generator function: work done in iter())."""

    def __init__(self, n=N, batch_size=BATCH, seed=13):
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.epochs = 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epochs)
        self.epochs += 1
        perm = torch.randperm(self.n, generator=g).tolist()
        return iter([perm[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)])

    def __len__(self):
        return (self.n + self.batch_size - 1) // self.batch_size

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


class EpochSampler(EpochRandomSampler):
    """No state_dict: a permutation of (seed, epoch) with set_epoch, like DistributedSampler
    without replicas; the loader can only fast-forward it."""

    def __init__(self, n=N, seed=17):
        super().__init__(n, seed)


# ------------------------------------------------------------------------------ scenarios
def _loader(dataset, **kw):
    import shmloader

    if kw.get("num_workers", 0) > 0:
        kw.setdefault("multiprocessing_context", CTX)
    return shmloader.DataLoader(dataset, **kw)


def _gen():
    return torch.Generator().manual_seed(GEN_SEED)


def _shuffled(**kw):
    return lambda: _loader(AugMap(), batch_size=BATCH, shuffle=True, generator=_gen(), **kw)


def _nogen(**kw):
    return lambda: _loader(AugMap(), batch_size=BATCH, shuffle=True, **kw)


def _sampler(cls, **kw):
    return lambda: _loader(AugMap(), batch_size=BATCH, sampler=cls(), generator=_gen(), **kw)


def _distributed(gen=True, **kw):
    # 22 samples over 2 replicas: rank 0 gets 11; batch_size 2 -> 6 batches.
    return lambda: _loader(
        AugMap(),
        batch_size=2,
        generator=_gen() if gen else None,
        **kw,
        sampler=DistributedSampler(AugMap(), num_replicas=2, rank=0, shuffle=True, seed=5),
    )


def _iterable(cls, **kw):
    return lambda: _loader(cls(), batch_size=3, generator=_gen(), **kw)


W2 = dict(num_workers=2)
W2P = dict(num_workers=2, persistent_workers=True)

# name -> dict(make, [resume_make], compare, set_epoch, user_rng)
#   compare: "exact" (index and augmentation values, in order), "index" (index values in
#     order; num_workers=0, where the main process's RNG is the user's), "multiset"
#     (in_order=False: each epoch's index batches as a multiset).
#   user_rng: "seed" (default: the resuming process seeds random/numpy/torch as the
#     interrupted one did at start-up, nothing more) or "restore" (the user also saved
#     torch.get_rng_state() with the checkpoint and restores it before resuming).
# Every scenario except the *_nogen* ones passes generator=, so that the loader's draws
# (base seed, RandomSampler) come from a generator the state covers.
SCENARIOS = {
    "shuffle_gen_w2": dict(make=_shuffled(**W2)),
    "shuffle_gen_w2_persistent": dict(make=_shuffled(**W2P)),
    "shuffle_gen_w2_prefetch_next_epoch": dict(make=_shuffled(**W2P, prefetch_next_epoch=True)),
    "shuffle_gen_w0": dict(make=_shuffled(num_workers=0), compare="index"),
    "shuffle_nogen_w2": dict(make=_nogen(**W2)),
    "shuffle_nogen_w2_persistent": dict(make=_nogen(**W2P)),
    "shuffle_nogen_w0": dict(make=_nogen(num_workers=0), compare="index"),
    "shuffle_nogen_w2_user_restores_rng": dict(make=_nogen(**W2), user_rng="restore"),
    "shuffle_nogen_w0_user_restores_rng": dict(
        make=_nogen(num_workers=0), compare="index", user_rng="restore"
    ),
    "stateful_sampler_w2": dict(make=_sampler(CountingSampler, **W2)),
    "stateful_sampler_w2_persistent": dict(make=_sampler(CountingSampler, **W2P)),
    "stateful_sampler_w0": dict(make=_sampler(CountingSampler, num_workers=0), compare="index"),
    # The stateful sampler inside a plain BatchSampler passed as batch_sampler=.
    "stateful_sampler_in_batch_sampler_w2": dict(
        make=lambda: _loader(
            AugMap(),
            batch_sampler=BatchSampler(CountingSampler(), BATCH, drop_last=False),
            generator=_gen(),
            **W2,
        )
    ),
    "stateful_batch_sampler_eager_w2": dict(
        make=lambda: _loader(
            AugMap(), batch_sampler=EagerCountingBatchSampler(), generator=_gen(), **W2
        )
    ),
    "stateful_batch_sampler_eager_w0": dict(
        make=lambda: _loader(AugMap(), batch_sampler=EagerCountingBatchSampler(), generator=_gen()),
        compare="index",
    ),
    "plain_sampler_w2": dict(make=_sampler(EpochSampler, **W2), set_epoch=True),
    "plain_sampler_w0": dict(
        make=_sampler(EpochSampler, num_workers=0), set_epoch=True, compare="index"
    ),
    "distributed_w2": dict(make=_distributed(**W2), set_epoch=True),
    "distributed_w2_persistent": dict(make=_distributed(**W2P), set_epoch=True),
    "distributed_w0": dict(make=_distributed(), set_epoch=True, compare="index"),
    "distributed_nogen_w2": dict(make=_distributed(gen=False, **W2), set_epoch=True),
    "distributed_nogen_w2_user_restores_rng": dict(
        make=_distributed(gen=False, **W2), set_epoch=True, user_rng="restore"
    ),
    "sample_seeded_w2": dict(make=_shuffled(**W2, fetch="sample", seed_per_sample=True)),
    "sample_seeded_w2_persistent": dict(
        make=_shuffled(**W2P, fetch="sample", seed_per_sample=True)
    ),
    # seed_per_sample: a state resumes with another num_workers, augmentations included.
    "sample_seeded_w2_resumed_w1": dict(
        make=_shuffled(**W2, fetch="sample", seed_per_sample=True),
        resume_make=_shuffled(num_workers=1, fetch="sample", seed_per_sample=True),
    ),
    "batch_seeded_w2": dict(make=_shuffled(**W2, seed_per_sample=True)),
    # seed_per_sample without workers: the augmentations too, and into and out of workers.
    "batch_seeded_w0": dict(make=_shuffled(num_workers=0, seed_per_sample=True)),
    "sample_seeded_w2_resumed_w0": dict(
        make=_shuffled(**W2, fetch="sample", seed_per_sample=True),
        resume_make=_shuffled(num_workers=0, fetch="sample", seed_per_sample=True),
    ),
    "unordered_w2": dict(
        make=lambda: _loader(
            AugMap(slow=range(0, N, 5)),
            batch_size=BATCH,
            shuffle=True,
            generator=_gen(),
            in_order=False,
            **W2,
        ),
        compare="multiset",
    ),
    "unordered_w2_persistent": dict(
        make=lambda: _loader(
            AugMap(slow=range(0, N, 5)),
            batch_size=BATCH,
            shuffle=True,
            generator=_gen(),
            in_order=False,
            **W2P,
        ),
        compare="multiset",
    ),
    "iterable_stateful_w2": dict(make=_iterable(StatefulShardIterable, **W2)),
    "iterable_stateful_w2_persistent": dict(make=_iterable(StatefulShardIterable, **W2P)),
    "iterable_stateful_w0": dict(make=_iterable(StatefulShardIterable), compare="index"),
    "iterable_replay_w2": dict(make=_iterable(ShardIterable, **W2)),
    "iterable_replay_w2_persistent": dict(make=_iterable(ShardIterable, **W2P)),
    "iterable_replay_w0": dict(make=_iterable(ShardIterable), compare="index"),
}
for _n, _s in SCENARIOS.items():
    _s.setdefault("compare", "exact")
    _s.setdefault("set_epoch", False)
    _s.setdefault("user_rng", "seed")
    _s.setdefault("uses_global_rng", "nogen" in _n)  # no generator=: torch's global RNG
    _s.setdefault("workers", 0 if "_w0" in _n else 2)
    _s.setdefault("resume_make", _s["make"])
    _s.setdefault("iterable", _n.startswith("iterable"))


def epoch_points(epoch, length):
    """The interrupt points taken in `epoch` (every one in epoch 0, a few in epoch 1: k=1
    with 2 workers is before worker 1 yielded anything of the epoch)."""
    if epoch == 0:
        return [f"e0k{k}" for k in range(length + 1)] + ["end0"]
    if epoch == 1:
        return ["e1k1", "e1k2", f"e1k{length}", "end1"]
    return []


def point_epoch(point):
    """The epoch `point` is in ("pre": 0)."""
    if point == "pre":
        return 0
    if point.startswith("end"):
        return int(point[3:])
    return int(point[1 : point.index("k")])


def ends_epoch(scen, point, length):
    """Whether `point` is right after the last of its epoch's `length` batches (before
    StopIteration) of a map-style scenario: such a state resumes with the next epoch whole
    (docs/resuming.md); an IterableDataset's resumes the epoch's (empty) rest."""
    return not scen["iterable"] and "k" in point and 0 < length == int(point.split("k")[1])


def start_epoch(point, ends=False):
    """The epoch a user who checkpointed at `point` restarts at (`ends`: see ends_epoch)."""
    return point_epoch(point) + (point.startswith("end") or ends)


# ------------------------------------------------------------------------------ running
def record(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, dict):
        return {k: record(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [record(v) for v in x]
    return x


def save_checkpoint(loader, path):
    """What a training script saves: the loader's state and torch's global RNG state."""
    buf = io.BytesIO()
    torch.save({"loader": loader.state_dict(), "torch_rng": torch.get_rng_state()}, buf)
    with open(path + ".tmp", "wb") as f:
        f.write(buf.getvalue())
    os.replace(path + ".tmp", path)


def training_loop(scen, loader, first_epoch, at_point=None):
    """The user's loop: set_epoch (where the scenario's sampler wants it), iter, batches.
    at_point(point, loader) is called at every interrupt point; it may stop the run."""
    epochs = []
    if first_epoch == 0 and at_point is not None:
        at_point("pre", loader)
    for epoch in range(first_epoch, EPOCHS):
        if scen["set_epoch"]:
            loader.sampler.set_epoch(epoch)
        batches = []
        it = iter(loader)
        if at_point is not None:
            at_point(f"e{epoch}k0", loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            batches.append(record(batch))
            del batch
            if at_point is not None:
                at_point(f"e{epoch}k{len(batches)}", loader)
        del it
        epochs.append(batches)
        if at_point is not None:
            at_point(f"end{epoch}", loader)
    return epochs


def _watchdog():
    """Dump the stacks and exit unless the next scenario ends within the time allowed."""
    faulthandler.dump_traceback_later(
        float(os.environ.get("RESUME_DRIVER_TIMEOUT", "120")), exit=True
    )


def run_full(out, names):
    results = {}
    for name in names:
        _watchdog()
        scen = SCENARIOS[name]
        try:
            seed_all()
            ref = training_loop(scen, scen["make"](), 0)
            taken_points = []

            def take(point, loader, name=name, ref=ref):
                epoch = point_epoch(point)
                if point == "pre" or point in epoch_points(epoch, len(ref[epoch])):
                    save_checkpoint(loader, os.path.join(out, f"{name}__{point}.pt"))
                    taken_points.append(point)

            seed_all()
            taken = training_loop(scen, scen["make"](), 0, take)
            results[name] = dict(ref=ref, taken=taken, points=taken_points, error=None)
        except Exception:  # noqa: BLE001 - reported to the test
            results[name] = dict(error=traceback.format_exc())
    with open(os.path.join(out, "full.pkl"), "wb") as f:
        pickle.dump(results, f)


class _Stop(Exception):
    pass


def run_interrupt(out, name, point):
    scen = SCENARIOS[name]
    seed_all()

    def take(p, loader):
        if p == point:
            save_checkpoint(loader, os.path.join(out, f"{name}__{point}.pt"))
            # Exit at once, iterator and workers alive (no cleanup of ours).
            sys.stdout.flush()
            sys.exit(0)

    loader = scen["make"]()
    training_loop(scen, loader, 0, take)
    sys.exit(f"point {point} never came")


def run_resume(out, names):
    results = {}
    for name in names:
        _watchdog()
        scen = SCENARIOS[name]
        results[name] = {}
        for path in sorted(glob.glob(os.path.join(out, f"{name}__*.pt"))):
            point = os.path.basename(path)[len(name) + 2 : -3]
            entry = results[name][point] = dict(
                epochs=None, warnings=[], warning_files=[], error=None
            )
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    seed_all()  # a fresh process's start-up, as in run_full
                    checkpoint = torch.load(path, weights_only=True)
                    if scen["user_rng"] == "restore":
                        torch.set_rng_state(checkpoint["torch_rng"])
                    loader = scen["resume_make"]()
                    loader.load_state_dict(checkpoint["loader"])
                    # The user's loop knows an epoch's last batch by len(loader).
                    ends = not scen["iterable"] and ends_epoch(scen, point, len(loader))
                    entry["epochs"] = training_loop(scen, loader, start_epoch(point, ends))
                    del loader
                entry["warnings"] = [str(w.message) for w in caught]
                entry["warning_files"] = [os.path.basename(w.filename) for w in caught]
            except Exception:  # noqa: BLE001 - reported to the test
                entry["error"] = traceback.format_exc()
    with open(os.path.join(out, "resume.pkl"), "wb") as f:
        pickle.dump(results, f)


def main(argv):
    _watchdog()
    mode, out = argv[0], argv[1]
    if mode == "full":
        run_full(out, argv[2].split(","))
    elif mode == "interrupt":
        run_interrupt(out, argv[2], argv[3])
    elif mode == "resume":
        run_resume(out, argv[2].split(","))
    else:
        sys.exit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    from tests.helpers.resume_driver import main as _main  # the importable copy (pickling by name)

    _main(sys.argv[1:])

"""One body of behaviour scenarios, each run through torch's DataLoader and through
shmloader.DataLoader with the same seeds; the outputs must be identical (docs/design.md, contract 1).

Every scenario reseeds `random`, torch and numpy before each of the two runs, builds a fresh
dataset (and fresh generators/samplers via `Fresh`), iterates the requested number of epochs while
keeping every batch alive (list(loader)), and records len(loader), the batches, the state of the
main process's global RNGs afterwards (same draws consumed) and the warnings torch emitted.
"""

import collections
import copy
import functools
import gc
import inspect
import io
import multiprocessing
import os
import pickle
import random
import re
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data._utils.collate import collate

from shmloader import DataLoader as ShmDataLoader
from shmloader._main import _torch_api
from tests.helpers import datasets as D
from tests.helpers.procs import forget, wait_until

# Scenarios whose workers must see the main process's objects as fork leaves
# them (a generator the dataset shares with its sampler, a default_collate_fn_map
# changed in place): torch's workers see them under fork only, so both loaders
# fork there, whatever the default start method.
FORKED = dict(num_workers=3, multiprocessing_context="fork")
FORKED_2 = dict(num_workers=2, multiprocessing_context="fork")

TorchDataLoader = tud.DataLoader
SEED = 20240611
NCPU = len(os.sched_getaffinity(0))


# --------------------------------------------------------------------------- harness
class Fresh:
    """A constructor argument that must be built anew for each run (generator, stateful sampler)."""

    def __init__(self, make):
        self.make = make


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _norm_warning(msg):
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", msg)


Result = collections.namedtuple("Result", "length epochs rng_after warnings")


def safe_len(loader):
    try:
        return len(loader)
    except Exception as e:  # noqa: BLE001 - the exception itself is what we compare
        forget(e)
        return ("raised", type(e), str(e))


def run(cls, make_dataset, *, epochs=1, seed=SEED, on_epoch=None, **kw):
    seed_all(seed)
    kw = {k: (v.make() if isinstance(v, Fresh) else v) for k, v in kw.items()}
    dataset = make_dataset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = cls(dataset, **kw)
        length = safe_len(loader)
        out = []
        for epoch in range(epochs):
            if on_epoch is not None:
                on_epoch(loader, epoch)
            out.append(list(loader))
        del loader
    rng_after = (random.random(), np.random.rand(), torch.rand(2))
    # C++ TORCH_WARN_ONCE warnings ("Triggered internally at ...") fire once per process, so
    # whichever loader runs second cannot see them: not comparable.
    warns = [
        (w.category, _norm_warning(str(w.message)))
        for w in caught
        if "Triggered internally" not in str(w.message)
    ]
    return Result(length, out, rng_after, warns)


def both(make_dataset, **kw):
    return run(TorchDataLoader, make_dataset, **kw), run(ShmDataLoader, make_dataset, **kw)


def assert_results_same(t, s, ordered=True):
    assert t.length == s.length, f"len(loader): torch {t.length} != shm {s.length}"
    assert len(t.epochs) == len(s.epochs)
    for e, (te, se) in enumerate(zip(t.epochs, s.epochs, strict=True)):
        assert len(te) == len(se), f"epoch {e}: torch yielded {len(te)} batches, shm {len(se)}"
        if ordered:
            for b, (x, y) in enumerate(zip(te, se, strict=True)):
                D.assert_same(x, y, f"epoch{e}.batch{b}")
        else:
            tc = collections.Counter(D.canon(x) for x in te)
            sc = collections.Counter(D.canon(y) for y in se)
            assert tc == sc, f"epoch {e}: batches differ as multisets"
    D.assert_same(t.rng_after, s.rng_after, "main-process RNG state after iterating")
    missing = list((collections.Counter(t.warnings) - collections.Counter(s.warnings)).elements())
    assert not missing, f"warnings torch emitted but shm did not: {missing}"


def each_next(loader, epochs=1):
    """What each next() of `epochs` epochs gave: the batch, or the error's type and last
    line (later batches still come after an error, as in torch)."""
    got = []
    for _ in range(epochs):
        it = iter(loader)
        while True:
            try:
                got.append(next(it))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - the error is what is compared
                forget(e)
                got.append((type(e), str(e).strip().splitlines()[-1]))
    return got


def check(make_dataset, ordered=True, **kw):
    t, s = both(make_dataset, **kw)
    assert_results_same(t, s, ordered=ordered)
    return t, s


def gen(seed):
    return Fresh(lambda: torch.Generator().manual_seed(seed))


P = functools.partial
W2 = dict(num_workers=2)


# --------------------------------------------------------------------------- the scenario grid
# id -> (dataset factory, loader kwargs incl. `epochs`/`on_epoch`)
SCENARIOS = {
    # map-style, sequential, batching
    "map-bs4-w2": (P(D.IndexMap, 20), dict(batch_size=4, **W2)),
    "map-bs3-droplast-w2": (P(D.IndexMap, 20), dict(batch_size=3, drop_last=True, **W2)),
    "map-bs3-keeplast-w2": (P(D.IndexMap, 20), dict(batch_size=3, drop_last=False, **W2)),
    "map-bs3-w0": (P(D.IndexMap, 20), dict(batch_size=3)),
    "map-bs3-droplast-w0": (P(D.IndexMap, 20), dict(batch_size=3, drop_last=True)),
    "map-bs3-w1": (P(D.IndexMap, 20), dict(batch_size=3, num_workers=1)),
    "map-bs2-w3": (P(D.IndexMap, 13), dict(batch_size=2, num_workers=3)),
    "map-default-bs-w2": (P(D.IndexMap, 7), dict(**W2)),
    "map-empty-w2": (P(D.IndexMap, 0), dict(batch_size=4, **W2)),
    "map-empty-w0": (P(D.IndexMap, 0), dict(batch_size=4)),
    "map-fewer-items-than-workers": (P(D.IndexMap, 1), dict(batch_size=4, **W2)),
    "map-bs-larger-than-ds-droplast": (P(D.IndexMap, 3), dict(batch_size=4, drop_last=True, **W2)),
    # shuffle, generator, worker seeds, get_worker_info()
    "rng-shuffle-global-w2": (P(D.RNGMap, 16), dict(batch_size=4, shuffle=True, epochs=2, **W2)),
    "rng-shuffle-generator-w2": (
        P(D.RNGMap, 16),
        dict(batch_size=4, shuffle=True, generator=gen(7), epochs=2, **W2),
    ),
    "rng-shuffle-w0": (P(D.RNGMap, 12), dict(batch_size=4, shuffle=True, epochs=2)),
    "rng-shuffle-generator-w0": (
        P(D.RNGMap, 12),
        dict(batch_size=4, shuffle=True, generator=gen(3), epochs=2),
    ),
    "rng-noshuffle-generator-w2": (P(D.RNGMap, 12), dict(batch_size=3, generator=gen(11), **W2)),
    "rng-w1": (P(D.RNGMap, 8), dict(batch_size=2, num_workers=1)),
    "rng-w3": (P(D.RNGMap, 14), dict(batch_size=2, num_workers=3)),
    # custom samplers / batch samplers
    "sampler-list": (P(D.IndexMap, 20), dict(batch_size=2, sampler=[7, 3, 3, 0, 19], **W2)),
    "sampler-reverse": (P(D.IndexMap, 11), dict(batch_size=3, sampler=D.ReverseSampler(11), **W2)),
    "sampler-random-generator": (
        P(D.RNGMap, 12),
        dict(
            batch_size=5,
            sampler=Fresh(
                lambda: tud.RandomSampler(range(12), generator=torch.Generator().manual_seed(5))
            ),
            epochs=2,
            **W2,
        ),
    ),
    "sampler-random-replacement-global": (
        P(D.IndexMap, 10),
        dict(
            batch_size=4,
            sampler=Fresh(lambda: tud.RandomSampler(range(10), replacement=True, num_samples=15)),
            epochs=2,
            **W2,
        ),
    ),
    "sampler-weighted-global": (
        P(D.RNGMap, 10),
        dict(
            batch_size=3,
            sampler=tud.WeightedRandomSampler(
                [0.1, 0.5, 1, 2, 0.3, 0.3, 4, 0.01, 1, 1], 13, replacement=True
            ),
            **W2,
        ),
    ),
    "sampler-subset-generator": (
        P(D.IndexMap, 20),
        dict(
            batch_size=2,
            sampler=Fresh(
                lambda: tud.SubsetRandomSampler(
                    [1, 4, 9, 16, 17], generator=torch.Generator().manual_seed(2)
                )
            ),
            **W2,
        ),
    ),
    "batch-sampler-lists": (
        P(D.IndexMap, 20),
        dict(batch_sampler=[[0, 1], [5], [2, 3, 4], [19, 18, 17, 16]], **W2),
    ),
    "batch-sampler-obj-droplast": (
        P(D.IndexMap, 20),
        dict(batch_sampler=tud.BatchSampler(tud.SequentialSampler(range(20)), 6, True), **W2),
    ),
    "batch-sampler-chunks-w0": (P(D.IndexMap, 10), dict(batch_sampler=D.ChunkBatchSampler(10))),
    "batch-sampler-chunks-w2": (P(D.RNGMap, 10), dict(batch_sampler=D.ChunkBatchSampler(10), **W2)),
    "sampler-keyerror-getattr-w2": (
        P(D.IndexMap, 9),
        dict(batch_size=2, sampler=D.KeyErrorSampler(9), **W2),
    ),
    "sampler-keyerror-getattr-w0": (
        P(D.IndexMap, 9),
        dict(batch_size=2, sampler=D.KeyErrorSampler(9)),
    ),
    "sampler-slots-keyerror-getattr-w2": (
        P(D.IndexMap, 9),
        dict(batch_size=2, sampler=D.SlotsKeyErrorSampler(9), **W2),
    ),
    # (forked: a dataset whose __getattr__ raises KeyError cannot be unpickled, by
    # torch's workers either, under spawn or forkserver)
    "iterable-keyerror-getattr-w2": (P(D.KeyErrorStream, 9), dict(batch_size=2, **FORKED_2)),
    "iterable-keyerror-getattr-w0": (P(D.KeyErrorStream, 9), dict(batch_size=2)),
    "batch-sampler-iterators-w2": (
        P(D.IndexMap, 12),
        dict(batch_sampler=D.IteratorBatchSampler(), **W2),
    ),
    "batch-sampler-iterators-w0": (P(D.IndexMap, 12), dict(batch_sampler=D.IteratorBatchSampler())),
    # batch_size=None (no auto-collation: default_convert per sample)
    "nobatch-rich-w2": (P(D.RichMap, 6), dict(batch_size=None, **W2)),
    "nobatch-rich-w0": (P(D.RichMap, 6), dict(batch_size=None)),
    "nobatch-shuffle-generator-w2": (
        P(D.RNGMap, 8),
        dict(batch_size=None, shuffle=True, generator=gen(1), **W2),
    ),
    "nobatch-sampler-w2": (P(D.IndexMap, 9), dict(batch_size=None, sampler=[8, 0, 4], **W2)),
    # custom collate_fn
    "collate-numpy-w2": (P(D.IndexMap, 10), dict(batch_size=3, collate_fn=D.numpy_collate, **W2)),
    "collate-numpy-w0": (P(D.IndexMap, 10), dict(batch_size=3, collate_fn=D.numpy_collate)),
    "collate-dict-w2": (P(D.RichMap, 8), dict(batch_size=3, collate_fn=D.dict_collate, **W2)),
    "collate-numpy-kinds-w2": (
        P(D.NumpyKindsMap, 12),
        dict(batch_size=2, collate_fn=D.identity_collate, **W2),
    ),
    "collate-object-w2": (P(D.IndexMap, 8), dict(batch_size=3, collate_fn=D.object_collate, **W2)),
    "collate-identity-growing-w2": (
        P(D.GrowingMap, 12),
        dict(batch_size=2, collate_fn=D.identity_collate, **W2),
    ),
    "collate-nobatch-identity-w2": (
        P(D.IndexMap, 6),
        dict(batch_size=None, collate_fn=D.identity_collate, **W2),
    ),
    # sample leaf kinds
    "rich-bs4-w2": (P(D.RichMap, 8), dict(batch_size=4, **W2)),
    "rich-bs3-w0": (P(D.RichMap, 7), dict(batch_size=3)),
    "getitems-w2": (P(D.GetItemsMap, 10), dict(batch_size=4, **W2)),
    "getitems-w0": (P(D.GetItemsMap, 10), dict(batch_size=4)),
    "getitems-nobatch-w2": (P(D.GetItemsMap, 5), dict(batch_size=None, **W2)),
    "growing-nobatch-w2": (P(D.GrowingMap, 12), dict(batch_size=None, **W2)),
    "growing-bs1-w2": (P(D.GrowingMap, 12), dict(batch_size=1, **W2)),
    "sparse-nobatch-w2": (P(D.SparseMap, 6), dict(batch_size=None, **W2)),
    # worker_init_fn
    "init-mark-w2": (
        P(D.WorkerStateMap, 12),
        dict(batch_size=3, worker_init_fn=D.mark_init_fn, **W2),
    ),
    "init-mark-w0": (P(D.WorkerStateMap, 12), dict(batch_size=3, worker_init_fn=D.mark_init_fn)),
    "init-reseed-w2": (
        P(D.RNGMap, 12),
        dict(batch_size=3, worker_init_fn=D.reseed_init_fn, shuffle=True, **W2),
    ),
    # prefetch_factor
    "prefetch1-w2": (P(D.RNGMap, 16), dict(batch_size=2, prefetch_factor=1, **W2)),
    "prefetch3-w2": (P(D.RNGMap, 16), dict(batch_size=2, prefetch_factor=3, **W2)),
    "prefetch1-w1": (P(D.IndexMap, 9), dict(batch_size=2, prefetch_factor=1, num_workers=1)),
    # persistent_workers over several epochs (worker RNG streams continue across epochs)
    "persistent-rng-3ep": (
        P(D.RNGMap, 12),
        dict(batch_size=3, shuffle=True, persistent_workers=True, epochs=3, **W2),
    ),
    "nonpersistent-rng-3ep": (
        P(D.RNGMap, 12),
        dict(batch_size=3, shuffle=True, persistent_workers=False, epochs=3, **W2),
    ),
    "persistent-generator-2ep": (
        P(D.RNGMap, 12),
        dict(batch_size=4, shuffle=True, generator=gen(9), persistent_workers=True, epochs=2, **W2),
    ),
    "persistent-init-mark-2ep": (
        P(D.WorkerStateMap, 8),
        dict(batch_size=3, worker_init_fn=D.mark_init_fn, persistent_workers=True, epochs=2, **W2),
    ),
    "persistent-iterable-rng-3ep": (
        P(D.RNGIterable, 9),
        dict(batch_size=2, persistent_workers=True, epochs=3, **W2),
    ),
    "persistent-rich-prefetch1-2ep": (
        P(D.RichMap, 6),
        dict(batch_size=2, persistent_workers=True, prefetch_factor=1, epochs=2, **W2),
    ),
    # timeout that never fires does not change anything (generous: it bounds each wait)
    "timeout-generous-w2": (P(D.RNGMap, 8), dict(batch_size=2, timeout=120.0, **W2)),
    # pin_memory on a CPU-only machine: same warning, same data
    "pin-memory-w2": (P(D.RichMap, 6), dict(batch_size=3, pin_memory=True, epochs=2, **W2)),
    "pin-memory-w0": (P(D.RichMap, 4), dict(batch_size=2, pin_memory=True)),
    "pin-memory-persistent-2ep": (
        P(D.IndexMap, 6),
        dict(batch_size=2, pin_memory=True, persistent_workers=True, epochs=2, **W2),
    ),
    # iterable-style datasets: sharding via get_worker_info(), uneven shards, drop_last per worker
    "iter-bs3-w2": (P(D.ShardedIterable, 11), dict(batch_size=3, **W2)),
    "iter-bs3-droplast-w2": (P(D.ShardedIterable, 11), dict(batch_size=3, drop_last=True, **W2)),
    "iter-bs2-w3-uneven": (P(D.ShardedIterable, 10), dict(batch_size=2, num_workers=3)),
    "iter-bs3-w0": (P(D.ShardedIterable, 11), dict(batch_size=3)),
    "iter-nobatch-w2": (P(D.ShardedIterable, 7), dict(batch_size=None, **W2)),
    "iter-nobatch-w0": (P(D.ShardedIterable, 7), dict(batch_size=None)),
    "iter-unsharded-duplicates-w2": (P(D.UnshardedIterable, 5), dict(batch_size=2, **W2)),
    "iter-empty-w2": (P(D.ShardedIterable, 0), dict(batch_size=2, **W2)),
    "iter-one-item-w2": (P(D.ShardedIterable, 1), dict(batch_size=2, **W2)),
    "iter-rng-w2": (P(D.RNGIterable, 10), dict(batch_size=3, **W2)),
    "iter-rng-generator-w2": (P(D.RNGIterable, 10), dict(batch_size=3, generator=gen(4), **W2)),
    "iter-rich-w2": (P(D.RichIterable, 8), dict(batch_size=3, **W2)),
    "iter-len-w2": (P(D.LenIterable, 11), dict(batch_size=3, **W2)),
    "iter-len-droplast-w2": (P(D.LenIterable, 11), dict(batch_size=3, drop_last=True, **W2)),
    "iter-len-lying-w2": (P(D.LyingLenIterable, 10), dict(batch_size=2, **W2)),
    "iter-len-lying-w0": (P(D.LyingLenIterable, 10), dict(batch_size=2)),
    "iter-shard-init-fn-w2": (
        P(D.RangeIterable, 3, 20),
        dict(batch_size=4, worker_init_fn=D.shard_init_fn, **W2),
    ),
    "iter-shard-init-fn-w3": (
        P(D.RangeIterable, 3, 20),
        dict(batch_size=4, worker_init_fn=D.shard_init_fn, num_workers=3),
    ),
    "iter-collate-identity-w2": (
        P(D.ShardedIterable, 9),
        dict(batch_size=2, collate_fn=D.identity_collate, **W2),
    ),
    "iter-prefetch3-w2": (P(D.ShardedIterable, 15), dict(batch_size=2, prefetch_factor=3, **W2)),
    # in_order=False with a single worker: order is still identical
    "unordered-w1-map": (P(D.JitterMap, 17), dict(batch_size=2, in_order=False, num_workers=1)),
    "unordered-w1-iter": (
        P(D.ShardedIterable, 9),
        dict(batch_size=2, in_order=False, num_workers=1),
    ),
    "unordered-w0": (P(D.IndexMap, 9), dict(batch_size=2, in_order=False)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_output(name):
    make_dataset, kw = SCENARIOS[name]
    check(make_dataset, **kw)


# in_order=False with several workers: same batches, compared as multisets (the order, and which
# worker gets which batch, depend on timing, in torch too)
@pytest.mark.parametrize(
    "make_dataset, kw",
    [
        pytest.param(P(D.JitterMap, 24), dict(batch_size=2), id="map"),
        # (no RNG-drawing dataset here: with in_order=False torch itself assigns batches to the
        # least-busy worker, so which worker's RNG a sample draws from depends on timing)
        pytest.param(
            P(D.IndexMap, 12),
            dict(batch_size=2, shuffle=True, generator=gen(3), epochs=2),
            id="shuffle",
        ),
        pytest.param(P(D.ShardedIterable, 13), dict(batch_size=2), id="iterable"),
        pytest.param(
            P(D.JitterMap, 16),
            dict(batch_size=2, persistent_workers=True, epochs=2),
            id="persistent",
        ),
    ],
)
def test_in_order_false_same_multiset(make_dataset, kw):
    check(make_dataset, ordered=False, in_order=False, num_workers=2, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [2, None], ids=["batches", "samples"])
def test_in_order_false_yields_each_workers_batches_in_its_order(batch_size):
    """torch's one result queue never reorders a worker's batches, even with
    in_order=False; a stateful IterableDataset's resume relies on it. Here worker 0's first
    batches take the pipe (no ring yet) while worker 1's later ones take slots."""
    for _ in range(3):
        loader = ShmDataLoader(
            D.ShardedIterable(40),
            batch_size=batch_size,
            num_workers=2,
            in_order=False,
            worker_init_fn=D.late_worker_0_init_fn,
        )
        seen = collections.defaultdict(list)  # worker -> its items, as yielded
        for batch in loader:
            items = batch["i"].tolist() if batch_size else [int(batch["i"])]
            seen[items[0] % 2] += items
        assert dict(seen) == {w: sorted(seen[w]) for w in seen}
        assert sorted(seen[0] + seen[1]) == list(range(40))


# --------------------------------------------------------------------------- start methods
MP_SCENARIOS = {
    # seeds, get_worker_info(), worker_init_fn, generator, persistent workers
    "rng-init-persistent": (
        P(D.RNGMap, 8),
        dict(
            batch_size=2,
            shuffle=True,
            generator=gen(13),
            worker_init_fn=D.reseed_init_fn,
            persistent_workers=True,
            epochs=2,
        ),
    ),
    # iterable sharding + many leaf kinds
    "iter-rich": (P(D.RichIterable, 6), dict(batch_size=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
@pytest.mark.parametrize("name", list(MP_SCENARIOS))
def test_start_methods(method, name):
    make_dataset, kw = MP_SCENARIOS[name]
    check(make_dataset, num_workers=2, multiprocessing_context=method, **kw)


@pytest.mark.slow
def test_start_method_context_object():
    ctx = multiprocessing.get_context("spawn")
    check(
        P(D.WorkerStateMap, 6),
        batch_size=2,
        num_workers=2,
        multiprocessing_context=ctx,
        worker_init_fn=D.mark_init_fn,
    )


# --------------------------------------------------------------------------- batches as objects
SERIALIZE_CASES = {
    "tuple-int64-float32": (P(D.IndexMap, 40), dict(batch_size=4, num_workers=2)),
    "dict-mixed-dtypes": (P(D.RNGMap, 24), dict(batch_size=3, num_workers=2)),
    "rich": (P(D.RichMap, 16), dict(batch_size=2, num_workers=2)),
    "growing-nobatch": (P(D.GrowingMap, 10), dict(batch_size=None, num_workers=2)),
}


def _serialize(batch, how):
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(batch, buf)
        return buf.getvalue(), lambda b: torch.load(io.BytesIO(b), weights_only=False)
    data = pickle.dumps(batch)
    return data, pickle.loads


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("name", list(SERIALIZE_CASES))
def test_batches_serialize_like_torch(name, how):
    """Users torch.save / pickle batches (caches, debugging, handing them to other processes).
    Every batch must round-trip to the same value as torch's, and its serialized size must not be
    far above torch's (a leaf must not drag a whole slot's bytes along)."""
    make_dataset, kw = SERIALIZE_CASES[name]
    t = run(TorchDataLoader, make_dataset, **kw).epochs[0]
    s = run(ShmDataLoader, make_dataset, **kw).epochs[0]
    assert len(t) == len(s)
    for k, (tb, sb) in enumerate(zip(t, s, strict=True)):
        t_bytes, load = _serialize(tb, how)
        try:
            s_bytes, _ = _serialize(sb, how)
        except Exception as e:  # noqa: BLE001
            forget(e)
            pytest.fail(
                f"batch {k}: {how} raised {type(e).__name__}: {e} (torch's batch serializes)"
            )
        D.assert_same(load(t_bytes), load(s_bytes), f"batch{k} after {how}")
        assert len(s_bytes) <= 2 * len(t_bytes) + 1024, (
            f"batch {k}: {how} wrote {len(s_bytes)} bytes, torch's batch {len(t_bytes)}"
        )


def _grow_in_place(cls):
    """resize_ one leaf of each batch to 8x its size and fill it; record what happened and whether
    the batch's other leaf, and every other batch, kept its values."""
    seed_all(SEED)
    out = list(cls(D.IndexMap(40), batch_size=4, num_workers=2))
    before = [(i.clone(), x.clone()) for i, x in out]
    events = []
    for k, (idx, x) in enumerate(out):
        try:
            x.resize_(x.numel() * 8).fill_(-1)
            events.append(("resized", tuple(x.shape)))
        except Exception as e:  # noqa: BLE001
            events.append(("raised", type(e), str(e)))
            forget(e)
        assert torch.equal(idx, before[k][0]), f"batch {k}: growing one leaf overwrote its sibling"
    for k, (idx, _) in enumerate(out):
        assert torch.equal(idx, before[k][0]), (
            f"batch {k}: changed by an in-place op on another batch"
        )
    return events


def test_resizing_a_leaf_in_place_behaves_like_torch():
    """In torch a batch leaf owns its storage: resize_ beyond it raises. A leaf that views a
    bigger shared storage must not silently grow over its neighbours' bytes."""
    D.assert_same(_grow_in_place(TorchDataLoader), _grow_in_place(ShmDataLoader), "resize_ events")


def _profiled_batch_events(cls, kind):
    """How many of torch's per-batch "enumerate(DataLoader)#..." events a profiler
    records over one epoch, and the batches yielded."""
    loader = cls(kind(12), batch_size=3, num_workers=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        batches = len(list(loader))
    events = [e for e in prof.events() if e.name.startswith("enumerate(DataLoader)#")]
    return len(events), batches


@pytest.mark.slow
@pytest.mark.parametrize("kind", [D.RNGMap, D.ShardedIterable])
def test_profiler_sees_every_batch_like_torch(kind):
    """shmloader skips torch's per-batch record_function only while no profiler
    is on; under one, each batch is recorded as torch records it."""
    got = _profiled_batch_events(ShmDataLoader, kind)
    assert got == _profiled_batch_events(TorchDataLoader, kind)
    assert got[0] >= got[1] > 0  # torch records the call that ends the epoch too


# --------------------------------------------------------------------------- RNG draw order
def test_main_process_draws_base_seed_before_sampler():
    """The loader must consume the global torch RNG exactly like torch: base seed first, then the
    sampler's seed, per epoch. Checked through the samples (worker seeds, shuffle order) and the
    global RNG state afterwards (check() compares both)."""
    t, s = check(P(D.RNGMap, 10), batch_size=5, shuffle=True, num_workers=2, epochs=2)
    # Guard against a vacuous pass: the two epochs really shuffled and seeded differently.
    e0 = torch.cat([b["index"] for b in t.epochs[0]]).tolist()
    e1 = torch.cat([b["index"] for b in t.epochs[1]]).tolist()
    assert e0 != e1 and sorted(e0) == list(range(10))
    assert t.epochs[0][0]["seed"][0] != t.epochs[1][0]["seed"][0]


def test_worker_info_and_seed_fields():
    t, s = check(P(D.RNGMap, 8), batch_size=2, num_workers=2)
    for b, batch in enumerate(s.epochs[0]):
        assert batch["wid"].tolist() == [b % 2] * 2  # round-robin from worker 0
        assert batch["num_workers"].tolist() == [2, 2]
        assert batch["same_dataset"].tolist() == [True, True]
        assert batch["threads"].tolist() == [1, 1]
        assert batch["seed"] == batch["initial_seed"]


# --------------------------------------------------------------------------- how samples stack
# Batches made before the ring is sized (slot_bytes=None), and while every slot is held (a ring
# of 3 slots, every batch kept): both are stacked in the worker's own memory, not in a slot.
OUTSIDE_AND_IN_THE_RING = pytest.mark.parametrize(
    "ring", [dict(), dict(slot_bytes=1 << 16, num_slots=3)], ids=["sized-later", "ring-full"]
)


@OUTSIDE_AND_IN_THE_RING
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32, torch.float64), (torch.uint8, torch.int64), (torch.int64, torch.float32)],
    ids=str,
)
def test_samples_of_mixed_dtypes_stack_as_torchs_workers_do(dtypes, ring):
    """torch's collate in a worker stacks into a tensor of the first sample's dtype: 300 wraps
    to 44 in uint8, float64 rounds to float32, and float32 samples after an int64 one fail to
    cast.  A plain torch.stack would promote instead."""

    def go(cls, **kw):
        return each_next(cls(D.MixedDtypeMap(dtypes=dtypes), batch_size=2, **W2, **kw))

    D.assert_same(go(TorchDataLoader), go(ShmDataLoader, **ring))


@OUTSIDE_AND_IN_THE_RING
def test_channels_last_samples_stack_into_contiguous_batches(ring):
    """torch's collate in a worker stacks into a contiguous tensor, whatever the samples'
    memory format: a plain torch.stack of channels_last samples would keep their strides."""

    def go(cls, **kw):
        return [b.stride() for b in cls(D.ChannelsLastMap(), batch_size=2, **W2, **kw)]

    assert go(ShmDataLoader, **ring) == go(TorchDataLoader)
    kw = dict(batch_size=2, **W2)
    assert_results_same(
        run(TorchDataLoader, D.ChannelsLastMap, **kw),
        run(P(ShmDataLoader, **ring), D.ChannelsLastMap, **kw),
    )


@pytest.mark.parametrize("slot_bytes", [None, 1 << 16], ids=["sized-later", "ring"])
def test_a_tensor_subclass_stacked_in_a_slot_leaves_later_batches_intact(slot_bytes):
    """A batch stacked into its slot that comes out a tensor subclass (one sample was one)
    travels through torch's pickling, which would move the slot's whole storage into shared
    memory of its own: the worker's later batches, written there, never reached the ring, and
    their slots kept older bytes.  Every batch must be torch's, the subclass's one included."""
    kw = dict(batch_size=2, **W2)
    t = run(TorchDataLoader, D.SubclassSampleMap, **kw)
    assert_results_same(t, run(P(ShmDataLoader, slot_bytes=slot_bytes), D.SubclassSampleMap, **kw))
    assert type(t.epochs[0][11]) is D.MarkedTensor  # (sample 23: the case is real)


@pytest.mark.one_mode  # names its start method; process names
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_workers_process_names_are_torchs(context):
    """A worker's process name (logging's %(processName)s) is its start method's class's, as
    in torch's workers, under shmloader's own servers too."""

    def go(cls):
        loader = cls(
            D.ProcessNameMap(), batch_size=None, num_workers=2, multiprocessing_context=context
        )
        return list(loader)

    assert go(ShmDataLoader) == go(TorchDataLoader)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_process_names_are_torchs_under_the_default_start_method(method):
    """Given no multiprocessing_context, torch starts its workers as multiprocessing.Process
    ("Process-3"), whatever the default start method (forkserver on Python 3.14): so do
    shmloader's servers."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        names = {
            cls: list(cls(D.ProcessNameMap(), batch_size=None, num_workers=2))
            for cls in (ShmDataLoader, TorchDataLoader)
        }
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert names[ShmDataLoader] == names[TorchDataLoader] == ["Process", "Process"]


@pytest.mark.parametrize("dataset", [D.IndexMap, D.IndexIterable])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_tools_next_in_place_of_torchs_runs_for_every_batch(monkeypatch, dataset, num_workers):
    """Tools put their own _BaseDataLoaderIter.__next__ in torch's place (InfoBatch takes each
    batch's indices from it to prune the dataset; tracers time it): torch's iterators all run
    it, and so must shmloader's."""
    taken = []

    def infobatch_next(self):  # InfoBatch's, trimmed: samples are (index, data)
        if self._sampler_iter is None:
            self._reset()
        indices, data = self._next_data()
        self._num_yielded += 1
        taken.append(indices.tolist())
        return data

    monkeypatch.setattr(tud.dataloader._BaseDataLoaderIter, "__next__", infobatch_next)

    def go(cls):
        taken.clear()
        batches = [b.tolist() for b in cls(dataset(), batch_size=4, num_workers=num_workers)]
        return batches, list(taken)

    batches, indices = go(ShmDataLoader)
    assert (batches, indices) == go(TorchDataLoader)
    assert len(indices) == len(batches) > 0  # (the patch ran for every batch)


# A training script whose dataset draws from torch's and numpy's global generators as it is
# unpickled in a worker, before the worker's seeding; with SEED_AT_IMPORT set, the script
# seeds both at module level, which a spawned worker runs again as it imports the script;
# with PRELOAD_TORCH set, it has the forkserver preload torch.
_DRAWS_BEFORE_SEEDING = """
import json, os, sys
import numpy as np
import torch
import torch.utils.data as tud
import shmloader

if os.environ.get("SEED_AT_IMPORT"):
    torch.manual_seed(7)
    np.random.seed(7)
if os.environ.get("PRELOAD_TORCH"):
    import multiprocessing

    multiprocessing.set_forkserver_preload(["__main__", "torch"])


class Drawn(tud.Dataset):
    def __init__(self):
        self.draws = None

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.draws = [float(torch.rand(())), float(np.random.rand())]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(self.draws, dtype=torch.float64)


if __name__ == "__main__":
    out = {}
    for name, cls in (("torch", tud.DataLoader), ("shmloader", shmloader.DataLoader)):
        loader = cls(Drawn(), batch_size=1, num_workers=2, multiprocessing_context=sys.argv[1])
        out[name] = [batch[0].tolist() for batch in loader]
    print(json.dumps(out))
"""


@pytest.mark.one_mode  # each names its start method; what is drawn before the seeding
@pytest.mark.parametrize(
    "method, seed_at_import, preload_torch",
    [
        ("spawn", False, False),
        ("spawn", True, False),
        ("forkserver", False, False),
        ("forkserver", True, False),
        ("forkserver", False, True),
    ],
)
def test_draws_before_the_workers_seeding_are_torchs(
    tmp_path, method, seed_at_import, preload_torch
):
    """What a worker draws from torch's and numpy's global generators before torch's seeding
    (its dataset's unpickling): under spawn (and a forkserver that preloads no torch) each of
    torch's workers is a fresh process, so its draws are its own; shmloader's fork from a
    server that has imported torch and numpy, and must draw as fresh processes do, not the
    server's values, the same in every worker.  Where the user's forkserver preloads torch,
    torch's workers all start from its server's state, and shmloader's from its own server's
    (the same draws in every worker, in both).  A script that seeds at module level makes
    the draws torch's exactly (a spawned worker runs that seeding as it imports the script,
    so the reseeding after the fork must come first)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "draws.py"
    script.write_text(_DRAWS_BEFORE_SEEDING)
    env = {
        **os.environ,
        "SEED_AT_IMPORT": "1" if seed_at_import else "",
        "PRELOAD_TORCH": "1" if preload_torch else "",
    }
    done = subprocess.run(
        [sys.executable, str(script), method], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for name, draws in out.items():  # workers 0, 1, 0, 1: each worker's dataset drew once
        assert draws[0] == draws[2] and draws[1] == draws[3], (name, draws)
    shared = {name: draws[0] == draws[1] for name, draws in out.items()}
    assert shared["shmloader"] == shared["torch"], out
    if seed_at_import:
        assert out["shmloader"] == out["torch"]


# --------------------------------------------------------------------------- epochs with a break
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("slot_bytes", [None, 1 << 16], ids=["sized-later", "ring"])
def test_partial_epoch_then_full_epoch(persistent, slot_bytes):
    """After a break, the next epochs draw what torch's do: persistent workers compute the
    tasks still queued from the broken epoch (their RNG draws count), as torch's do."""

    def go(cls):
        seed_all(SEED)
        loader = cls(
            D.RNGMap(24), batch_size=2, shuffle=True, num_workers=2, persistent_workers=persistent
        )
        it = iter(loader)
        first = [next(it), next(it)]
        del it
        second = list(loader)
        third = list(loader)
        return first, second, third, torch.rand(2)

    D.assert_same(go(TorchDataLoader), go(P(ShmDataLoader, slot_bytes=slot_bytes)))


# --------------------------------------------------------------------------- prefetch bound
@pytest.mark.parametrize("prefetch_factor", [1, 3])
@pytest.mark.parametrize("persistent", [False, True])
def test_prefetch_bound(prefetch_factor, persistent):
    """At most prefetch_factor * num_workers batches are dispatched (pulled from the batch
    sampler) and not yet yielded, at every step, over two epochs."""
    nw, n, bs = 2, 40, 2
    bound = prefetch_factor * nw

    def go(cls):
        sampler = D.CountingBatchSampler(n, bs)
        loader = cls(
            D.IndexMap(n),
            batch_sampler=sampler,
            num_workers=nw,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent,
        )
        trace, batches = [], []
        for _ in range(2):
            start = sampler.pulled
            for k, batch in enumerate(loader, 1):
                batches.append(batch)
                trace.append(sampler.pulled - start - k)
        return trace, batches

    t_trace, t_batches = go(TorchDataLoader)
    s_trace, s_batches = go(ShmDataLoader)
    D.assert_same(t_batches, s_batches)
    assert max(t_trace) <= bound  # sanity: torch obeys the bound it defines
    assert max(s_trace) <= bound, (
        f"shm had up to {max(s_trace)} batches outstanding (bound {bound}); "
        f"per-step outstanding shm={s_trace} torch={t_trace}"
    )


@pytest.mark.parametrize("slot_bytes", [4096, None], ids=["ring", "sized-later"])
def test_more_batches_in_flight_than_a_ring_holds(slot_bytes):
    """prefetch_factor * num_workers above a ring's most slots (4096) is a valid torch
    setting: the ring gets its most slots, and the batches beyond them travel by torch's
    transport, with the ring-full warning."""
    kw = dict(batch_size=2, num_workers=2, prefetch_factor=2047)
    expected = list(TorchDataLoader(D.IndexMap(40), **kw))
    loader = ShmDataLoader(D.IndexMap(40), slot_bytes=slot_bytes, **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "shmloader: all 4096 ring slots are in use")
        D.assert_same(expected, list(loader))
    if slot_bytes:  # (sized later, every batch of this epoch is sent before the ring exists)
        assert loader.stats().slot_batches > 0


# --------------------------------------------------------------------------- worker exceptions
def exc_summary(e, workers):
    """Type + message. From a worker the message embeds a traceback whose frames are the
    loader's own code, so compare its header, its last line and that the dataset frame is in it."""
    msg = str(e)
    if workers == 0:
        return type(e), msg
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    return type(e), lines[0], lines[1], lines[-1]


def _run_failing(cls, *, num_workers, persistent, exc, mode, context=None):
    seed_all(SEED)
    ds = D.FailingMap(12, bad=(3, 8), exc=exc)
    sampler = D.SettableSampler(range(12))
    kw = dict(num_workers=num_workers, persistent_workers=persistent) if num_workers else {}
    if context is not None:
        kw["multiprocessing_context"] = context
    loader = cls(ds, batch_size=2, sampler=sampler, **kw)
    events = []
    it = iter(loader)
    for _ in range(20):  # bounded: a loader that re-raises forever must not hang the test
        try:
            events.append(("batch", next(it)))
        except StopIteration:
            events.append(("stop",))
            break
        except Exception as e:  # noqa: BLE001
            events.append(("exc",) + exc_summary(e, num_workers))
            if num_workers:
                assert "__getitem__" in str(e), "worker traceback missing the dataset frame"
            forget(e)
            if mode == "abandon":
                break
    del it
    gc.collect()
    sampler.indices = [i for i in range(12) if i not in ds.bad]
    events.append(("next-epoch", list(loader)))
    return events


@pytest.mark.parametrize("exc", ["ValueError", "KeyError", "TwoArgError"])
@pytest.mark.parametrize("mode", ["abandon", "continue"])
@pytest.mark.parametrize(
    "num_workers, persistent",
    [(0, False), (2, False), (2, True)],
    ids=["w0", "w2", "w2-persistent"],
)
@pytest.mark.slow
def test_worker_exception(exc, mode, num_workers, persistent):
    t = _run_failing(
        TorchDataLoader, num_workers=num_workers, persistent=persistent, exc=exc, mode=mode
    )
    s = _run_failing(
        ShmDataLoader, num_workers=num_workers, persistent=persistent, exc=exc, mode=mode
    )
    assert any(ev[0] == "exc" for ev in t)
    D.assert_same(t, s, "events")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_worker_exception_start_methods(method):
    kw = dict(num_workers=2, persistent=True, exc="KeyError", mode="continue", context=method)
    D.assert_same(_run_failing(TorchDataLoader, **kw), _run_failing(ShmDataLoader, **kw), "events")


def _run_until_error(cls, make_dataset, **kw):
    seed_all(SEED)
    loader = cls(make_dataset(), **kw)
    got = []
    try:
        for batch in loader:
            got.append(batch)
            if len(got) > 50:
                break
    except Exception as e:  # noqa: BLE001
        got.append(exc_summary(e, kw.get("num_workers", 0)))
        forget(e)
    del loader
    gc.collect()
    return got


@pytest.mark.parametrize(
    "make_dataset, kw",
    [
        pytest.param(P(D.NoneMap, 10), dict(batch_size=2, num_workers=2), id="collate-error-w2"),
        pytest.param(P(D.NoneMap, 10), dict(batch_size=2), id="collate-error-w0"),
        pytest.param(
            P(D.FailingIterable, 12), dict(batch_size=None, num_workers=2), id="iterable-w2"
        ),
        pytest.param(
            P(D.IndexMap, 8),
            dict(batch_size=2, num_workers=2, worker_init_fn=D.failing_init_fn),
            id="init-fn-w2",
        ),
    ],
)
def test_error_surfaces_like_torch(make_dataset, kw):
    t = _run_until_error(TorchDataLoader, make_dataset, **kw)
    s = _run_until_error(ShmDataLoader, make_dataset, **kw)
    assert isinstance(t[-1], tuple) and isinstance(t[-1][0], type)
    D.assert_same(t, s, "until-error")


def test_pin_memory_device_like_torch():
    """pin_memory_device="cpu": later torch ignores it (deprecated) and pins nothing without
    an accelerator; torch 2.6 takes it as the device to pin for and, without CUDA, fails as
    its iterator starts.  shmloader does what the installed torch does."""

    def run(cls):
        seed_all(SEED)
        loader = cls(D.IndexMap(6), batch_size=2, pin_memory=True, pin_memory_device="cpu", **W2)
        try:
            return list(loader)
        except Exception as e:  # noqa: BLE001
            # (a pin thread's error embeds its traceback: its header and last line)
            lines = str(e).splitlines()
            return [(type(e), lines[0], lines[-1])]

    D.assert_same(run(TorchDataLoader), run(ShmDataLoader), "pin-memory-device")


# --------------------------------------------------------------------------- timeout
def _run_timeout(cls):
    seed_all(SEED)
    # Batch 2 (sample 4) never comes: its worker sleeps until the shutdown terminates it.
    loader = cls(D.SlowMap(6, slow=(4,), delay=600.0), batch_size=2, num_workers=2, timeout=1.0)
    got = []
    try:
        for batch in loader:
            got.append(batch)
    except Exception as e:  # noqa: BLE001
        got.append((type(e), str(e)))
        forget(e)
    del loader
    gc.collect()
    return got


@pytest.mark.slow
def test_timeout_raises_like_torch():
    """torch's error where a batch never comes.  The batches before it come first, unless a
    loaded machine kept one longer than the 1 s timeout too (it bounds each wait): each
    loader yields a prefix of them, then the error."""
    t = _run_timeout(TorchDataLoader)
    s = _run_timeout(ShmDataLoader)
    assert t[-1] == s[-1] == (RuntimeError, "DataLoader timed out after 1.0 seconds")
    before = [torch.tensor([[0], [1]]), torch.tensor([[2], [3]])]
    D.assert_same(before[: len(t) - 1], t[:-1], "torch's batches before the timeout")
    D.assert_same(before[: len(s) - 1], s[:-1], "shm's batches before the timeout")


@pytest.mark.parametrize("timeout", [3e6, float("inf")], ids=["a-month", "inf"])
@pytest.mark.parametrize("fetch", ["batch", "sample"])
def test_a_timeout_beyond_pollings_milliseconds_is_taken(timeout, fetch):
    """poll() counts milliseconds in a C int (24.8 days): torch's loader raises OverflowError
    from its queue for a longer timeout; shmloader waits in parts, before the ring exists
    (the first batches) and after."""
    loader = ShmDataLoader(
        D.IndexMap(40), batch_size=4, num_workers=2, timeout=timeout, fetch=fetch
    )
    D.assert_same(list(loader), list(TorchDataLoader(D.IndexMap(40), batch_size=4)), "batches")


def test_timeout_with_num_workers_0_fails_like_torch():
    def go(cls):
        loader = cls(D.IndexMap(4), timeout=1.0)
        try:
            iter(loader)
        except Exception as e:  # noqa: BLE001
            forget(e)
            return type(e), str(e)
        return None

    assert go(TorchDataLoader) == go(ShmDataLoader)


# --------------------------------------------------------------------------- constructor contract
def test_is_a_torch_dataloader():
    loader = ShmDataLoader(D.IndexMap(4), batch_size=2, num_workers=2)
    assert isinstance(loader, TorchDataLoader)


def test_signature_matches_torch():
    tp = inspect.signature(TorchDataLoader.__init__).parameters
    sp = dict(inspect.signature(ShmDataLoader.__init__).parameters)
    defaults = dict(
        slot_bytes=None,
        num_slots=None,
        fetch="batch",
        assignment=None,
        seed_per_sample=False,
        prefetch_next_epoch=False,
        device=None,
    )
    extra = {k: sp.pop(k) for k in defaults}
    assert [(p.name, p.kind, p.default) for p in tp.values()] == [
        (p.name, p.kind, p.default) for p in sp.values()
    ]
    for name, p in extra.items():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == defaults[name]


_SAMPLER = tud.SequentialSampler(range(5))
_BATCH_SAMPLER = tud.BatchSampler(_SAMPLER, 2, False)

INVALID = {
    "num_workers-negative": (P(D.IndexMap, 5), dict(num_workers=-1)),
    "timeout-negative": (P(D.IndexMap, 5), dict(timeout=-1)),
    "prefetch-without-workers": (P(D.IndexMap, 5), dict(prefetch_factor=2)),
    "prefetch-negative": (P(D.IndexMap, 5), dict(num_workers=2, prefetch_factor=-1)),
    "persistent-without-workers": (P(D.IndexMap, 5), dict(persistent_workers=True)),
    "iterable-shuffle": (P(D.ShardedIterable, 5), dict(shuffle=True)),
    "iterable-sampler": (P(D.ShardedIterable, 5), dict(sampler=_SAMPLER)),
    "iterable-batch-sampler": (P(D.ShardedIterable, 5), dict(batch_sampler=_BATCH_SAMPLER)),
    "sampler-and-shuffle": (P(D.IndexMap, 5), dict(sampler=_SAMPLER, shuffle=True)),
    "batch-sampler-and-batch-size": (
        P(D.IndexMap, 5),
        dict(batch_sampler=_BATCH_SAMPLER, batch_size=2),
    ),
    "batch-sampler-and-shuffle": (
        P(D.IndexMap, 5),
        dict(batch_sampler=_BATCH_SAMPLER, shuffle=True),
    ),
    "batch-sampler-and-sampler": (
        P(D.IndexMap, 5),
        dict(batch_sampler=_BATCH_SAMPLER, sampler=_SAMPLER),
    ),
    "batch-sampler-and-drop-last": (
        P(D.IndexMap, 5),
        dict(batch_sampler=_BATCH_SAMPLER, drop_last=True),
    ),
    "batch-size-none-drop-last": (P(D.IndexMap, 5), dict(batch_size=None, drop_last=True)),
    "batch-size-zero": (P(D.IndexMap, 5), dict(batch_size=0)),
    "batch-size-negative": (P(D.IndexMap, 5), dict(batch_size=-3)),
    "batch-size-float": (P(D.IndexMap, 5), dict(batch_size=2.0)),
    "drop-last-not-bool": (P(D.IndexMap, 5), dict(drop_last="yes")),
    "mp-context-bogus": (P(D.IndexMap, 5), dict(num_workers=2, multiprocessing_context="bogus")),
    "mp-context-wrong-type": (P(D.IndexMap, 5), dict(num_workers=2, multiprocessing_context=42)),
    "mp-context-without-workers": (P(D.IndexMap, 5), dict(multiprocessing_context="fork")),
    "shuffle-empty-dataset": (P(D.IndexMap, 0), dict(shuffle=True)),
    "iterable-batch-size-none-drop-last": (
        P(D.RangeIterable, 0, 3),
        dict(batch_size=None, drop_last=True),
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_arguments_raise_like_torch(name):
    make_dataset, kw = INVALID[name]
    dataset = make_dataset()
    results = []
    for cls in (TorchDataLoader, ShmDataLoader):
        with pytest.raises(Exception) as info:
            cls(dataset, **kw)
        results.append((info.type, str(info.value)))
    assert results[0] == results[1], f"torch raised {results[0]}, shm raised {results[1]}"


@pytest.mark.parametrize(
    "attr", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"]
)
def test_setting_frozen_attribute_raises_like_torch(attr):
    results = []
    for cls in (TorchDataLoader, ShmDataLoader):
        loader = cls(D.IndexMap(5), batch_size=2, num_workers=2)
        with pytest.raises(Exception) as info:
            setattr(loader, attr, getattr(loader, attr))
        results.append((info.type, str(info.value)))
    assert results[0] == results[1]


@pytest.mark.parametrize("prefetch_factor", [0, None], ids=["zero", "none"])
def test_prefetch_factor_set_after_construction_fails_like_torch(prefetch_factor):
    """torch checks prefetch_factor when the workers' iterator starts (0 set later, or None
    left from num_workers=0 when num_workers is set later)."""
    results = []
    for cls in (TorchDataLoader, ShmDataLoader):
        loader = cls(D.IndexMap(6), batch_size=2, num_workers=2 if prefetch_factor == 0 else 0)
        loader.num_workers, loader.prefetch_factor = 2, prefetch_factor
        with pytest.raises(Exception) as info:
            iter(loader)
        results.append((info.type, str(info.value)))
    assert results[0] == results[1], f"torch raised {results[0]}, shm raised {results[1]}"


@pytest.mark.parametrize("made_with", [0, 2])
def test_negative_num_workers_set_after_construction_fails_like_torch(made_with):
    """torch checks num_workers > 0 when the workers' iterator starts, before prefetch_factor
    (None where the loader was made with num_workers=0): with -1, shmloader's started no
    worker and its epoch ended at once, empty."""
    results = []
    for cls in (TorchDataLoader, ShmDataLoader):
        loader = cls(D.IndexMap(6), batch_size=2, num_workers=made_with)
        loader.num_workers = -1
        with pytest.raises(Exception) as info:
            list(loader)
        results.append((info.type, str(info.value)))
    assert results[0] == results[1], f"torch raised {results[0]}, shm raised {results[1]}"


def test_collate_fn_set_to_none_after_construction_fails_like_torch():
    """torch's workers call whatever collate_fn is at iter(), None included; shmloader's
    slot collate stands in for default_collate only."""
    got = []
    for cls in (TorchDataLoader, ShmDataLoader):
        loader = cls(D.IndexMap(8), batch_size=2, num_workers=2)
        loader.collate_fn = None
        got.append(each_next(loader))
    assert got[0] == got[1] and got[0][0][0] is TypeError, got


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("persistent", [False, True])
def test_loader_copied_after_an_epoch_like_torch(how, persistent):
    """A loader that has run an epoch copies as torch's does: a non-persistent one into a
    loader that yields the same batches, a persistent one (its live iterator) not at all."""
    copy_ = (lambda x: pickle.loads(pickle.dumps(x))) if how == "pickle" else copy.deepcopy
    results = []
    for cls in (TorchDataLoader, ShmDataLoader):
        loader = cls(D.TensorMap(10), batch_size=2, num_workers=2, persistent_workers=persistent)
        first = list(loader)
        if persistent:
            with pytest.raises(NotImplementedError) as info:
                copy_(loader)
            results.append(info.value.args[0])
        else:
            results.append([first, list(copy_(loader)), list(loader)])
    if persistent:
        assert results[0] == results[1]
    else:
        D.assert_same(results[0], results[1], "batches")


def test_shallow_copy_of_a_loader_iterates_and_resumes_apart():
    """copy.copy(loader) before iterating gives two loaders whose progress is their own (as
    torch's): each one's state_dict() resumes where that one stands."""

    def make():
        return ShmDataLoader(D.TensorMap(40), batch_size=4, num_workers=2)

    a = make()
    b = copy.copy(a)
    it_a, it_b = iter(a), iter(b)
    [next(it_a) for _ in range(2)]
    [next(it_b) for _ in range(5)]
    assert (a.stats().batches, b.stats().batches) == (2, 5)
    resumed = make()
    resumed.load_state_dict(a.state_dict())
    D.assert_same(
        list(TorchDataLoader(D.TensorMap(40), batch_size=4))[2:],
        list(resumed),
        "resumed after 2 batches",
    )


def test_shallow_copy_of_a_persistent_loader_counts_and_resumes_its_own_epochs():
    """copy.copy(loader) after a persistent epoch shares the live iterator (as torch's does):
    iterating the copy runs that iterator for the copy, so the copy's stats() and state_dict()
    describe the copy's epoch, and the original's batch counts stay its own."""
    a = ShmDataLoader(D.TensorMap(40), batch_size=4, num_workers=2, persistent_workers=True)
    list(a)
    b = copy.copy(a)
    it_b = iter(b)
    [next(it_b) for _ in range(3)]
    assert (a.stats().batches, b.stats().batches) == (10, 13)
    # The workers are the two loaders' own alike: their work is counted once in each.
    # Compared at a quiet point: the workers still prefetch the copy's next batches (the
    # window of prefetch_factor * num_workers = 4 beyond the 3 taken: 7 of this epoch's
    # 10, 28 samples, beside the first epoch's 40) while the counters are read.
    wait_until(
        lambda: sum(w.samples for w in b.stats().workers) == 40 + 28,
        120,
        "the copy's prefetch window filled",
    )
    assert a.stats().workers == b.stats().workers
    resumed = ShmDataLoader(D.TensorMap(40), batch_size=4, num_workers=2)
    resumed.load_state_dict(b.state_dict())
    D.assert_same(
        list(TorchDataLoader(D.TensorMap(40), batch_size=4))[3:],
        list(resumed),
        "resumed after the copy's 3 batches",
    )


ATTR_CASES = {
    "default": (P(D.IndexMap, 5), {}),
    "workers": (P(D.IndexMap, 5), dict(num_workers=2, batch_size=3, drop_last=True)),
    "shuffle": (
        P(D.IndexMap, 5),
        dict(
            shuffle=True,
            num_workers=2,
            prefetch_factor=4,
            persistent_workers=True,
            timeout=2.5,
            in_order=False,
        ),
    ),
    "nobatch": (P(D.IndexMap, 5), dict(batch_size=None, pin_memory=True, pin_memory_device="cpu")),
    "batch-sampler": (P(D.IndexMap, 5), dict(batch_sampler=_BATCH_SAMPLER)),
    "iterable": (
        P(D.ShardedIterable, 5),
        dict(batch_size=2, num_workers=1, worker_init_fn=D.mark_init_fn),
    ),
    "iterable-nobatch": (P(D.ShardedIterable, 5), dict(batch_size=None)),
    "mp-context": (P(D.IndexMap, 5), dict(num_workers=2, multiprocessing_context="spawn")),
}


def test_leaves_arrive_as_torchs_transport_delivers_them():
    """batch_size=None: a loader's first batches travel by torch's transport, later ones
    through the ring; both must deliver what torch's does (raw values of lazy views, empty
    tensors with their strides)."""

    def batches(cls):
        return list(cls(D.LazyBitsMap(), batch_size=None, num_workers=2))

    expected, got = batches(TorchDataLoader), batches(ShmDataLoader)
    assert len(expected) == len(got) == 12
    for b, (e, g) in enumerate(zip(expected, got)):
        D.assert_same(e, g, f"batch {b}")
        for key in e:
            assert (g[key].is_neg(), g[key].is_conj(), g[key].stride()) == (
                e[key].is_neg(),
                e[key].is_conj(),
                e[key].stride(),
            ), f"batch {b} {key}"


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_sampler_changing_the_dataset_when_it_starts(context):
    """A sampler whose iteration sets the dataset's epoch (curriculum style): workers are
    started before the first draw, so each epoch's workers see the epoch before it, as
    torch's do."""

    def epochs(cls):
        dataset = D.EpochTagged()
        loader = cls(
            dataset,
            batch_size=4,
            sampler=D.TaggingSampler(dataset),
            num_workers=2,
            multiprocessing_context=context,
        )
        return [list(loader) for _ in range(2)]

    D.assert_same(epochs(TorchDataLoader), epochs(ShmDataLoader), "epochs")


@pytest.mark.parametrize("where", ["loader", "batch-sampler"])
def test_dataset_sharing_the_samplers_generator(where):
    """A dataset holding the sampler's generator finds it, in every worker, as torch's
    workers do: as it was before the epoch's first draw (all workers are started before any
    task is drawn)."""

    def make(cls):
        generator = torch.Generator().manual_seed(5)
        dataset = D.GeneratorMap(24, generator)
        if where == "loader":
            return cls(dataset, batch_size=4, shuffle=True, generator=generator, **FORKED)
        sampler = tud.RandomSampler(dataset, generator=generator)
        return cls(dataset, batch_sampler=tud.BatchSampler(sampler, 4, False), **FORKED)

    torch_loader, shm_loader = make(TorchDataLoader), make(ShmDataLoader)
    expected = [list(torch_loader) for _ in range(2)]
    D.assert_same(expected, [list(shm_loader) for _ in range(2)], "epochs")


def test_generic_like_torch():
    """torch's DataLoader is Generic: DataLoader[T] in annotations and as a base class."""
    assert ShmDataLoader[torch.Tensor].__origin__ is ShmDataLoader

    class Typed(ShmDataLoader[int]):
        pass

    assert [b.tolist() for b in Typed(list(range(4)), batch_size=2)] == [[0, 1], [2, 3]]


class _TorchIterLoader(ShmDataLoader):
    """A subclass whose _get_iterator returns torch's own multiprocessing iterator (one
    that profiles its batches, say)."""

    def _get_iterator(self):
        return tud.dataloader._MultiProcessingDataLoaderIter(self)


def test_subclass_returning_torchs_iterator_runs_epochs_like_torch():
    loader = _TorchIterLoader(list(range(6)), batch_size=2, num_workers=2, persistent_workers=True)
    assert [[b.tolist() for b in loader] for _ in range(2)] == [[[0, 1], [2, 3], [4, 5]]] * 2


@pytest.mark.parametrize("name", list(ATTR_CASES))
def test_public_attributes_match(name):
    make_dataset, kw = ATTR_CASES[name]
    dataset = make_dataset()
    generator = torch.Generator()
    t = TorchDataLoader(dataset, generator=generator, **kw)
    s = ShmDataLoader(dataset, generator=generator, **kw)
    for attr in ["dataset", "generator", "worker_init_fn", "collate_fn"]:
        assert getattr(t, attr) is getattr(s, attr), attr
    for attr in [
        "batch_size",
        "drop_last",
        "num_workers",
        "prefetch_factor",
        "pin_memory",
        "pin_memory_device",
        "timeout",
        "in_order",
        "persistent_workers",
        "_auto_collation",
        "_dataset_kind",
    ]:
        assert getattr(t, attr) == getattr(s, attr), attr
    assert type(t.sampler) is type(s.sampler)
    assert type(t.batch_sampler) is type(s.batch_sampler)
    if kw.get("batch_sampler") is not None:
        assert s.batch_sampler is kw["batch_sampler"]
    assert type(t.multiprocessing_context) is type(s.multiprocessing_context)
    assert safe_len(t) == safe_len(s)


def _failures(cls, dataset, steps, **kw):
    """(type, last line of the message) or the batch, for each of `steps` next() calls."""
    out = []
    it = iter(cls(dataset, **kw))
    for _ in range(steps):
        try:
            out.append(next(it))
        except StopIteration:
            break
        except Exception as e:
            out.append((type(e), str(e).strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize(
    "kw", [W2, dict(num_workers=0), dict(fetch="sample", **W2)], ids=["w2", "w0", "sample-w2"]
)
def test_a_batch_sampler_of_ints_fails_in_each_next_like_torch(kw):
    """A sampler passed as batch_sampler gives ints for batches: torch's iter() takes them,
    and each next() raises its fetcher's TypeError (from the worker, where there is one)."""
    expected = _failures(
        TorchDataLoader, D.IndexMap(12), 4, batch_sampler=[3, 1, 4], num_workers=kw["num_workers"]
    )
    assert [kind for kind, _ in expected] == [TypeError] * 3
    D.assert_same(
        expected, _failures(ShmDataLoader, D.IndexMap(12), 4, batch_sampler=[3, 1, 4], **kw)
    )


def test_a_sample_that_is_no_tensor_fails_its_batch_as_torchs_collate_does():
    """A None among a batch's tensors: torch's collate in a worker counts every sample's
    elements first (AttributeError: no numel), on every batch, the ring's included."""
    kw = dict(batch_size=4, num_workers=2, persistent_workers=True)
    expected = _failures(TorchDataLoader, D.NoneAt(40, bad=21), 12, **kw)
    assert expected[5][0] is AttributeError and len(expected) == 10
    D.assert_same(expected, _failures(ShmDataLoader, D.NoneAt(40, bad=21), 12, **kw))


def test_too_many_workers_warns_like_torch():
    def go(cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cls(D.IndexMap(4), num_workers=NCPU + 1)
        return [(w.category, str(w.message)) for w in caught if "worker" in str(w.message)]

    t = go(TorchDataLoader)
    assert t, "torch should warn about more workers than CPUs"
    assert t == go(ShmDataLoader)


@pytest.mark.parametrize(
    "case", ["too-many-workers", "pin-memory", "longer-than-len", "unpicklable-under-spawn"]
)
@pytest.mark.parametrize("module_filter", [False, True])
def test_torchs_warnings_are_attributed_as_torchs(case, module_filter):
    """torch's loader warnings raised through shmloader name torch's loader module, file
    and line where torch's do (a filter by module hides both alike), and the user's line
    where torch's do (an IterableDataset longer than its len())."""

    def go(cls):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if module_filter:
                warnings.filterwarnings("ignore", module=r"torch\.utils\.data")
            if case == "too-many-workers":
                list(cls(D.IndexMap(4), num_workers=NCPU + 1))
            elif case == "pin-memory":
                list(cls(D.IndexMap(4), num_workers=1, pin_memory=True))
            elif case == "unpicklable-under-spawn":  # its error is shmloader's (see test_lifecycle)
                with pytest.raises(AttributeError, match="Can't (pickle|get) local object"):
                    iter(
                        cls(
                            D.IndexMap(4),
                            num_workers=1,
                            multiprocessing_context="spawn",
                            worker_init_fn=lambda worker_id: None,
                        )
                    )
            else:
                loader = cls(dataset, num_workers=1, batch_size=None)
                len(loader)
                list(loader)
        return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]

    dataset = D.LyingLenIterable(8)
    t = go(TorchDataLoader)
    assert t or module_filter or _torch_gives_no_warning(case)
    assert go(ShmDataLoader) == t


def _torch_gives_no_warning(case):
    """Whether the installed torch has no warning for `case` (read off its code, as
    shmloader/_main/_torch_api.py does): torch 2.6 warns neither that pin_memory finds no
    accelerator nor of a pickle error as a worker starts."""
    init = torch.utils.data.dataloader._BaseDataLoaderIter.__init__
    if case == "pin-memory":
        return (
            torch.cuda.is_available() or _torch_api._constant(init, "'pin_memory' argument") is None
        )
    return case == "unpicklable-under-spawn" and _torch_api.PICKLE_ERROR_WARNING is None


# --------------------------------------------------------------------------- len() grid
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 30),
    batch_size=st.one_of(st.none(), st.integers(1, 12)),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    iterable=st.booleans(),
)
@pytest.mark.slow
def test_len_and_single_process_output(n, batch_size, drop_last, shuffle, iterable):
    """num_workers=0 behaves exactly like torch (cheap enough for property testing)."""
    if batch_size is None:
        drop_last = False
    assume(iterable or not (shuffle and n == 0))  # RandomSampler rejects n=0 (see INVALID)
    if iterable:
        shuffle = False
        make = P(D.LenIterable, n)
    else:
        make = P(D.RNGMap, n)
    check(make, batch_size=batch_size, drop_last=drop_last, shuffle=shuffle)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(0, 13),
    batch_size=st.integers(1, 5),
    drop_last=st.booleans(),
    num_workers=st.integers(1, 3),
    iterable=st.booleans(),
)
@pytest.mark.slow
def test_multiprocess_grid(n, batch_size, drop_last, num_workers, iterable):
    assume(iterable or n > 0)  # shuffle=True: RandomSampler rejects n=0 (see INVALID)
    make = P(D.LenIterable, n) if iterable else P(D.RNGMap, n)
    check(
        make,
        batch_size=batch_size,
        drop_last=drop_last,
        num_workers=num_workers,
        shuffle=not iterable,
    )


# slot_bytes given: the ring exists from the first batch on.
@pytest.mark.parametrize(
    "shm_kw", [dict(slot_bytes=1 << 16), dict(slot_bytes=256)], ids=["ring", "spilled"]
)
def test_sharing_within_a_batch_like_torch(shm_kw):
    """A leaf met twice is one object, and views of one tensor share its memory (in-place
    writes reach each other), through the ring as through torch's transport."""
    t = run(TorchDataLoader, P(D.IndexMap, 12), batch_size=3, collate_fn=D.aliasing_collate, **W2)
    s = run(
        P(ShmDataLoader, **shm_kw),
        P(D.IndexMap, 12),
        batch_size=3,
        collate_fn=D.aliasing_collate,
        **W2,
    )
    assert_results_same(t, s)
    for b, (x, y) in enumerate(zip(t.epochs[0], s.epochs[0], strict=True)):
        assert D.sharing(x) == D.sharing(y), f"batch {b}"
        D.assert_same(x, y, f"batch {b} after writing into x")


@pytest.mark.parametrize("slot_bytes", [1 << 16, None], ids=["ring", "sized-later"])
def test_custom_collates_batch_is_pickled_once_like_torch(slot_bytes):
    """A worker pickles a custom collate's batch once, as torch's does: a __reduce__ with a
    side effect has it once per batch.  (With slot_bytes=None the batches that size the
    ring, the first prefetch_factor * num_workers + 1, are measured by a pickling of their
    own first: documented in the README's limits.)"""

    def counts(cls, **kw):
        loader = cls(
            D.IndexMap(30),
            batch_size=3,
            collate_fn=D.reduction_counting_collate,
            num_workers=1,
            **kw,
        )
        return [counter.count for _, counter in loader]

    expected = counts(TorchDataLoader)
    assert expected == list(range(1, 11))
    got = counts(ShmDataLoader, slot_bytes=slot_bytes)
    measured = 0 if slot_bytes else 3  # prefetch_factor 2 * 1 worker + 1
    assert got == [2 * i for i in range(1, measured + 1)] + list(
        range(2 * measured + 1, 10 + measured + 1)
    )


@pytest.mark.parametrize("slot_bytes", [1 << 16, None], ids=["ring", "sized-later"])
def test_repeated_objects_arrive_as_one_object_like_torch(slot_bytes):
    """An object at several places in a batch arrives as one object at all of them, slot
    leaves and pickled objects alike, as torch's pickling keeps them."""

    def identities(batch):
        return [
            batch["cls"][0] is batch["cls"][1] is batch["name"],
            batch["jpg"][0] is batch["jpg"][1],
            batch["ids"] is batch["again"],
            batch["x"] is batch["xs"][0] is batch["xs"][1],
            batch["array"] is batch["arrays"][0] is batch["arrays"][1],
        ]

    kw = dict(batch_size=3, collate_fn=D.repeated_objects_collate, **W2)
    expected = list(TorchDataLoader(D.IndexMap(24), **kw))
    got = list(ShmDataLoader(D.IndexMap(24), slot_bytes=slot_bytes, **kw))
    D.assert_same(expected, got)
    assert [identities(b) for b in got] == [identities(b) for b in expected]
    assert identities(expected[0]) == [True] * 5


def test_two_storages_over_one_memory_arrive_apart_like_torch():
    """torch.from_numpy twice over one array makes two storages: torch moves each on its
    own, so a write into one batch field leaves the other as it was."""

    def after_zeroing_img(cls, **kw):
        out = []
        for batch in cls(
            D.IndexMap(12), batch_size=3, collate_fn=D.twin_storages_collate, **W2, **kw
        ):
            batch["img"].zero_()
            out.append(batch["orig"].clone())
        return out

    expected = after_zeroing_img(TorchDataLoader)
    assert expected[1].sum() > 0
    D.assert_same(expected, after_zeroing_img(ShmDataLoader, slot_bytes=1 << 16))


def _numpy_collate(samples):
    """numpy leaves of every size class, C- and Fortran-ordered, big-endian, empty, and
    structured with a big-endian field (small and large)."""
    ids = np.array([i for i, _ in samples], dtype=np.int64)
    values = np.stack([v.numpy() for _, v in samples])
    records = np.zeros(len(samples), dtype=[("id", "<i4"), ("flux", ">f8")])
    records["id"], records["flux"] = ids, ids / 3
    return (
        ids,
        np.asfortranarray(values),
        np.repeat(values, 60, axis=1),
        np.repeat(values, 2000, axis=1),
        ids.astype(">i4"),
        np.zeros((0, 3)),
        records,
        np.repeat(records, 2000),
    )


def test_numpy_leaves_arrive_as_numpys_unpickling_makes_them_like_torch():
    """Small arrays own their data (resize works) up to numpy's 1000 bytes, larger ones do
    not; big-endian ones arrive in native order, but a structured one keeps its fields'
    byte orders; bytes and strides as torch's."""

    def described(cls, **kw):
        loader = cls(D.IndexMap(12), batch_size=3, collate_fn=_numpy_collate, **W2, **kw)
        return [
            [
                (
                    a.dtype.descr,
                    a.shape,
                    a.strides,
                    a.flags.writeable,
                    a.flags.f_contiguous,
                    a.flags.owndata or a.size == 0,
                    a.tobytes(),
                )
                for a in batch
            ]
            for batch in loader
        ]

    expected = described(TorchDataLoader)
    assert [leaf[5] for leaf in expected[0]] == [True, True, False, False, True, True, True, False]
    assert expected[0][4][0] == [("", "<i4")]
    assert expected[0][6][0] == [("id", "<i4"), ("flux", ">f8")]
    assert described(ShmDataLoader, slot_bytes=1 << 20) == expected
    for cls in (TorchDataLoader, ShmDataLoader):
        ids = next(iter(cls(D.IndexMap(12), batch_size=3, collate_fn=_numpy_collate, **W2)))[0]
        ids.resize(8, refcheck=False)  # only an array that owns its data can


@pytest.mark.parametrize("make", [P(D.IndexMap, 5), P(D.TensorMap, 5)], ids=["tuple", "tensor"])
def test_explicit_default_collate_without_batching_like_torch(make):
    """batch_size=None with collate_fn=default_collate: torch calls it on each sample, which
    fails for these samples; the ring (there from the start) must not collate them instead."""
    outcomes = [
        each_next(cls(make(), batch_size=None, collate_fn=tud.default_collate, num_workers=2))
        for cls in (TorchDataLoader, P(ShmDataLoader, slot_bytes=1 << 16))
    ]
    assert any(type(o) is tuple and isinstance(o[0], type) for o in outcomes[0]), (
        "torch's default_collate accepted every bare sample"
    )
    D.assert_same(outcomes[0], outcomes[1], "outcomes")


def test_strides_of_tensors_spanning_their_storage_like_torch():
    """A transposed or expanded tensor that spans all of its storage keeps its strides (an
    expanded one stays unwritable in place, as torch's); a gappy part of a larger storage
    arrives dense, with the same values (documented: its storage is not copied whole)."""
    t = run(TorchDataLoader, P(D.IndexMap, 12), batch_size=3, collate_fn=D.strided_collate, **W2)
    s = run(
        P(ShmDataLoader, slot_bytes=1 << 16),
        P(D.IndexMap, 12),
        batch_size=3,
        collate_fn=D.strided_collate,
        **W2,
    )
    assert_results_same(t, s)
    for b, (x, y) in enumerate(zip(t.epochs[0], s.epochs[0], strict=True)):
        for key in ("transposed", "expanded"):
            assert x[key].stride() == y[key].stride(), f"batch {b} {key}"
        assert y["gappy"].is_contiguous()


def test_a_view_overlapping_itself_on_part_of_its_storage_keeps_its_strides():
    """A tensor expanded over part of its storage (stride 0), or an as_strided window whose
    elements overlap, arrives with its strides, as torch's does: a dense copy would repeat
    its bytes (8 MB here for 4 KB, any size for a larger expand) and spill past the slot,
    and in-place writes would no longer reach the elements it shares."""
    t = run(
        TorchDataLoader, P(D.IndexMap, 12), batch_size=3, collate_fn=D.overlapping_collate, **W2
    )
    s = run(
        P(ShmDataLoader, slot_bytes=1 << 16),
        P(D.IndexMap, 12),
        batch_size=3,
        collate_fn=D.overlapping_collate,
        **W2,
    )
    assert_results_same(t, s)
    for b, (x, y) in enumerate(zip(t.epochs[0], s.epochs[0], strict=True)):
        for key in x:
            assert x[key].stride() == y[key].stride(), f"batch {b} {key}"
            assert y[key].untyped_storage().nbytes() <= x[key].untyped_storage().nbytes()
    loader = ShmDataLoader(
        D.IndexMap(12), batch_size=3, collate_fn=D.overlapping_collate, slot_bytes=1 << 16, **W2
    )
    list(loader)
    assert loader.stats().spilled_batches == 0


def test_conjugate_or_negative_samples_fail_default_collate_as_torchs():
    """torch's collate in a worker refuses a conjugate or negative view as the first sample
    (elem.new(storage) raises); a stack into the slot would accept it, so whether the loader
    raised would depend on whether the ring was made yet."""
    expected = each_next(TorchDataLoader(D.LazyBitsMap(), batch_size=3, **W2))
    assert expected[0][0] is RuntimeError
    for kw in (dict(), dict(slot_bytes=1 << 16)):
        D.assert_same(expected, each_next(ShmDataLoader(D.LazyBitsMap(), batch_size=3, **W2, **kw)))


@pytest.mark.parametrize(
    "slot_bytes", [None, 1 << 16], ids=["ring-sized-by-batches", "ring-at-start"]
)
def test_a_non_leaf_tensor_that_requires_grad_is_refused_as_torchs_pickling_refuses_it(slot_bytes):
    """torch's pickling refuses a batch tensor with a grad_fn (its feeder thread prints the
    error and the loader waits for its timeout). A slot must not deliver it as a leaf that
    has silently lost its graph: the worker's error is raised, naming detach()."""
    loader = ShmDataLoader(
        D.IndexMap(12),
        batch_size=3,
        collate_fn=D.non_leaf_collate,
        slot_bytes=slot_bytes,
        timeout=60,
        **W2,
    )
    with pytest.raises(RuntimeError, match=r"non-leaf tensor which requires_grad.*detach\(\)"):
        next(iter(loader))


@pytest.mark.parametrize(
    "dtype, error", [(torch.bits8, TypeError), (torch.quint8, NotImplementedError)]
)
@pytest.mark.slow
def test_bit_and_quantized_dtypes_fail_default_collate_as_torch_and_pass_a_custom_one(dtype, error):
    """torch's default collate cannot stack bits8 (it raises a TypeError making the shared
    storage) nor bytes viewed as quint8; a slot must not stack them instead, whatever
    slot_bytes or fetch. A custom collate's batch of them travels as torch's does."""
    make = P(D.BitsMap, 6, dtype=dtype)
    expected = each_next(TorchDataLoader(make(), batch_size=3, **W2))
    assert expected[0][0] is error
    for kw in (dict(), dict(slot_bytes=1 << 16)):
        D.assert_same(expected, each_next(ShmDataLoader(make(), batch_size=3, **W2, **kw)))
    with pytest.raises(error, match=re.escape(expected[0][1])):
        list(ShmDataLoader(make(), batch_size=3, fetch="sample", **W2))
    # (Read back as bytes where they can be: bytes that torch's transport carries as quint8
    # are a tensor without a quantizer, which segfaults when read, under either loader.)
    custom = dict(batch_size=3, collate_fn=D.bits_collate, **W2)
    readable = dtype is torch.bits8
    expected = [
        b.view(torch.uint8) if readable else (b.dtype, b.shape)
        for b in TorchDataLoader(make(), **custom)
    ]
    got = [
        b.view(torch.uint8) if readable else (b.dtype, b.shape)
        for b in ShmDataLoader(make(), slot_bytes=1 << 16, **custom)
    ]
    D.assert_same(expected, got)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(slot_bytes=1 << 16), dict(fetch="sample")],
    ids=["ring-sized-by-batches", "ring-at-start", "sample"],
)
def test_an_error_whose_class_cannot_be_pickled_is_raised_with_its_traceback(kw):
    """torch's worker cannot send such an error (its feeder thread prints it; the loader
    waits for its timeout). It must not kill the worker either: it comes as a RuntimeError
    carrying the original type, message and traceback, and the other batches come."""
    outcomes = each_next(
        ShmDataLoader(D.RuntimeClassErrorMap(12), batch_size=2, timeout=60, **W2, **kw), epochs=2
    )
    expected = each_next(TorchDataLoader(D.IndexMap(12), batch_size=2, **W2), epochs=2)
    for epoch in (0, 6):
        error_type, last_line = outcomes[epoch + 3]
        assert error_type is RuntimeError and last_line.endswith(
            "NoSuchKey: s3://bucket/7 is missing"
        )
        outcomes[epoch + 3] = expected[epoch + 3]
    D.assert_same(expected, outcomes)


@pytest.mark.parametrize("bad", [0, 5])
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(slot_bytes=1 << 16), dict(fetch="sample")],
    ids=["ring-sized-by-batches", "ring-at-start", "sample"],
)
def test_an_index_that_cannot_be_pickled_fails_its_own_batch(kw, bad):
    """torch's loader cannot send such a task (its feeder thread prints pickle's error) and
    waits for that batch until its timeout, or forever. Pickle's error must come from that
    batch's next() (not from an earlier one, whose batch it would lose), saying what to do,
    and the other batches of the epoch, and the next epoch, must come as torch's."""
    sampler = list(range(12))
    sampler[bad] = D.Unpicklable()
    outcomes = each_next(
        ShmDataLoader(D.IndexMap(12), sampler=sampler, batch_size=2, **W2, **kw), epochs=2
    )
    expected = each_next(TorchDataLoader(D.IndexMap(12), batch_size=2, **W2), epochs=2)
    for epoch in (0, 6):
        error_type, last_line = outcomes[epoch + bad // 2]
        assert (
            error_type is TypeError
            and last_line == "TypeError: cannot pickle '_thread.lock' object"
        )
        outcomes[epoch + bad // 2] = expected[epoch + bad // 2]
    D.assert_same(expected, outcomes)


def test_an_index_that_cannot_be_pickled_says_so():
    sampler = [0, D.Unpicklable()]
    with pytest.raises(TypeError, match="pickling this batch's indices to send them") as error:
        list(ShmDataLoader(D.IndexMap(2), sampler=sampler, batch_size=1, **W2))
    assert "yield numbers, strings, or tuples and lists of them" in str(error.value)


# --------------------------------------------------------------------------- shm-only knobs
class _Point:
    def __init__(self, x):
        self.x = x


class _VariableLengths(tud.Dataset):
    """Sequences of 10 to 14 values, each with a _Point: what default_collate can batch
    only through entries added to default_collate_fn_map."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.arange(10 + i % 5, dtype=torch.float32) + i, _Point(i)


def _pad(batch, *, collate_fn_map=None):
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=-1)


def _collate_points(batch, *, collate_fn_map=None):
    return torch.tensor([point.x for point in batch])


@pytest.mark.parametrize("shm_kw", [{}, {"slot_bytes": 1 << 16}], ids=["sized", "slot_bytes"])
def test_changed_default_collate_fn_map_collates_like_torch(monkeypatch, shm_kw):
    """Code that extends torch's default collation through default_collate_fn_map (padding
    tensors, a type of its own) gets every batch as torch's default_collate makes it, in
    the ring as before it is sized."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, torch.Tensor, _pad)
    monkeypatch.setitem(default_collate_fn_map, _Point, _collate_points)
    t = run(TorchDataLoader, _VariableLengths, batch_size=4, epochs=2, **FORKED_2)
    s = run(P(ShmDataLoader, **shm_kw), _VariableLengths, batch_size=4, epochs=2, **FORKED_2)
    assert_results_same(t, s)


def test_added_default_collate_fn_map_entry_collates_like_torch(monkeypatch):
    """An entry for a type of the user's own, torch's tensor collation left as it is:
    tensors still stack straight into the slot, and the new type is collated as torch's."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, _Point, _collate_points)
    t = run(TorchDataLoader, _ImagesAndPoints, batch_size=4, **FORKED_2)
    s = run(P(ShmDataLoader, slot_bytes=1 << 16), _ImagesAndPoints, batch_size=4, **FORKED_2)
    assert_results_same(t, s)


def _collate_points_and_draw(batch, *, collate_fn_map=None):
    """A collate entry that draws from torch's RNG (a mixing coefficient per sample, say)."""
    return torch.tensor([point.x for point in batch]), torch.rand(len(batch))


class _GrowingWithPoints(tud.Dataset):
    """64 KiB samples with a _Point each: batches of 8 after batches of 2 outgrow the slots
    sized from the first ones."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return _Point(i), torch.full((16384,), float(i))


def test_a_batch_that_outgrows_its_slot_is_collated_once(monkeypatch):
    """A batch that outgrows its slot mid-collation is delivered outside the ring without
    being collated again from its start: a collate entry of the user's (here one that draws
    from torch's RNG) runs once per batch, as in torch's workers, so the draws stay torch's."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, _Point, _collate_points_and_draw)
    batches = [list(range(2 * k, 2 * k + 2)) for k in range(8)]
    batches += [list(range(16 + 8 * k, 24 + 8 * k)) for k in range(6)]
    kw = dict(batch_sampler=batches, **FORKED_2)
    t = run(TorchDataLoader, _GrowingWithPoints, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (shmloader's spill warning)
        s = run(ShmDataLoader, _GrowingWithPoints, **kw)
    assert_results_same(t, s)


def _collate_points_and_first(batch, *, collate_fn_map=None):
    """A collate entry that returns a stacked tensor and a view of it."""
    stacked = collate([point.x for point in batch], collate_fn_map=collate_fn_map)
    return {"all": stacked, "first": stacked[0]}


class _TensorPoints(tud.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return _Point(torch.full((3,), float(i)))


@pytest.mark.parametrize("shm_kw", [{}, {"slot_bytes": 1 << 16}], ids=["sized", "slot_bytes"])
def test_views_of_a_stacked_tensor_share_its_storage_like_torch(monkeypatch, shm_kw):
    """A collate entry that returns a tensor stacked into the slot and a view of it: torch's
    transport gives the two one storage, so that a write through the view shows in the whole;
    so must the ring, where each leaf stacked in the slot arrived on a storage of its own."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, _Point, _collate_points_and_first)

    def go(cls):
        seen = []
        for batch in cls(_TensorPoints(), batch_size=2, **FORKED_2):
            batch["first"].add_(100)
            seen.append(batch["all"][0, 0].item())
        return seen

    assert go(P(ShmDataLoader, **shm_kw)) == go(TorchDataLoader)


class _MetaTensor(torch.Tensor):
    """A tensor subclass that carries an attribute of its own."""


def _collate_points_as_parameter(batch, *, collate_fn_map=None):
    return torch.nn.Parameter(collate([point.x for point in batch], collate_fn_map=collate_fn_map))


def _collate_points_with_meta(batch, *, collate_fn_map=None):
    stacked = collate([point.x for point in batch], collate_fn_map=collate_fn_map)
    marked = stacked.as_subclass(_MetaTensor)
    marked.meta = {"n": len(batch)}
    return marked


@pytest.mark.parametrize("entry", [_collate_points_as_parameter, _collate_points_with_meta])
def test_a_subclass_over_a_stacked_tensor_arrives_as_torchs(monkeypatch, entry):
    """A collate entry that wraps the tensor it stacked (in the slot) in a subclass, which
    torch's pickling carries: it must arrive as torch's does, its class, attributes,
    requires_grad and leafness kept, its values the batch's (not a later batch's, which a
    slot moved away by that pickling would give)."""
    from torch.utils.data._utils.collate import default_collate_fn_map

    monkeypatch.setitem(default_collate_fn_map, _Point, entry)

    def go(cls):
        return [
            (type(b), b.requires_grad, b.is_leaf, getattr(b, "meta", None), b.tolist())
            for b in cls(_TensorPoints(), batch_size=2, **FORKED_2)
        ]

    assert go(ShmDataLoader) == go(TorchDataLoader)


class _ImagesAndPoints(tud.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3, 8, 8), i, dtype=torch.uint8), _Point(i)


@pytest.mark.parametrize(
    "shm_kw",
    [dict(num_slots=2), dict(slot_bytes=4096), dict(slot_bytes=4096, num_slots=2)],
    ids=["few-slots", "tiny-slots", "tiny-and-few"],
)
@pytest.mark.slow
def test_slot_knobs_do_not_change_output(shm_kw):
    """Batches larger than a slot are still delivered whole; a user holding every batch (list())
    with few slots neither deadlocks nor sees data change."""
    for make, kw in [
        (P(D.GrowingMap, 12), dict(batch_size=2, collate_fn=D.identity_collate)),
        (P(D.RichMap, 8), dict(batch_size=4)),
        (P(D.NumpyKindsMap, 12), dict(batch_size=2, collate_fn=D.identity_collate)),
    ]:
        t = run(TorchDataLoader, make, num_workers=2, epochs=2, **kw)
        s = run(P(ShmDataLoader, **shm_kw), make, num_workers=2, epochs=2, **kw)
        assert_results_same(t, s)

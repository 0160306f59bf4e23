"""seed_per_sample=True: random, torch and numpy are seeded before every sample from (base seed,
epoch, sample position), so randomly augmented batches are the same whatever num_workers (1 or
3), fetch ("batch" or "sample") or assignment ("interleaved" or "dynamic") is, given the same
generator seed; they change from epoch to epoch; and the batch order and the main process's RNG
draws stay torch's."""

import collections
import functools
import gc
import random
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader as ShmDataLoader
from tests.equivalence.test_equivalence import SEED, gen, run, seed_all
from tests.helpers import datasets as D

P = functools.partial
N, BS = 12, 4


def augmented(
    *, num_workers, seed=7, epochs=2, persistent=False, shuffle=True, generator=True, n=N, **kw
):
    """Every batch of `epochs` epochs of AugmentMap(n), the global RNGs seeded alike first."""
    seed_all(SEED)
    g = torch.Generator().manual_seed(seed) if generator else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 workers on a 2-CPU machine; kept batches
        loader = ShmDataLoader(
            D.AugmentMap(n),
            batch_size=BS,
            shuffle=shuffle,
            generator=g,
            num_workers=num_workers,
            persistent_workers=persistent,
            **kw,
        )
        out = [list(loader) for _ in range(epochs)]
    del loader
    gc.collect()
    return out


def same(a, b):
    try:
        D.assert_same(a, b, "batches")
    except AssertionError:
        return False
    return True


RANDOM_FIELDS = ("flip", "py", "py_int", "np", "np_int", "torch", "torch_int", "normal")


def random_part(epoch_batches):
    """The augmentation draws of an epoch (everything but the index)."""
    return [{k: b[k] for k in RANDOM_FIELDS} for b in epoch_batches]


@pytest.fixture(scope="module")
def reference():
    """One worker, whole batches: what every other configuration must reproduce."""
    return augmented(num_workers=1, seed_per_sample=True)


CONFIGS = {
    "w0": dict(num_workers=0),  # in the main process, whose own random states stay its own
    "w3-batch": dict(num_workers=3),
    "w1-sample": dict(num_workers=1, fetch="sample"),
    "w3-sample-interleaved": dict(num_workers=3, fetch="sample", assignment="interleaved"),
    "w3-sample-dynamic": dict(num_workers=3, fetch="sample", assignment="dynamic"),
    "w2-batch-prefetch1": dict(num_workers=2, prefetch_factor=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_augmentations_whatever_the_workers(reference, name):
    got = augmented(seed_per_sample=True, **CONFIGS[name])
    D.assert_same(reference, got, name)


def test_in_order_false_same_batches(reference):
    """in_order=False changes the order batches arrive in, not what is in them."""
    got = augmented(
        num_workers=2, fetch="sample", assignment="dynamic", in_order=False, seed_per_sample=True
    )
    for e, (want, have) in enumerate(zip(reference, got, strict=True)):
        assert collections.Counter(map(D.canon, want)) == collections.Counter(map(D.canon, have)), (
            f"epoch {e}: different batches"
        )


@pytest.mark.slow
def test_persistent_workers_same_across_workers_and_epochs_differ():
    one = augmented(num_workers=1, persistent=True, epochs=3, shuffle=False, seed_per_sample=True)
    three = augmented(
        num_workers=3,
        persistent=True,
        epochs=3,
        shuffle=False,
        fetch="sample",
        assignment="dynamic",
        seed_per_sample=True,
    )
    D.assert_same(one, three, "persistent 1 vs 3 workers")
    # Persistent workers keep one base seed: only the epoch can make the epochs differ.
    for e in range(3):
        assert [b["index"].tolist() for b in one[e]] == [b["index"].tolist() for b in one[0]]
    for a, b in [(0, 1), (1, 2), (0, 2)]:
        assert not same(random_part(one[a]), random_part(one[b])), (
            f"epochs {a} and {b} drew the same augmentations"
        )


@pytest.mark.slow
@pytest.mark.parametrize("turned_on", [True, False], ids=["turned-on", "turned-off"])
def test_changed_between_epochs_of_persistent_workers_applies(turned_on):
    """seed_per_sample set between epochs of a persistent loader: its workers were made
    without (or with) it, so the loader starts them afresh, as a new iterator, which draws
    its base seed as a non-persistent loader's second iterator does. (Seeded batches are
    the same for 2 workers as for 3.)"""
    seed_all(SEED)
    loader = ShmDataLoader(
        D.AugmentMap(N),
        batch_size=BS,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(7),
        persistent_workers=True,
        seed_per_sample=not turned_on,
    )
    first = list(loader)
    loader.seed_per_sample = turned_on
    second = list(loader)
    expected = augmented(num_workers=3 if turned_on else 2, seed_per_sample=turned_on)
    assert same(second, expected[1])
    unchanged = augmented(num_workers=2, persistent=True, seed_per_sample=not turned_on)
    assert same(first, unchanged[0]) and not same(random_part(second), random_part(unchanged[1]))


def test_epochs_differ_without_persistent_workers(reference):
    assert not same(random_part(reference[0]), random_part(reference[1]))


def test_different_generator_seed_gives_different_augmentations():
    other = augmented(num_workers=1, seed=8, seed_per_sample=True, shuffle=False)
    mine = augmented(num_workers=1, seed=7, seed_per_sample=True, shuffle=False)
    assert not same(random_part(mine[0]), random_part(other[0]))


def test_samples_in_a_batch_draw_differently(reference):
    batch = reference[0][0]
    assert len(set(batch["py"].tolist())) == BS
    assert len({tuple(row) for row in batch["torch"].tolist()}) == BS
    assert len({tuple(row) for row in batch["np"].tolist()}) == BS


@pytest.mark.slow
def test_global_rng_instead_of_generator():
    """Without a generator the base seed comes from torch's global RNG (seeded alike)."""
    one = augmented(num_workers=1, generator=False, seed_per_sample=True)
    three = augmented(num_workers=3, generator=False, fetch="sample", seed_per_sample=True)
    D.assert_same(one, three, "global RNG, 1 vs 3 workers")


@pytest.mark.slow
def test_without_seed_per_sample_workers_differ():
    """The control: torch's per-worker seeding makes 1 and 3 workers augment differently (so
    the tests above can fail)."""
    one = augmented(num_workers=1)
    three = augmented(num_workers=3)
    assert [b["index"].tolist() for b in one[0]] == [b["index"].tolist() for b in three[0]]
    assert not same(random_part(one[0]), random_part(three[0]))
    sample = augmented(num_workers=3, fetch="sample")
    assert not same(random_part(three[0]), random_part(sample[0]))


def test_order_and_main_process_rng_are_torchs():
    """seed_per_sample seeds inside the workers only: batch order, the main process's draws
    (base seed, sampler) and its RNG state afterwards are torch's."""
    kw = dict(batch_size=BS, shuffle=True, num_workers=2, epochs=2)
    t = run(tud.DataLoader, P(D.AugmentMap, N), **kw)
    s = run(P(ShmDataLoader, seed_per_sample=True, fetch="sample"), P(D.AugmentMap, N), **kw)
    assert [[b["index"].tolist() for b in e] for e in t.epochs] == [
        [b["index"].tolist() for b in e] for e in s.epochs
    ]
    D.assert_same(t.rng_after, s.rng_after, "main-process RNG after iterating")
    s2 = run(P(ShmDataLoader, seed_per_sample=True), P(D.AugmentMap, N), generator=gen(3), **kw)
    t2 = run(tud.DataLoader, P(D.AugmentMap, N), generator=gen(3), **kw)
    D.assert_same(t2.rng_after, s2.rng_after, "main-process RNG after iterating (generator)")


def test_main_process_rng_with_num_workers_0_is_as_with_workers():
    """num_workers=0 fetches in the main process, but each batch's seeding is undone after it:
    the samples' draws leave the loop's RNG as they do when workers make them (torch's loader
    with workers: the same order, and the loop's own draws), where torch's num_workers=0 would
    move it with every augmentation."""

    def go(cls, **kw):
        seed_all(SEED)
        loader = cls(D.AugmentMap(N), batch_size=BS, shuffle=True, **kw)
        draws = []
        for _ in range(2):
            for batch in loader:
                draws.append((batch["index"], torch.rand(1), random.random(), np.random.rand()))
        return draws

    t, s = go(tud.DataLoader, num_workers=2), go(ShmDataLoader, seed_per_sample=True)
    assert not same(t, go(tud.DataLoader))  # (the draws in this process are what differs)
    D.assert_same([d[0] for d in t], [d[0] for d in s], "order")
    D.assert_same([d[1:] for d in t], [d[1:] for d in s], "the loop's own draws")


@pytest.mark.slow
def test_prefetched_epoch_same_augmentations(reference):
    """prefetch_next_epoch does not change what seed_per_sample draws when the prefetched epoch
    is adopted (24 samples: the next epoch's sampler is not exhausted by the prefetch)."""
    plain = augmented(num_workers=2, persistent=True, epochs=3, n=24, seed_per_sample=True)
    prefetched = augmented(
        num_workers=2,
        persistent=True,
        epochs=3,
        n=24,
        seed_per_sample=True,
        prefetch_next_epoch=True,
    )
    D.assert_same(plain, prefetched, "prefetch_next_epoch on vs off")


def test_discarded_prefetch_keeps_epoch_numbers():
    """Regression (fixed): when a prefetched epoch is discarded (here: the user reseeds the
    generator between epochs), ShmLoaderIter._reset numbers the refetched epoch with
    loader._next_epoch() AGAIN, after _start_next_epoch already took a number for the prefetch:
    epoch 1 is seeded as epoch 2, epoch 2 as epoch 4.  So with seed_per_sample the augmentations
    depend on whether prefetch_next_epoch was on."""

    def go(**kw):
        g = torch.Generator().manual_seed(1)
        loader = ShmDataLoader(
            D.AugmentMap(24),
            batch_size=BS,
            shuffle=True,
            generator=g,
            num_workers=2,
            persistent_workers=True,
            seed_per_sample=True,
            **kw,
        )
        out = []
        for e in range(3):
            g.manual_seed(50 + e)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(list(loader))
        return out, loader.stats().prefetched_epochs

    plain, _ = go()
    prefetched, adopted = go(prefetch_next_epoch=True)
    assert adopted == 0  # every prefetch was discarded (the generator changed)
    D.assert_same(plain, prefetched, "prefetch discarded vs no prefetch")


INVALID = {
    "iterable": (P(D.ShardedIterable, 4), dict(num_workers=2, seed_per_sample=True)),
    "not-a-bool": (P(D.AugmentMap, 4), dict(num_workers=2, seed_per_sample=1)),
    # torch would call __getitems__ with whole batches, where seeding needs one sample at a time
    "getitems": (P(D.GetItemsMap, 6), dict(num_workers=2, seed_per_sample=True)),
    "getitems-no-workers": (P(D.GetItemsMap, 6), dict(seed_per_sample=True)),
    "subset-of-getitems": (
        lambda: tud.Subset(D.GetItemsMap(6), [1, 2, 3]),
        dict(num_workers=2, seed_per_sample=True),
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_is_value_error(name):
    make, kw = INVALID[name]
    with pytest.raises(ValueError, match="seed_per_sample"):
        ShmDataLoader(make(), batch_size=2, **kw)


def test_getitems_is_fine_without_automatic_batching():
    """batch_size=None: torch fetches dataset[i] one by one too, never __getitems__, so a
    dataset with one is accepted and yields torch's samples."""
    want = list(tud.DataLoader(D.GetItemsMap(6), batch_size=None, num_workers=2))
    got = list(
        ShmDataLoader(D.GetItemsMap(6), batch_size=None, num_workers=2, seed_per_sample=True)
    )
    D.assert_same(want, got, "samples")

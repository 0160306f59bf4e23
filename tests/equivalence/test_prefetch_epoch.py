"""prefetch_next_epoch=True (persistent workers, map-style): when an epoch's sampler runs out the
loader goes on dispatching the next epoch's batches (after sampler.set_epoch(e + 1) where the
sampler has it); the next iter() adopts them only if the samplers and generators are as they were
drawn, else drops and refetches them.  Whatever the user does between epochs (nothing, set_epoch
with the expected or another value, reseeding the generator, breaking out of an epoch), the
batches must be torch's.  stats().prefetched_epochs tells adopted epochs apart from refetched
ones.

Most datasets here have 10 batches an epoch while at most prefetch_factor * num_workers = 4 are in
flight, so a prefetch never exhausts the next epoch's sampler (see the bug tests at the end for
what happens when it does)."""

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
from tests.equivalence.test_equivalence import SEED, seed_all
from tests.helpers import datasets as D
from tests.helpers.procs import deadline

TorchDataLoader = tud.DataLoader
P = functools.partial
N, BS = 40, 4  # 10 batches an epoch


def distributed(n, seed=5):
    return tud.DistributedSampler(range(n), num_replicas=2, rank=0, shuffle=True, seed=seed)


Run = collections.namedtuple("Run", "epochs rng_after generator_after sampler_epoch stats")


def epochs_of(
    cls,
    make_dataset=P(D.IndexMap, N),
    *,
    epochs=3,
    on_epoch=None,
    stop_after=None,
    sampler=None,
    generator_seed=None,
    batch_size=BS,
    num_workers=2,
    **kw,
):
    """Iterate `epochs` epochs of one persistent loader, keeping every batch.  on_epoch(e, g, s)
    runs before epoch e's iter() (g: the generator, s: the sampler); stop_after {epoch: k}
    breaks out of that epoch after its batch k."""
    seed_all(SEED)
    g = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    smp = sampler() if sampler is not None else None
    loader = cls(
        make_dataset(),
        batch_size=batch_size,
        sampler=smp,
        generator=g,
        num_workers=num_workers,
        persistent_workers=True,
        **kw,
    )
    out = []
    with warnings.catch_warnings(), deadline(90):
        warnings.simplefilter("ignore")  # kept batches fill the ring: a warning, not a failure
        for e in range(epochs):
            if on_epoch is not None:
                on_epoch(e, g, smp)
            batches = []
            for k, batch in enumerate(loader):
                batches.append(batch)
                if stop_after is not None and stop_after.get(e) == k:
                    break
            out.append(batches)
    rng_after = (random.random(), np.random.rand(), torch.rand(2))
    generator_after = torch.rand(2, generator=g) if g is not None else None
    stats = loader.stats() if isinstance(loader, ShmDataLoader) else None
    sampler_epoch = getattr(smp, "epoch", None)
    del loader
    gc.collect()
    return Run(out, rng_after, generator_after, sampler_epoch, stats)


def prefetching(**extra):
    return P(ShmDataLoader, prefetch_next_epoch=True, **extra)


def check(ordered=True, shm=None, **kw):
    """torch vs shmloader with prefetch_next_epoch: same batches (as multisets per epoch where
    not ordered) and same main-process RNG draws.  Returns shmloader's stats."""
    t = epochs_of(TorchDataLoader, **kw)
    s = epochs_of(shm or prefetching(), **kw)
    assert [len(e) for e in t.epochs] == [len(e) for e in s.epochs]
    if ordered:
        D.assert_same(t.epochs, s.epochs, "epochs")
    else:
        for e, (te, se) in enumerate(zip(t.epochs, s.epochs)):
            assert collections.Counter(map(D.canon, te)) == collections.Counter(map(D.canon, se)), (
                f"epoch {e}: different batches"
            )
    D.assert_same(t.rng_after, s.rng_after, "main-process RNG after the epochs")
    return s.stats


# --------------------------------------------------------------------------- adopted
@pytest.mark.slow
def test_random_sampler_with_generator_adopted():
    """Nothing changes between epochs: epochs 1 and 2 are the prefetched ones, and equal torch's,
    worker RNG draws (RNGMap) included."""
    stats = check(make_dataset=P(D.RNGMap, N), shuffle=True, generator_seed=3)
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
def test_sequential_sampler_adopted():
    stats = check(epochs=3)
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
def test_distributed_sampler_set_epoch_each_epoch_adopted():
    """The usual DistributedSampler loop: set_epoch(e) before each epoch.  The prefetch called
    set_epoch(e) already, so the call changes nothing and the prefetch stands."""
    stats = check(sampler=P(distributed, N), on_epoch=lambda e, g, s: s.set_epoch(e))
    assert stats.prefetched_epochs == 2


def test_batch_sampler_over_distributed_sampler_set_epoch_each_epoch():
    """set_epoch(e) on a DistributedSampler that a BatchSampler holds: the prefetch sets and
    checks the inner sampler's epoch too, so epoch e is drawn with e, not with e - 1."""

    def epochs(cls):
        inner = distributed(N)
        loader = cls(
            D.IndexMap(N),
            batch_sampler=tud.BatchSampler(inner, BS, False),
            num_workers=2,
            persistent_workers=True,
        )
        out = []
        for e in range(3):
            inner.set_epoch(e)
            out.append(list(loader))
        return out, loader

    expected, _ = epochs(TorchDataLoader)
    got, loader = epochs(prefetching())
    D.assert_same(expected, got, "epochs")
    assert loader.stats().prefetched_epochs == 2


def test_loader_dropped_while_its_iterator_runs():
    """`for batch in DataLoader(...)`: nothing holds the loader, so no next epoch can start;
    the epoch runs to its end as torch's does (nothing prefetched)."""

    def epoch(cls, **extra):
        got = []
        for batch in cls(
            D.IndexMap(N), batch_size=BS, num_workers=2, persistent_workers=True, **extra
        ):
            got.append(batch)
        return got

    D.assert_same(epoch(TorchDataLoader), epoch(ShmDataLoader, prefetch_next_epoch=True), "epoch")


def test_next_epochs_sampler_failing_in_the_prefetch():
    """The next epoch's sampler raises when the prefetch draws it: this epoch's batches all
    come, and the error comes at the next iter(), where torch meets it."""

    def epochs(cls):
        sampler = D.FailingEpochSampler(N, bad=1)
        loader = cls(
            D.IndexMap(N), batch_size=BS, sampler=sampler, num_workers=2, persistent_workers=True
        )
        out = []
        for e in range(3):
            sampler.set_epoch(e)
            try:
                out.append(list(loader))
            except ValueError as error:
                out.append(str(error))
        return out

    expected = epochs(TorchDataLoader)
    assert expected[1] == "no epoch 1 here"
    D.assert_same(expected, epochs(prefetching()), "epochs")


@pytest.mark.slow
def test_custom_sampler_with_set_epoch_adopted():
    stats = check(sampler=P(D.EpochRandomSampler, N, 2), on_epoch=lambda e, g, s: s.set_epoch(e))
    assert stats.prefetched_epochs == 2
    assert stats.dropped_prefetched_batches == 0


@pytest.mark.slow
def test_prefetch_off_by_default():
    stats = check(shm=ShmDataLoader, shuffle=True, generator_seed=3)
    assert stats.prefetched_epochs == 0
    assert stats.dropped_prefetched_batches == 0


# --------------------------------------------------------------------------- discarded
@pytest.mark.slow
def test_reseeded_generator_discards_prefetch():
    """The user reseeds the generator before every epoch: each prefetch was drawn from the old
    state, so it must be dropped and the epoch drawn again."""
    stats = check(shuffle=True, generator_seed=3, on_epoch=lambda e, g, s: g.manual_seed(100 + e))
    assert stats.prefetched_epochs == 0
    # Epochs 1 and 2 each had the whole prefetch window (2 workers x 2) fetched, then dropped.
    assert stats.dropped_prefetched_batches == 8


@pytest.mark.slow
def test_reseeded_once_discards_only_that_epoch():
    def reseed_before_epoch_1(e, g, s):
        if e == 1:
            g.manual_seed(77)

    stats = check(shuffle=True, generator_seed=3, on_epoch=reseed_before_epoch_1)
    assert stats.prefetched_epochs == 1  # epoch 2's prefetch stands
    assert stats.dropped_prefetched_batches == 4


@pytest.mark.slow
def test_reseeded_to_same_state_is_adopted():
    """Reseeding to exactly the state the prefetch left (a no-op for the sampler) keeps it:
    equal states are equal."""
    captured = {}

    def reseed_to_itself(e, g, s):
        if e == 0:
            return
        state = g.get_state()
        g.manual_seed(123)
        g.set_state(state)
        captured[e] = True

    stats = check(shuffle=True, generator_seed=3, on_epoch=reseed_to_itself)
    assert captured == {1: True, 2: True}
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
def test_list_sampler_reshuffled_in_place_discards_prefetch():
    """sampler= a plain list of indices (torch takes any iterable) that the user reshuffles
    in place before every epoch: the prefetch drew from the old order, so it is dropped."""
    orders = {}

    def reshuffle(e, g, s):
        random.Random(e).shuffle(s)
        orders[e] = list(s)

    stats = check(sampler=lambda: list(range(N)), on_epoch=reshuffle)
    assert len(orders) == 3 and stats.prefetched_epochs == 0


@pytest.mark.slow
def test_weights_changed_in_place_discard_prefetch():
    """WeightedRandomSampler's weights (a tensor) edited in place between epochs."""

    def reweight(e, g, s):
        s.weights[e] *= 50

    def weighted():
        generator = torch.Generator().manual_seed(1)
        return tud.WeightedRandomSampler(torch.ones(N, dtype=torch.float64), N, generator=generator)

    stats = check(sampler=weighted, on_epoch=reweight)
    assert stats.prefetched_epochs == 0


class _BucketSampler(tud.Sampler):
    """Buckets of indices (a list of lists), in order; the user reshuffles each bucket in
    place before every epoch."""

    def __init__(self, n):
        self.buckets = [list(range(start, min(start + 8, n))) for start in range(0, n, 8)]

    def __len__(self):
        return sum(map(len, self.buckets))

    def __iter__(self):
        return (i for bucket in self.buckets for i in bucket)


class _Curriculum(tud.Sampler):
    """Its length comes from a dict of settings that the user edits between epochs."""

    def __init__(self, n):
        self.settings = {"schedule": {"up_to": n // 2}}

    def __len__(self):
        return self.settings["schedule"]["up_to"]

    def __iter__(self):
        return iter(range(self.settings["schedule"]["up_to"]))


class _SlotsSampler(tud.Sampler):
    """A sampler with __slots__ (no __dict__) and set_epoch, which the user never calls."""

    __slots__ = ("n", "epoch")

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(
            torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        )


@pytest.mark.slow
def test_state_changed_in_nested_containers_or_slots_discards_prefetch():
    """A sampler's state may sit in a list of lists, a dict of dicts, or __slots__: changed
    in place (or, for an epoch in __slots__, left as it was) it is seen, and every epoch is
    torch's."""

    def reshuffle(e, g, s):
        for bucket in s.buckets:
            random.Random(e).shuffle(bucket)

    def lengthen(e, g, s):
        s.settings["schedule"]["up_to"] += 4 * e

    assert check(sampler=P(_BucketSampler, N), on_epoch=reshuffle).prefetched_epochs == 0
    assert check(sampler=P(_Curriculum, N), on_epoch=lengthen).prefetched_epochs == 0
    assert check(sampler=P(_SlotsSampler, N)).prefetched_epochs == 0
    assert (
        check(
            sampler=P(_SlotsSampler, N), on_epoch=lambda e, g, s: s.set_epoch(e)
        ).prefetched_epochs
        == 2
    )


class _PlanSampler(tud.Sampler):
    """Its order sits second in a list that starts with a name, or in a private __slots__
    name (stored mangled); the user reverses it in place between epochs."""

    __slots__ = ("plan", "__order")

    def __init__(self, n, private=False):
        self.plan = ["stage", list(range(n))]
        self.__order = self.plan[1] if private else list(range(n))

    def reverse(self):
        self.__order.reverse()

    def __len__(self):
        return len(self.plan[1])

    def __iter__(self):
        return iter(list(self.__order))


class _DequeSampler(tud.Sampler):
    """Its order in a deque, which the user rotates in place."""

    def __init__(self, n):
        self.order = collections.deque(range(n))

    def __len__(self):
        return len(self.order)

    def __iter__(self):
        return iter(list(self.order))


class _NumpyRngSampler(tud.Sampler):
    """Shuffled by a numpy RandomState of its own (which the user may reseed); yields the
    first `limit` of each permutation (which the user may change)."""

    def __init__(self, n):
        self.n, self.limit, self.rng = n, n, np.random.RandomState(0)

    def __len__(self):
        return self.limit

    def __iter__(self):
        return iter(self.rng.permutation(self.n)[: self.limit].tolist())


@pytest.mark.slow
def test_state_in_a_deque_or_a_numpy_random_state_discards_prefetch():
    assert (
        check(
            sampler=P(_DequeSampler, N),
            on_epoch=lambda e, g, s: s.order.rotate(5),
        ).prefetched_epochs
        == 0
    )
    assert (
        check(
            sampler=P(_NumpyRngSampler, N),
            on_epoch=lambda e, g, s: s.rng.seed(e),
        ).prefetched_epochs
        == 0
    )


@pytest.mark.slow
def test_a_numpy_random_state_a_sampler_holds_is_drawn_from_privately():
    """The early draws use a private copy of the sampler's own numpy RNG, as of a torch
    generator: a prefetch dropped for another change leaves the RNG where torch's would
    be, and one kept moves it on as torch's draws would."""

    def shorten(e, g, s):
        s.limit = N - 4 * e

    assert check(sampler=P(_NumpyRngSampler, N), on_epoch=shorten).prefetched_epochs == 0
    assert check(sampler=P(_NumpyRngSampler, N)).prefetched_epochs == 2


class _TorchGeneratorSubclass(torch.Generator):
    pass


_OWN_RNGS = {
    "torch-subclass": _TorchGeneratorSubclass,
    "numpy": np.random.RandomState,
    "python": random.Random,
}


class _OwnRngSampler(tud.Sampler):
    """Shuffles with a generator of its own, which set_epoch reseeds; also holds a
    random.SystemRandom (whose state cannot be read) that it never uses."""

    def __init__(self, n, kind):
        self.n, self.epoch, self.entropy = n, 0, random.SystemRandom()
        self.rng = _OWN_RNGS[kind]()
        self.set_epoch(0)

    def set_epoch(self, epoch):
        self.epoch = epoch
        if isinstance(self.rng, torch.Generator):
            self.rng.manual_seed(epoch)
        else:
            self.rng.seed(epoch)

    def __len__(self):
        return self.n

    def __iter__(self):
        if isinstance(self.rng, torch.Generator):
            return iter(torch.randperm(self.n, generator=self.rng).tolist())
        if isinstance(self.rng, random.Random):
            return iter(self.rng.sample(range(self.n), self.n))
        return iter(self.rng.permutation(self.n).tolist())


def _draw_from_its_rng(e, g, s):
    if isinstance(s.rng, torch.Generator):
        torch.rand(1, generator=s.rng)
    else:
        s.rng.random()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(_OWN_RNGS))
@pytest.mark.parametrize("on_epoch", [None, _draw_from_its_rng], ids=["alone", "loop-draws"])
def test_a_samplers_own_generator_reseeded_by_a_set_epoch_never_called(kind, on_epoch):
    """The early draws set the sampler's epoch to e + 1 and back, through its set_epoch,
    which reseeds its generator: torch never calls it, so the user's generator is left as
    it was, and every epoch is torch's."""
    check(sampler=P(_OwnRngSampler, N, kind), on_epoch=on_epoch)


class _LoaderAwareSampler(tud.SequentialSampler):
    """Holds the loader (whose counters move with every batch): not part of its state."""

    loader = None


@pytest.mark.slow
def test_state_in_a_list_after_a_name_or_in_a_private_slot_discards_prefetch():
    reverse_in_list = lambda e, g, s: s.plan[1].reverse()  # noqa: E731 - the order is there
    assert (
        check(
            sampler=P(_PlanSampler, N, private=True),
            on_epoch=reverse_in_list,
        ).prefetched_epochs
        == 0
    )
    assert (
        check(
            sampler=P(_PlanSampler, N),
            on_epoch=lambda e, g, s: s.reverse(),
        ).prefetched_epochs
        == 0
    )


def test_a_sampler_holding_its_loader_is_still_prefetched():
    loaders = []
    sampler = _LoaderAwareSampler(range(N))
    for cls in (TorchDataLoader, prefetching()):
        loaders.append(
            cls(
                D.IndexMap(N),
                batch_size=BS,
                sampler=sampler,
                num_workers=2,
                persistent_workers=True,
            )
        )
        sampler.loader = loaders[-1]
        epochs = [[b[0].tolist() for b in loaders[-1]] for _ in range(3)]
        assert epochs == [[list(range(k, k + BS)) for k in range(0, N, BS)]] * 3
    assert loaders[-1].stats().prefetched_epochs == 2


class _EpochUnderAnotherName(tud.Sampler):
    """A sampler with set_epoch() that keeps its epoch as `_epoch`, not `epoch`."""

    def __init__(self, n):
        self.n, self._epoch = n, 0

    def set_epoch(self, epoch):
        self._epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self._epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


@pytest.mark.slow
def test_sampler_whose_epoch_cannot_be_read_is_not_prefetched():
    """set_epoch(e + 1) around the prefetch's draws could not be undone (no `epoch` to read
    back), so the next epoch is not drawn early: the batches are torch's."""
    stats = check(sampler=P(_EpochUnderAnotherName, N))
    assert stats.prefetched_epochs == 0


def _draw_at_one_step(cls, step, **kw):
    """Two epochs of 10 batches; the loop draws from the loader's generator once, after
    batch `step` of the first (a window of 4: the sampler runs out at batch 6)."""
    g = torch.Generator().manual_seed(3)
    loader = cls(
        list(range(20)),
        batch_size=2,
        shuffle=True,
        generator=g,
        num_workers=2,
        persistent_workers=True,
        **kw,
    )
    epochs, draws = [], []
    with warnings.catch_warnings(), deadline(90):
        warnings.simplefilter("ignore")
        for e in range(2):
            epochs.append([])
            for k, batch in enumerate(loader):
                epochs[-1].append(batch.tolist())
                if e == 0 and k == step:
                    draws.append(torch.rand(1, generator=g).item())
    return epochs, draws, torch.rand(1, generator=g).item()


@pytest.mark.parametrize("step", [7, 8])
def test_loop_drawing_from_the_generator_while_the_next_epoch_is_drawn(step):
    """A draw of the loop's between two of the prefetch's draws: torch draws the next epoch
    after it, so the prefetched epoch is dropped and drawn afresh."""
    assert _draw_at_one_step(prefetching(), step) == _draw_at_one_step(TorchDataLoader, step)


def test_a_dataset_of_tensors_replaced_between_epochs():
    """RandomSampler holds the dataset (a list of tensors) as its data_source: replacing a
    sample between epochs (pseudo-labels) neither fails the comparison nor drops anything
    (the samples are the dataset's business, not the sampler's)."""

    def run(cls, **kw):
        data = [torch.full((2,), float(i)) for i in range(12)]
        loader = cls(
            data,
            batch_size=3,
            shuffle=True,
            generator=torch.Generator().manual_seed(1),
            num_workers=2,
            persistent_workers=True,
            **kw,
        )
        out = []
        for e in range(3):
            data[e] = torch.full((2,), -1.0)
            out.append([b.tolist() for b in loader])
        return out

    assert run(prefetching()) == run(TorchDataLoader)


class _Resizable(tud.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_a_dataset_whose_length_changes_between_epochs(shuffle, change):
    """A curriculum that resizes its dataset after an epoch: the prefetched epoch was drawn
    below the old length, so it is drawn again (SequentialSampler and RandomSampler hold the
    dataset itself, whose length is all they draw from)."""

    def run(cls, **kw):
        dataset = _Resizable(16)
        loader = cls(
            dataset,
            batch_size=4,
            shuffle=shuffle,
            num_workers=2,
            generator=torch.Generator().manual_seed(3),
            persistent_workers=True,
            **kw,
        )
        out = []
        for e in range(3):
            out.append(([b.tolist() for b in loader], len(loader)))
            dataset.n = 8 if change == "shrink" else 16 + 4 * (e + 1)
        return out

    assert run(prefetching()) == run(TorchDataLoader)


class _SubsetSampler(tud.Sampler):
    """Draws the indices of a Subset it holds (a curriculum changes them in place)."""

    def __init__(self, subset):
        self.subset = subset

    def __iter__(self):
        return iter(self.subset.indices)

    def __len__(self):
        return len(self.subset.indices)


def test_a_subset_whose_indices_change_in_place_between_epochs():
    """A dataset a sampler holds (not the loader's own) is followed into like any object:
    its indices changed in place, at the same length, drop the prefetched epoch."""

    def run(cls, **kw):
        base = list(range(100))
        subset = tud.Subset(base, list(range(16)))
        loader = cls(
            base,
            batch_size=4,
            sampler=_SubsetSampler(subset),
            num_workers=1,
            persistent_workers=True,
            **kw,
        )
        out = []
        for e in range(3):
            out.append([b.tolist() for b in loader])
            subset.indices[:] = range(50 + 10 * e, 66 + 10 * e)
        return out

    assert run(prefetching()) == run(TorchDataLoader)


def test_break_after_the_sampler_ran_out_leaves_the_ring_its_slots():
    """The broken-off epoch's tasks still in flight are awaited before the adopted epoch
    fills its window, so their slots are free for it: no batch falls back to torch's
    transport."""
    loader = ShmDataLoader(
        D.IndexMap(40),
        batch_size=1,
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=True,
        prefetch_next_epoch=True,
    )
    with warnings.catch_warnings(), deadline(90):
        warnings.simplefilter("error")
        for _ in loader:  # sizes the ring
            pass
        for k, _ in enumerate(loader):
            if k == 32:  # the sampler has run out: the next epoch is being fetched
                break
        assert [int(b[0]) for b in loader] == list(range(40))
    stats = loader.stats()
    assert stats.ring_full_batches == 0 and stats.prefetched_epochs == 2


def _draws_in_the_loop(cls, **kw):
    """Two epochs whose loop draws from the loader's generator after every batch."""
    seed_all(SEED)
    g = torch.Generator().manual_seed(3)
    loader = cls(
        D.IndexMap(N),
        batch_size=BS,
        shuffle=True,
        generator=g,
        num_workers=2,
        persistent_workers=True,
        **kw,
    )
    draws, batches = [], []
    with warnings.catch_warnings(), deadline(90):
        warnings.simplefilter("ignore")  # kept batches fill the ring
        for _ in range(2):
            for batch in loader:
                batches.append(batch)
                draws.append(torch.rand(1, generator=g).item())
    return draws, batches


def test_draws_from_the_generator_in_the_loop_stay_the_users():
    """The prefetch switches the generator to a private state around each of its draws and
    back: back to where the loop's own draws left it, not to where the prefetch began, so
    no draw of the user's is repeated and the next epoch is torch's."""
    torch_draws, torch_batches = _draws_in_the_loop(TorchDataLoader)
    draws, batches = _draws_in_the_loop(prefetching())
    assert draws == torch_draws
    D.assert_same(torch_batches, batches, "batches")


@pytest.mark.parametrize(
    "values", [[1, 8, 15], [0, 1, 1], [0, 5, 6]], ids=["all-unexpected", "repeat", "jump-then-next"]
)
@pytest.mark.slow
def test_set_epoch_with_unexpected_value(values):
    """set_epoch with another value than the prefetch assumed (e + 1): that epoch is refetched;
    an epoch whose value is the one after the previous epoch's is adopted."""
    stats = check(sampler=P(distributed, N), on_epoch=lambda e, g, s: s.set_epoch(values[e]))
    expected = sum(values[e] == values[e - 1] + 1 for e in (1, 2))
    assert stats.prefetched_epochs == expected


# --------------------------------------------------------------------------- breaking out
@pytest.mark.slow
def test_break_before_sampler_runs_out_then_full_epochs():
    """Epoch 0 broken off after 2 batches (its sampler never ran out: no prefetch), epoch 1
    whole (prefetches epoch 2), epoch 2 broken off after 8 batches (by then its sampler ran out:
    epoch 3 was prefetched, and stands)."""
    stats = check(epochs=4, shuffle=True, generator_seed=3, stop_after={0: 1, 2: 7})
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
def test_breaks_after_the_sampler_ran_out_leave_every_epoch_its_window():
    """Epochs broken off after their sampler ran out, again and again: the broken epoch's
    tasks still in flight must not take the next epoch's prefetch window, or that epoch's
    sampler runs out later than torch's, and the generator's draws (RandomSampler's last,
    empty randperm) fall behind torch's."""
    stats = check(epochs=4, shuffle=True, generator_seed=3, stop_after={0: 7, 1: 7, 2: 7})
    assert stats.prefetched_epochs == 3


@pytest.mark.slow
def test_break_with_distributed_sampler():
    stats = check(
        epochs=3,
        make_dataset=P(D.IndexMap, 2 * N),
        sampler=P(distributed, 2 * N),
        stop_after={1: 3},
        on_epoch=lambda e, g, s: s.set_epoch(e),
    )
    assert stats.prefetched_epochs == 1  # epoch 1 adopted; epoch 1 broken before running out


# --------------------------------------------------------------------------- other options
@pytest.mark.slow
def test_in_order_false():
    """Batches of the next epoch must not leak into this one with in_order=False, nor be lost.

    (Found at 0455b9e: epochs of 9 of 10 batches in about half the runs.  With in_order=False
    torch's _try_put_index draws an index and drops it when no worker has capacity; torch only
    calls it after processing a task, so never gets there, but _adopt_next_epoch topped
    _tasks_outstanding up without counting next-epoch results already arrived, so every worker
    was at capacity and drawn indices were dropped.)"""
    stats = check(
        ordered=False,
        epochs=4,
        make_dataset=P(D.JitterMap, N),
        in_order=False,
        shuffle=True,
        generator_seed=3,
    )
    assert stats.prefetched_epochs == 3


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ["interleaved", "dynamic"])
def test_fetch_sample_with_generator(assignment):
    stats = check(
        shm=prefetching(fetch="sample", assignment=assignment), shuffle=True, generator_seed=3
    )
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
@pytest.mark.parametrize("assignment", ["interleaved", "dynamic"])
def test_fetch_sample_with_distributed_sampler(assignment):
    stats = check(
        shm=prefetching(fetch="sample", assignment=assignment),
        make_dataset=P(D.NumericMap, N),
        sampler=P(distributed, N),
        on_epoch=lambda e, g, s: s.set_epoch(7 * e),
    )  # 0, 7, 14: never e + 1
    assert stats.prefetched_epochs == 0


@pytest.mark.slow
def test_three_workers_prefetch_factor_1():
    stats = check(num_workers=3, prefetch_factor=1, shuffle=True, generator_seed=3)
    assert stats.prefetched_epochs == 2


INVALID = {
    "not-persistent": (P(D.IndexMap, 4), dict(num_workers=2, prefetch_next_epoch=True)),
    "no-workers": (P(D.IndexMap, 4), dict(prefetch_next_epoch=True)),
    "iterable": (
        P(D.ShardedIterable, 4),
        dict(num_workers=2, persistent_workers=True, prefetch_next_epoch=True),
    ),
    "not-a-bool": (
        P(D.IndexMap, 4),
        dict(num_workers=2, persistent_workers=True, prefetch_next_epoch="yes"),
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_is_value_error(name):
    make, kw = INVALID[name]
    with pytest.raises(ValueError, match="prefetch_next_epoch"):
        ShmDataLoader(make(), batch_size=2, **kw)


# --------------------------------------------------------------------------- bugs found
@pytest.mark.slow
def test_prefetched_results_arrived_early():
    """Results of the next epoch that arrive while the main process still waits for this
    epoch's last batch are stored (task_info with data, _tasks_outstanding already decremented);
    adopting the epoch must count them in the prefetch window.  Here the last sample of each
    epoch is slow, so the other worker finishes next-epoch batches first.  (Found at 0455b9e:
    _adopt_next_epoch topped _tasks_outstanding up to the full window without counting them,
    and yielding one of them tripped `assert self._tasks_outstanding < max_tasks` in
    _try_put_index; with fast datasets about 1 run in 3 of 3 epochs failed that way.)"""
    make = P(D.SlowMap, 16, slow=(15,), delay=0.3)
    stats = check(make_dataset=make, epochs=2, batch_size=2)
    assert stats.prefetched_epochs == 1


@pytest.mark.slow
def test_discarded_prefetch_leaves_worker_rng_untouched():
    """Regression (fixed): when a prefetched epoch is dropped (the user reseeded the generator),
    the persistent workers have already fetched some of its batches, drawing from their
    random/torch/numpy streams.  torch's workers never fetched those, so every later sample
    that draws random numbers (RNGMap: augmentation) differs from torch's, by an amount that
    depends on timing.  (The same loop with a dataset that draws nothing passes:
    test_reseeded_generator_discards_prefetch.)"""
    stats = check(
        make_dataset=P(D.RNGMap, N),
        shuffle=True,
        generator_seed=3,
        on_epoch=lambda e, g, s: g.manual_seed(100 + e),
    )
    assert stats.prefetched_epochs == 0


@pytest.mark.slow
def test_prefetch_that_exhausts_the_next_sampler():
    """Regression (fixed): an epoch of 3 batches is wholly dispatched by the prefetch, so the next
    epoch's RandomSampler runs out during the prefetch, and running out draws from the generator
    once more (RandomSampler ends with randperm(n)[:0]).  The generator state then differs from
    the one captured after the first draw, the next iter() drops the prefetch as "changed", and
    draws the epoch again from the advanced generator: epoch 1 yields torch's epoch 2, epoch 2
    torch's epoch 3."""
    stats = check(make_dataset=P(D.IndexMap, 12), shuffle=True, generator_seed=3)
    assert stats.prefetched_epochs == 2


@pytest.mark.slow
def test_distributed_sampler_without_set_epoch():
    """Regression (fixed; drop-in): a user who never calls set_epoch gets the same order every
    epoch from torch (DistributedSampler's documented pitfall).  The prefetch calls set_epoch(1),
    set_epoch(2) on the user's sampler itself, and since nothing changed afterwards adopts those
    epochs: the order differs from torch's from epoch 1 on."""
    check(sampler=P(distributed, N))


@pytest.mark.slow
def test_user_draws_from_generator_between_epochs():
    """Regression (fixed): the user draws from the loader's generator between epochs (the same
    generator also feeding augmentation or another sampler).  torch draws the next permutation
    after those draws, at iter(); the prefetch drew it before them, so the user's draws get
    other values, the prefetch is dropped as changed and the permutation drawn again from a
    different state: batches and the user's draws differ from torch's."""
    draws = {}

    def draw(e, g, s):
        if e:
            draws.setdefault(e, []).append(torch.rand(1, generator=g).item())

    check(shuffle=True, generator_seed=3, on_epoch=draw)
    assert draws[1][0] == draws[1][1] and draws[2][0] == draws[2][1], (
        f"the user's own draws (torch, shm) differ: {draws}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["generator", "distributed"])
def test_user_state_after_training_is_torchs(kind):
    """Regression (fixed; drop-in): after the last epoch the prefetch has already drawn an epoch
    that never runs: the user's generator is one permutation further than torch leaves it (a
    later loader or draw from it differs), and the sampler's epoch is one more than the user
    set (set_epoch(3) after the user's set_epoch(2))."""
    if kind == "generator":
        kw = dict(shuffle=True, generator_seed=3)
    else:
        kw = dict(sampler=P(distributed, N), on_epoch=lambda e, g, s: s.set_epoch(e))
    t = epochs_of(TorchDataLoader, **kw)
    s = epochs_of(prefetching(), **kw)
    D.assert_same(t.epochs, s.epochs, "epochs")
    D.assert_same(t.generator_after, s.generator_after, "generator draws after the last epoch")
    assert t.sampler_epoch == s.sampler_epoch, "sampler.epoch after the last epoch"

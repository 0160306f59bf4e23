"""The ring as users see it: batches are slot views that never change while
held, kept batches never deadlock, oversize batches spill whole, leaves that
cannot live in a slot fall back, and bad sizes are clear errors."""

import collections
import gc
import inspect
import os
import subprocess
import sys
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

from shmloader import DataLoader, SharedMemoryError, ShmloaderWarning
from shmloader._shm import _layout, _slot_rules
from tests.helpers import ROOT
from tests.helpers import datasets as D
from tests.helpers.datasets import Buckets, Images
from tests.helpers.procs import forget, wait_gone

# Tests whose datasets or collate functions are defined in the test (local):
# they reach workers only by fork, whatever the default start method.
LOCAL_OBJECTS = "fork"

# Slots held by batches are what these tests are about: small leaves stay views.
pytestmark = pytest.mark.usefixtures("views_only")
SMALL_LEAF_BYTES = _layout.SMALL_LEAF_BYTES  # the real threshold, for the test of it

SLOT = 1 << 16
Pair = collections.namedtuple("Pair", "image meta")


def _expected(n, batch_size):
    data = Images(n)
    return [
        torch.stack([data[i] for i in range(s, min(s + batch_size, n))])
        for s in range(0, n, batch_size)
    ]


def test_batches_are_views_of_the_ring():
    loader = DataLoader(Images(32), batch_size=4, num_workers=2, slot_bytes=SLOT)
    batches = []
    for batch in loader:
        batches.append(batch.clone())
        # Not torch's per-batch shared segment: a view into the ring's storage.
        assert not batch.untyped_storage().is_shared()
    assert loader.stats().slot_batches == 8
    assert [torch.equal(a, b) for a, b in zip(batches, _expected(32, 4))] == [True] * 8


def test_list_of_loader_never_changes_and_warns_once():
    loader = DataLoader(Images(200), batch_size=4, num_workers=2, slot_bytes=SLOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(loader)
    ring_full = [w for w in caught if "ring slots are in use" in str(w.message)]
    assert len(ring_full) == 1
    assert "keep a .clone() of it instead" in str(ring_full[0].message)  # the way out
    stats = loader.stats()
    assert stats.ring_full_batches > 0 and stats.slot_batches + stats.ring_full_batches == 50
    for got, want in zip(kept, _expected(200, 4)):
        assert torch.equal(got, want)


def _each_next_with_warnings_as_errors(loader, hold):
    """Every next() of an epoch under warnings.simplefilter("error") (pytest -W error):
    the batch, or the warning raised in its place; up to `hold` batches kept at a time."""
    got, held = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return got
            except ShmloaderWarning as warning:
                got.append(str(warning))
                continue
            got.append(batch.clone())
            held = held[-hold + 1 :] + [batch] if hold > 1 else []


@pytest.mark.parametrize("case", ["ring_full", "spill"])
def test_a_warning_made_an_error_loses_no_batch(case):
    """With warnings turned into errors, shmloader's ring-full and spill warnings are
    raised between batches: every batch torch yields still arrives, in order (raised
    where they fire, they took the batch being returned and a task being sent)."""
    if case == "ring_full":  # a loop keeping 16 batches, more than 8 slots hold
        dataset, kw, hold, words = Images(64), dict(batch_size=4, num_slots=8), 16, "ring slots"
        want = _expected(64, 4)
    else:  # samples that outgrow the slot sized from the first batch
        dataset, kw, hold, words = D.GrowingMap(8), dict(batch_size=None), 1, "did not fit"
        want = list(torch.utils.data.DataLoader(dataset, batch_size=None))
    got = _each_next_with_warnings_as_errors(DataLoader(dataset, num_workers=2, **kw), hold)
    warned = [item for item in got if isinstance(item, str)]
    assert len(warned) == 1 and words in warned[0], warned
    batches = [item for item in got if not isinstance(item, str)]
    assert len(batches) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(batches, want))


class _SpillsAtBatch6(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((8192 * (8 if i // 2 == 6 else 1),), float(i))


def test_both_warnings_made_errors_are_raised_and_no_batch_is_lost():
    """A loop keeping every batch fills the ring, and batch 6 outgrows its slot: both
    warnings are raised (they may be met in one next()), and every batch arrives."""
    got = _each_next_with_warnings_as_errors(
        DataLoader(_SpillsAtBatch6(), batch_size=2, num_workers=2, prefetch_factor=1, num_slots=4),
        hold=40,
    )
    warned = sorted(item for item in got if isinstance(item, str))
    assert len(warned) == 2, warned
    assert "did not fit" in warned[0] and "all 4 ring slots are in use" in warned[1], warned
    assert [int(b[0, 0]) for b in got if not isinstance(b, str)] == list(range(0, 40, 2))


def test_a_warning_left_unraised_comes_again_next_epoch():
    """A loop that stops at the batch whose next() met the ring-full warning (made an
    error: the fifth, 5 kept and 4 in flight wanting 9 slots) never sees it raised; the
    next epoch, filling the ring again, raises it where it comes, not at its start."""
    loader = DataLoader(
        Images(64),
        batch_size=4,
        num_workers=2,
        num_slots=8,
        slot_bytes=SLOT,
        persistent_workers=True,
    )
    raised = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(2):
            kept = []
            it = iter(loader)
            try:
                while len(kept) < (16 if epoch else 5):
                    kept.append(next(it))
            except ShmloaderWarning as warning:
                raised.append((epoch, len(kept), "all 8 ring slots are in use" in str(warning)))
            del it, kept
    assert raised == [(1, 5, True)], raised


class _GrowingBatches(torch.utils.data.Sampler):
    """Batches of 1 sample, then one of 50, which outgrows a ring sized from the first."""

    def __len__(self):
        return 10

    def __iter__(self):
        start = 0
        for n in [1] * 8 + [50, 1]:
            yield list(range(start, start + n))
            start += n


def test_an_iterator_left_with_a_warning_unraised_goes_at_once_and_the_warning_comes_again():
    """A loop that breaks right after the batch whose next() met the spill warning (made
    an error) leaves that warning unraised: its iterator still goes as soon as the loop
    drops it, workers included (no reference cycle for the garbage collector to find), and
    the next epoch raises the warning again where its cause comes."""
    # (A slot size of the user's: with slot_bytes=None the next epoch's slots would fit.)
    loader = DataLoader(
        Images(64, shape=(3, 64, 64)),
        batch_sampler=_GrowingBatches(),
        num_workers=2,
        slot_bytes=1 << 16,
    )
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            it = iter(loader)
            for _ in range(9):  # up to the batch that spilled
                next(it)
            assert it._deferred_warnings  # met, not raised yet
            pids, gone = it._pool.pids, weakref.ref(it)
            del it
            assert gone() is None
            raised = []
            it = iter(loader)
            for k in range(10):
                try:
                    next(it)
                except ShmloaderWarning as warning:
                    raised.append((k, "did not fit" in str(warning)))
                    next(it)  # the batch whose next() it was raised before
            del it
    finally:
        gc.enable()
    assert raised == [(9, True)], raised
    assert wait_gone(pids, 30)[0] == []


class _StreamWithBigState(torch.utils.data.IterableDataset):
    """Batches of 32 KiB whose worker state holds 200 KB (a shuffle buffer, say)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return (torch.full((64, 64), float(i)) for i in range(info.id, 96, info.num_workers))

    def state_dict(self):
        return {"buffer": bytes(200_000)}


def test_ring_sized_for_a_big_dataset_state():
    """Each batch carries its worker's state: a ring sized from the first batches makes
    room for a state larger than the room kept for it, so no batch spills."""
    loader = DataLoader(_StreamWithBigState(), batch_size=8, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = sorted(int(value) for batch in loader for value in batch[:, 0, 0])
    assert got == list(range(96))
    stats = loader.stats()
    assert stats.spilled_batches == 0 and stats.slot_batches > 0


def test_spill_warning_names_a_big_dataset_state():
    """slot_bytes that holds the batch but not its worker's state: the spill warning says
    the state is what does not fit, not the batch alone."""
    loader = DataLoader(_StreamWithBigState(), batch_size=8, num_workers=2, slot_bytes=1 << 16)
    with pytest.warns(
        ShmloaderWarning,
        match=r"a batch \(with the worker's state, \d+ bytes: the "
        r"dataset's state_dict\(\) and the RNGs\) did not fit",
    ):
        assert len(list(loader)) == 12


def test_every_third_batch_kept_in_dict_stays_intact():
    loader = DataLoader(
        Images(600), batch_size=4, num_workers=2, slot_bytes=SLOT, persistent_workers=True
    )
    expected = _expected(600, 4)
    for epoch in range(2):
        kept = {}
        for i, batch in enumerate(loader):
            if i % 3 == 0:
                kept[i] = batch
            assert torch.equal(batch, expected[i])
        for i, batch in kept.items():
            assert torch.equal(batch, expected[i]), f"kept batch {i} changed"


def test_released_slot_is_reused_only_after_views_die():
    loader = DataLoader(
        Images(400),
        batch_size=4,
        num_workers=2,
        slot_bytes=SLOT,
        num_slots=6,
        persistent_workers=True,
    )
    first = None
    expected = _expected(400, 4)
    for i, batch in enumerate(loader):
        if i == 0:
            first = batch[1:3]  # a view of a view: still holds the slot
        assert torch.equal(batch, expected[i])
    assert torch.equal(first, expected[0][1:3])


def test_in_place_edits_by_user_do_not_leak_into_later_batches():
    loader = DataLoader(Images(64), batch_size=4, num_workers=2, slot_bytes=SLOT)
    for i, (batch, want) in enumerate(zip(loader, _expected(64, 4))):
        assert torch.equal(batch, want)
        batch.fill_(255)  # the slot is ours until released


def test_oversize_batch_spills_whole_and_is_counted():
    class Growing(Images):
        def __getitem__(self, i):
            return torch.full((i + 1, 256), i % 251, dtype=torch.uint8)

    # A local class is fine under fork.  Samples 0-15 fit a 4096-byte slot (the
    # metadata may use the room kept for the worker state).
    loader = DataLoader(
        Growing(40),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        slot_bytes=1024,
    )
    with pytest.warns(
        ShmloaderWarning,
        match=r"did not fit its slot \(4096 bytes for a batch: slot_bytes=1024, rounded up",
    ):
        for i, t in enumerate(loader):
            assert t.shape == (i + 1, 256) and bool((t == i % 251).all())
    stats = loader.stats()
    assert stats.spilled_batches >= 24 and stats.slot_batches >= 10
    assert stats.spilled_batches + stats.slot_batches == 40


def test_default_collate_spill_is_not_corrupted_by_slot_reuse():
    # Stacked into the slot, then the metadata (a long string list) overflows it,
    # room for the worker state included.
    class Named(Images):
        def __getitem__(self, i):
            return super().__getitem__(i), "x" * 9000 + str(i)

    loader = DataLoader(
        Named(64),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        slot_bytes=4096,
    )
    with pytest.warns(ShmloaderWarning, match="did not fit"):
        for b, (images, names) in enumerate(loader):
            assert torch.equal(images, _expected(64, 4)[b])
            assert names == tuple("x" * 9000 + str(i) for i in range(b * 4, b * 4 + 4))


NO_ROOM_SCRIPT = """
import sys, warnings, torch, torch.utils.data as tud
import shmloader
from tests.helpers.datasets import Images

class Growing(tud.Dataset):  # batches of 2 grow from 2 KB to 12 KB
    def __len__(self): return 12
    def __getitem__(self, i): return torch.full((1000 * (i // 2 + 1),), i, dtype=torch.uint8)

warnings.simplefilter("ignore")
fork = {"multiprocessing_context": "fork"}  # (Growing lives in this script's __main__)
loader = {
    "torch": lambda: tud.DataLoader(Growing(), batch_size=2, num_workers=1, **fork),
    "spill": lambda: shmloader.DataLoader(Growing(), batch_size=2, num_workers=1,
                                          slot_bytes=4096, **fork),
    "ring_full": lambda: shmloader.DataLoader(Images(24, shape=(3, 32, 32)), batch_size=2,
                                              num_workers=1, num_slots=1, slot_bytes=1 << 16,
                                              **fork),
}[sys.argv[1]]()
held, it = [], iter(loader)
for _ in range(len(loader)):
    try:
        held.append(next(it))  # kept: with one slot, the ring is full at once
        print("batch")
    except RuntimeError as e:
        print(type(e).__name__, " ".join(str(e).split()))
"""


@pytest.fixture(scope="module")
def no_room_for_torch(tmp_path_factory):
    """An LD_PRELOAD library under which torch's shared memory finds /dev/shm full."""
    source = ROOT / "tests" / "c" / "no_room_for_torch.c"
    library = tmp_path_factory.mktemp("shim") / "no_room_for_torch.so"
    build = subprocess.run(
        [
            os.environ.get("CC", "gcc"),
            "-shared",
            "-fPIC",
            "-O1",
            str(source),
            "-o",
            str(library),
            "-ldl",
        ],
        capture_output=True,
        text=True,
    )
    if build.returncode:
        pytest.skip(f"gcc could not build the shim: {build.stderr}")
    return library


@pytest.mark.slow
@pytest.mark.parametrize("case", ["spill", "ring_full"])
def test_batches_outside_the_ring_need_no_room_in_dev_shm(no_room_for_torch, case):
    """/dev/shm full for torch's shared memory (a collate's in a worker, or its
    transport's): torch's loader fails every batch, while batches that outgrew their slot,
    or came while every slot was held, come whole in one-off memfd segments."""

    def run(which):
        out = subprocess.run(
            [sys.executable, "-c", NO_ROOM_SCRIPT, which],
            cwd=ROOT,
            timeout=120,
            env={**os.environ, "LD_PRELOAD": str(no_room_for_torch)},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    torch_lines = run("torch")
    assert all(
        line.startswith("RuntimeError") and "unable to resize file" in line for line in torch_lines
    ), torch_lines  # the shim works: torch fails them all
    assert run(case) == ["batch"] * {"spill": 6, "ring_full": 12}[case]


class _SlowLargeFastSmall(torch.utils.data.Dataset):
    """Samples below 1000 are slow to fetch (the even batches' 32), the others fast."""

    def __len__(self):
        return 2000

    def __getitem__(self, i):
        if i < 1000:
            time.sleep(0.002)
        return torch.zeros(3, 32, 32)


class _LargeThenSmall(torch.utils.data.Sampler):
    """Even batches of 32 slow samples, odd ones of 2 fast ones."""

    def __len__(self):
        return 8

    def __iter__(self):
        for k in range(8):
            yield list(range(k * 32, k * 32 + 32)) if k % 2 == 0 else [1000 + 2 * k, 1001 + 2 * k]


def test_slot_size_learned_from_the_first_batch_even_when_a_smaller_one_arrives_first():
    """Batch 1 (small, fast) arrives before batch 0 (large, slow): the ring is still
    sized for batch 0, so no batch as large as it spills."""
    loader = DataLoader(_SlowLargeFastSmall(), batch_sampler=_LargeThenSmall(), num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizes = [len(batch) for batch in loader]
    assert sizes == [32, 2] * 4
    stats = loader.stats()
    assert stats.slot_bytes >= 32 * 3 * 32 * 32 * 4 and stats.spilled_batches == 0, stats


def test_slot_size_learned_from_first_batch():
    loader = DataLoader(Images(64, shape=(3, 32, 32)), batch_size=8, num_workers=2)
    list(loader)
    stats = loader.stats()
    batch_bytes = 8 * 3 * 32 * 32
    assert stats.slot_bytes >= batch_bytes and stats.slot_bytes < 4 * batch_bytes + 200_000
    # prefetch_factor * num_workers sent before the first batch came back,
    # and the one dispatched while it is yielded (the ring is made after).
    assert stats.unsized_batches == 5
    ring = loader._ring_handover.spare_ring
    list(loader)  # a new iterator reuses the sized ring
    assert loader.stats().unsized_batches == 5
    assert loader._ring_handover.spare_ring is ring


def _distant_slices_of_one_storage(indices):
    """Two slices 2 MB apart in one storage: a slot holds one copy of the bytes they span."""
    big = torch.arange(1_000_000, dtype=torch.float32) + indices[0]
    return big[:1000], big[500_000:501_000]


def test_ring_sizing_counts_the_bytes_that_views_of_one_storage_span():
    """Sized by the sum of the leaves alone (8 KB), every batch would spill, and
    the slots grown after a spill would be measured the same way."""
    loader = DataLoader(
        list(range(64)),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        collate_fn=_distant_slices_of_one_storage,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the spill warning
        for _ in range(2):
            for i, (a, b) in enumerate(loader):
                assert torch.equal(a, torch.arange(1000.0) + 4 * i)
                assert torch.equal(b, torch.arange(500_000.0, 501_000.0) + 4 * i)
                assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    stats = loader.stats()
    assert stats.spilled_batches == 0 and stats.slot_batches > 16, stats


class _OneLargeBatch(torch.utils.data.Sampler):
    """Batches of 2 samples, with one of 40 late in the epoch (after the ring is sized)."""

    def __len__(self):
        return 12

    def __iter__(self):
        start = 0
        for n in [2] * 9 + [40, 2, 2]:
            yield list(range(start, start + n))
            start += n


@pytest.mark.parametrize(
    "options",
    [
        dict(persistent_workers=True),
        dict(persistent_workers=False),
        dict(persistent_workers=True, prefetch_next_epoch=True),
        dict(persistent_workers=True, fetch="sample"),
        dict(persistent_workers=True, slot_bytes=1 << 16),
    ],
    ids=["persistent", "new-workers", "prefetch-next-epoch", "sample", "users-slot-bytes"],
)
def test_slots_grow_at_the_next_epoch_to_fit_a_batch_that_spilled(options):
    """With slot_bytes=None a batch larger than the slots sized from the first batch
    spills in its epoch; from the next epoch (the one after, where that epoch was
    prefetched already) the slots fit it, and the batches are torch's all along. Slots
    the user sized stay as they are."""
    dataset = Images(64, shape=(3, 32, 32))
    want = list(torch.utils.data.DataLoader(dataset, batch_sampler=_OneLargeBatch()))
    loader = DataLoader(dataset, batch_sampler=_OneLargeBatch(), num_workers=2, **options)
    spilled = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            for got, expected in zip(loader, want, strict=True):  # none kept: no ring-full
                assert torch.equal(got, expected)
            spilled.append(loader.stats().spilled_batches)
    spill_warnings = [str(w.message) for w in caught if "did not fit" in str(w.message)]
    assert len(spill_warnings) == 1
    if "slot_bytes" in options:
        assert spilled == [1, 2, 3, 4]
        assert "from the start" not in spill_warnings[0]
        return
    assert "until the next epoch starts" in spill_warnings[0]
    assert spilled[0] == 1 and spilled[-1] == spilled[-2] <= 2, spilled
    assert loader.stats().slot_bytes >= 40 * 3 * 32 * 32


class _GrowingStream(torch.utils.data.IterableDataset):
    """Each worker's share of 12 samples: 8 small ones, then 4 large ones."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for k in range(start, 12, step):
            yield torch.full((1000 if k < 8 else 100_000,), float(k))


@pytest.mark.parametrize("case", ["iterable-dataset", "epoch-broken-off"])
def test_persistent_slots_grow_whatever_tasks_the_last_epoch_left(case):
    """An IterableDataset's epoch ends with tasks sent to workers that ran out, and an epoch
    broken off right after its spill leaves tasks in flight: the next epoch still starts
    with slots that fit, and no batch spills again."""
    if case == "iterable-dataset":
        dataset, kw = _GrowingStream(), dict(batch_size=2)
    else:
        dataset, kw = Images(64, shape=(3, 32, 32)), dict(batch_sampler=_OneLargeBatch())
    want = list(torch.utils.data.DataLoader(dataset, num_workers=2, **kw))
    loader = DataLoader(dataset, num_workers=2, persistent_workers=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case == "iterable-dataset":
            assert all(torch.equal(g, w) for g, w in zip(loader, want, strict=True))
        else:
            for got, expected in zip(loader, want):
                if len(got) == 40:
                    break  # right after the batch that spilled
        spilled = loader.stats().spilled_batches
        assert spilled >= 1
        for _ in range(2):
            for got, expected in zip(loader, want, strict=True):
                assert torch.equal(got, expected)
            assert loader.stats().spilled_batches == spilled


def test_slots_stay_as_they_are_where_larger_ones_would_not_fit(monkeypatch):
    """A batch that outgrew the slots makes them larger only where a ring of the larger
    slots fits whole: else the ring stays as it is (the large batch spills every epoch)
    rather than shrinking to fewer slots, or none."""
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(1_000_000))  # 8 small slots fit, not 8 large
    dataset = Images(64, shape=(3, 32, 32))
    want = list(torch.utils.data.DataLoader(dataset, batch_sampler=_OneLargeBatch()))
    loader = DataLoader(
        dataset, batch_sampler=_OneLargeBatch(), num_workers=2, persistent_workers=True
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            for got, expected in zip(loader, want, strict=True):
                assert torch.equal(got, expected)
            stats = loader.stats()
            assert (stats.spilled_batches, stats.ring_slots) == (epoch + 1, 8), stats
    assert not [w for w in caught if "room" in str(w.message)]


def test_slots_do_not_grow_past_the_memory_a_ring_can_have(monkeypatch):
    """Slots grow to fit a batch that spilled where a ring of the larger slots fits in
    memory (here SHMLOADER_SHM_LIMIT): 8 slots for the 40-sample batch do, 8 for the
    60-sample one do not, so the slots stay sized for 40 and the 60s keep spilling.  The
    60s come after the first 5 batches, those sent before the first ring is made (which
    would size it for the largest that arrived: fewer, larger slots)."""
    sample = 3 * 64 * 64
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(8 * 700_000))
    dataset = Images(200, shape=(3, 64, 64))
    buckets = Buckets((2, 40, 4, 8, 2, 60, 60, 1))
    want = list(torch.utils.data.DataLoader(dataset, batch_sampler=buckets))
    loader = DataLoader(dataset, batch_sampler=buckets, num_workers=2, persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the spill warning)
        for _ in range(3):
            for got, expected in zip(loader, want, strict=True):
                assert torch.equal(got, expected)
    stats = loader.stats()
    assert stats.ring_slots == 8 and 40 * sample < stats.slot_bytes < 60 * sample, stats


def test_fallback_leaves_travel_by_torch_and_are_counted():
    def collate(samples):
        dense = torch.stack(samples)
        return {
            "dense": dense,
            "sparse": dense.float().to_sparse(),
            "param": torch.nn.Parameter(dense.float()),
        }

    loader = DataLoader(
        Images(16),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        collate_fn=collate,
        slot_bytes=SLOT,
    )
    for b, batch in enumerate(loader):
        want = _expected(16, 4)[b]
        assert torch.equal(batch["dense"], want)
        assert torch.equal(batch["sparse"].to_dense(), want.float())
        assert type(batch["param"]) is torch.nn.Parameter
    assert loader.stats().fallback_leaves == 8


def test_numpy_leaves_land_in_slot_as_arrays():
    def collate(samples):
        return np.stack([s.numpy() for s in samples]), [int(s[0, 0, 0]) for s in samples]

    loader = DataLoader(
        Images(16),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        collate_fn=collate,
        slot_bytes=SLOT,
    )
    for b, (array, ints) in enumerate(loader):
        assert type(array) is np.ndarray and array.dtype == np.uint8
        np.testing.assert_array_equal(array, _expected(16, 4)[b].numpy())
        assert ints == list(range(b * 4, b * 4 + 4))
    assert loader.stats().slot_batches == 4


def test_noncontiguous_and_channels_last_leaves_keep_values_and_layout():
    def collate(samples):
        stacked = torch.stack(samples).float()
        return stacked.transpose(1, 3), stacked.contiguous(memory_format=torch.channels_last)

    loader = DataLoader(
        Images(8),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        collate_fn=collate,
        slot_bytes=SLOT,
    )
    for b, (t, cl) in enumerate(loader):
        want = _expected(8, 4)[b].float()
        assert torch.equal(t, want.transpose(1, 3))
        assert torch.equal(cl, want) and cl.is_contiguous(memory_format=torch.channels_last)


def test_absurd_slot_bytes_is_clear_error_naming_bytes():
    loader = DataLoader(Images(8), batch_size=4, num_workers=2, slot_bytes=1 << 44)
    with pytest.raises(SharedMemoryError) as e:
        iter(loader)
    message = str(e.value)
    assert str(8 * (1 << 44)) in message or "bytes of shared memory" in message
    assert "num_slots" in message and "more memory" in message
    gc.collect()


@pytest.mark.parametrize(
    "name,value",
    [
        ("slot_bytes", 0),
        ("slot_bytes", -5),
        ("slot_bytes", 1.5),
        ("slot_bytes", True),
        ("num_slots", 0),
        ("num_slots", 10**6),
    ],
)
def test_bad_ring_handover_rejected(name, value):
    with pytest.raises(ValueError, match=name):
        DataLoader(Images(8), batch_size=4, num_workers=2, **{name: value})


def test_namedtuple_and_nested_structure_kept():
    def collate(samples):
        stacked = torch.stack(samples)
        return Pair(
            stacked,
            {
                "ids": [int(s[0, 0, 0]) for s in samples],
                "nested": (stacked[:, 0], {"deep": [stacked.sum()]}),
            },
        )

    loader = DataLoader(
        Images(8),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        collate_fn=collate,
        slot_bytes=SLOT,
    )
    for b, batch in enumerate(loader):
        want = _expected(8, 4)[b]
        assert type(batch) is Pair
        assert torch.equal(batch.image, want)
        assert torch.equal(batch.meta["nested"][0], want[:, 0])
        assert torch.equal(batch.meta["nested"][1]["deep"][0], want.sum())


def test_unpicklable_batch_is_that_batch_error_not_a_dead_worker():
    Local = collections.namedtuple("Local", "x")  # not importable: cannot be pickled

    def collate(samples):
        return Local(torch.stack(samples)), lambda: None

    loader = DataLoader(
        Images(8),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        collate_fn=collate,
    )
    it = iter(loader)
    with pytest.raises(Exception, match="pickle"):
        next(it)
    with pytest.raises(Exception, match="pickle"):
        next(it)  # the worker lived on and answered the next task too


def test_epochs_broken_off_midway_give_every_slot_back():
    loader = DataLoader(
        Images(400), batch_size=4, num_workers=2, slot_bytes=SLOT, persistent_workers=True
    )
    expected = _expected(400, 4)
    for epoch in range(6):
        for i, batch in enumerate(loader):
            assert torch.equal(batch, expected[i])
            if i == epoch:  # leaves tasks and published slots of this epoch behind
                break
    assert [torch.equal(b, e) for b, e in zip(loader, expected)] == [True] * 100
    stats = loader.stats()
    assert stats.ring_full_batches == 0 and stats.slot_batches == stats.batches


def test_non_persistent_iterators_reuse_one_ring():
    loader = DataLoader(Images(40), batch_size=4, num_workers=2, slot_bytes=SLOT)
    for _ in range(3):
        it = iter(loader)
        next(it)
        del it  # shut down with tasks in flight
    ring = loader._ring_handover.spare_ring
    assert ring is not None
    assert [torch.equal(b, e) for b, e in zip(loader, _expected(40, 4))] == [True] * 10
    assert loader._ring_handover.spare_ring is ring
    assert loader.stats().ring_full_batches == 0


@pytest.mark.parametrize(
    "kind", ["plain", "transposed", "conj", "grad", "mixed_dtype", "mixed_shape"]
)
def test_stacking_into_slot_matches_torch_stack(kind):
    from tests.helpers.datasets import Rows

    def run(cls, **kw):
        out = []
        try:
            for batch in cls(Rows(12, kind), batch_size=4, num_workers=2, **kw):
                out.append(batch)
        except Exception as e:  # torch.stack's own error, re-raised from the worker
            forget(e)
            out.append((type(e), str(e).splitlines()[-1]))
        return out

    # (conj: torch's collate in a worker refuses a conjugate first sample, "DispatchKey
    # Conjugate doesn't correspond to a device", and so must a stack into the slot.)
    want = run(torch.utils.data.DataLoader)
    got = run(DataLoader, slot_bytes=SLOT)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        if isinstance(w, tuple):
            assert w == g
        else:
            assert w.dtype == g.dtype and torch.equal(w.resolve_conj(), g.resolve_conj())


def test_dtypes_that_stack_as_any_other_are_dtypes_a_slot_holds():
    """NOTE [slot rules]: fetch="sample" writes a leaf of a plain dtype straight into its row,
    so each of them must be a dtype a slot holds; the slot holds rarer ones too."""
    for dtype in _slot_rules.PLAIN_DTYPES:
        assert _slot_rules.is_slot_tensor(torch.zeros(2, dtype=dtype)), dtype
    assert not _slot_rules.is_slot_tensor(torch.zeros(2, dtype=torch.float32).to_sparse())
    assert not any(
        _slot_rules.collate_may_refuse(torch.zeros(2, dtype=dtype))
        for dtype in _slot_rules.PLAIN_DTYPES
    )
    rare = torch.zeros(2, dtype=torch.float8_e4m3fn)  # torch's collate decides on it first
    assert _slot_rules.is_slot_tensor(rare) and _slot_rules.collate_may_refuse(rare)


def test_shm_limit_env_simulates_small_dev_shm(monkeypatch):
    """A ring of a size the user chose that does not fit is an error (a default one
    shrinks: see test_shm_reserve.py)."""
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", str(100_000))
    loader = DataLoader(Images(64, shape=(3, 32, 32)), batch_size=8, num_workers=2, num_slots=8)
    with pytest.raises(SharedMemoryError) as e:
        list(loader)  # the ring is sized from the first batch, then refused
    message = str(e.value)
    assert "SHMLOADER_SHM_LIMIT=100000" in message and "bytes of shared memory" in message
    monkeypatch.setenv("SHMLOADER_SHM_LIMIT", "lots")
    with pytest.raises(ValueError, match="SHMLOADER_SHM_LIMIT"):
        list(DataLoader(Images(8), batch_size=4, num_workers=2, slot_bytes=SLOT))


def test_fewer_slots_than_in_flight_warns_and_still_delivers():
    with pytest.warns(ShmloaderWarning, match=r"num_slots=2 cannot hold .* = 8 batches"):
        loader = DataLoader(Images(64), batch_size=4, num_workers=4, slot_bytes=SLOT, num_slots=2)
    got = list(iter(loader))
    assert [torch.equal(a, b) for a, b in zip(got, _expected(64, 4))] == [True] * 16


@pytest.mark.parametrize("num_slots,warns", [(5, True), (6, False)])
def test_num_slots_warning_only_below_what_is_in_flight_plus_two(num_slots, warns):
    """2 workers x prefetch_factor 2 = 4 batches in flight, plus the one yielded and the one
    the loop holds: 6 slots are enough, and said to be."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DataLoader(Images(8), batch_size=4, num_workers=2, num_slots=num_slots)
    assert (
        [str(w.message) for w in caught if "num_slots" in str(w.message)] != []
        if warns
        else not caught
    ), [str(w.message) for w in caught]


def test_a_batch_of_exactly_slot_bytes_fits_its_slot():
    data = torch.zeros(4, 8192, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the spill warning
        got = list(DataLoader(data, batch_size=None, num_workers=1, slot_bytes=8192))
    assert len(got) == 4
    with pytest.warns(ShmloaderWarning, match="did not fit its slot"):
        list(
            DataLoader(
                torch.zeros(4, 8193, dtype=torch.uint8),
                batch_size=None,
                num_workers=1,
                slot_bytes=8192,
            )
        )


class _FailsAtEveryFourth(Images):
    def __getitem__(self, i):
        if i % 4 == 3:
            raise ValueError(f"sample {i} is broken")
        return super().__getitem__(i)


class _UnevenStream(torch.utils.data.IterableDataset):
    """Worker 0 yields one image, worker 1 twelve: tasks keep coming to worker 0 after it
    ran out (prefetch_factor 4), and it answers each without a batch."""

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        for i in range(1 if worker.id == 0 else 12):
            yield torch.full((3, 8, 8), i, dtype=torch.uint8)


def _fails_in_worker_1(worker_id):
    if worker_id == 1:
        raise ValueError("worker_init_fn failed in worker 1")


ERROR_PATHS = {
    "sample-raises": dict(dataset=_FailsAtEveryFourth(64), batch_size=2),
    "worker_init_fn-raises": dict(
        dataset=Images(64), batch_size=2, worker_init_fn=_fails_in_worker_1
    ),
    "stream-ran-out": dict(dataset=_UnevenStream(), batch_size=1, prefetch_factor=4),
}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("path", list(ERROR_PATHS))
def test_every_error_path_gives_its_slot_back(path, persistent):
    """A task a worker answers without a batch (its sample raised, its worker_init_fn
    failed, its stream ran out before it came) gives back the slot claimed for it: over
    epochs no slot is lost, so no batch travels by torch's transport for want of one."""
    loader = DataLoader(
        num_workers=2, slot_bytes=SLOT, persistent_workers=persistent, **ERROR_PATHS[path]
    )
    batches = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ring-full warning
        for _ in range(4):
            it = iter(loader)
            while True:
                try:
                    next(it)
                    batches += 1
                except ValueError:
                    continue
                except StopIteration:
                    break
    stats = loader.stats()
    assert stats.ring_full_batches == 0 and stats.slot_batches == batches > 0, stats


def test_no_ring_no_warning_about_its_slots():
    # Too few slots for the batches in flight is said, with workers ...
    with pytest.warns(ShmloaderWarning, match="num_slots=1 cannot hold"):
        DataLoader(Images(8), batch_size=4, num_workers=2, num_slots=1)
    # ... and not without them: num_workers=0 is torch's path, with no ring to be short of.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = DataLoader(Images(8), batch_size=4, num_workers=0, num_slots=1)
        batches = list(loader)
    assert len(batches) == 2 and loader.stats().ring_slots == 0


def _rebuilt(loader):
    """The loader made again from its public attributes, as Lightning re-creates a user's
    DataLoader (to put in a DistributedSampler, say)."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    params = inspect.signature(type(loader).__init__).parameters
    kwargs = {k: v for k, v in attrs.items() if k in params and params[k].default is not v}
    kwargs.update(
        dataset=loader.dataset,
        sampler=loader.sampler,
        shuffle=False,
        batch_sampler=None,
        batch_size=loader.batch_sampler.batch_size,
        drop_last=loader.batch_sampler.drop_last,
    )
    return type(loader)(**kwargs)


def test_loader_rebuilt_from_its_attributes_keeps_every_option():
    options = dict(
        slot_bytes=3 * SLOT,
        num_slots=7,
        fetch="sample",
        assignment="dynamic",
        seed_per_sample=True,
        persistent_workers=True,
        prefetch_next_epoch=True,
    )
    loader = DataLoader(Images(16), batch_size=4, num_workers=2, **options)
    rebuilt = _rebuilt(loader)
    assert {k: getattr(rebuilt, k) for k in options} == options
    got = list(rebuilt)
    assert [torch.equal(a, b) for a, b in zip(got, _expected(16, 4))] == [True] * 4
    stats = rebuilt.stats()
    assert (stats.ring_slots, stats.slot_bytes >= 3 * SLOT) == (7, True)


def test_options_set_after_construction_apply_at_iter():
    """As torch reads its attributes at iter(), so are shmloader's options read and checked
    there (torch lets collate_fn be set at any time)."""
    loader = DataLoader(Images(16), batch_size=4, num_workers=2, fetch="sample")
    loader.collate_fn = lambda batch: batch
    with pytest.raises(ValueError, match="a custom collate_fn needs the whole batch"):
        iter(loader)
    loader = DataLoader(Images(16), batch_size=4, num_workers=2)
    loader.slot_bytes = -1
    with pytest.raises(ValueError, match="slot_bytes should be a positive int"):
        iter(loader)
    loader.slot_bytes, loader.num_slots = SLOT, 9
    got = list(loader)
    assert [torch.equal(a, b) for a, b in zip(got, _expected(16, 4))] == [True] * 4
    assert (loader.stats().ring_slots, loader.stats().slot_bytes >= SLOT) == (9, True)


def test_options_set_between_epochs_of_persistent_workers_apply_at_iter():
    """A persistent loader's options are read and checked at each iter() too: a bad one is
    refused, and a changed ring size starts its workers and ring afresh."""
    loader = DataLoader(
        Images(16),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        slot_bytes=SLOT,
        num_slots=9,
    )
    assert [torch.equal(a, b) for a, b in zip(list(loader), _expected(16, 4))] == [True] * 4
    first_pids = set(loader._iterator._pool.pids)
    loader.fetch = "rows"
    with pytest.raises(ValueError, match="fetch should be 'batch' or 'sample'"):
        iter(loader)
    loader.fetch, loader.num_slots = "sample", 7
    got = list(loader)
    assert [torch.equal(a, b) for a, b in zip(got, _expected(16, 4))] == [True] * 4
    assert loader.stats().ring_slots == 7
    assert first_pids.isdisjoint(loader._iterator._pool.pids)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in first_pids)  # ended and reaped


def test_options_set_to_the_values_they_had_keep_the_persistent_workers():
    """device="cpu" is device=None's CPU batches, and assignment="interleaved" is
    fetch="sample"'s default: setting them changes nothing, so the workers go on."""
    loader = DataLoader(
        Images(16), batch_size=4, num_workers=2, persistent_workers=True, fetch="sample"
    )
    list(loader)
    pids = loader._iterator._pool.pids
    loader.device, loader.assignment = "cpu", "interleaved"
    assert [torch.equal(a, b) for a, b in zip(list(loader), _expected(16, 4))] == [True] * 4
    assert loader._iterator._pool.pids == pids


def test_numpy_integers_are_accepted_as_slot_sizes_and_counts():
    """numpy's integers pass as torch's own integer arguments do (num_workers), become
    Python ints, and numpy's bools are refused as Python's are."""
    loader = DataLoader(
        Images(16),
        batch_size=4,
        num_workers=np.int64(2),
        slot_bytes=np.int64(SLOT),
        num_slots=np.int32(9),
    )
    assert (type(loader.slot_bytes), type(loader.num_slots)) == (int, int)
    got = list(loader)
    assert [torch.equal(a, b) for a, b in zip(got, _expected(16, 4))] == [True] * 4
    assert loader.stats().ring_slots == 9
    for bad in (True, np.True_, 2.0, "9"):
        with pytest.raises(ValueError, match="num_slots should be a positive int"):
            DataLoader(Images(16), batch_size=4, num_workers=2, num_slots=bad)


def test_ring_sizing_counts_the_metadata_of_many_leaves():
    """The first batches size the ring, their metadata included: a batch of thousands of
    small leaves (whose references outweigh their bytes) fits the slot its measure asks for."""
    from shmloader._shm._ring import Ring
    from shmloader._worker._arena import Arena, slot_bytes_needed

    batch = D.many_leaves_collate([(0, None)])
    needed = slot_bytes_needed(batch)
    ring = Ring.create_in("/dev/shm", 1, 8 << 20)
    slot = ring.claim()
    memory = ring.memory(slot)
    arena = Arena(memory, torch.frombuffer(memory, dtype=torch.uint8).untyped_storage())
    meta = _layout.dumps(batch, arena.place_all, 1)
    arena.write_meta(meta)
    assert arena.used <= needed
    ring.abandon(slot)


def test_kept_small_leaves_hold_no_slot(monkeypatch):
    """Labels kept for a metric (the small leaf of each batch) are copies: they hold no
    slot, so the ring keeps delivering (no batch by torch's transport, no warning), and
    once the loader is gone its ring goes, though the labels stay."""
    monkeypatch.setattr(_layout, "SMALL_LEAF_BYTES", SMALL_LEAF_BYTES)
    data = [(torch.full((3, 32, 32), i, dtype=torch.uint8), i) for i in range(64)]
    loader = DataLoader(data, batch_size=8, num_workers=2, slot_bytes=SLOT, num_slots=6)
    labels = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "all ring slots are in use" would fail here
        it = iter(loader)
        for images, y in it:
            start = it._ring.data_address
            assert start <= images.data_ptr() < start + it._ring.data_bytes  # a view
            labels.append(y)
    assert torch.equal(torch.cat(labels), torch.arange(64))
    assert loader.stats().slot_batches == loader.stats().batches == 8
    ring = weakref.ref(loader._ring_handover.spare_ring)
    del loader, it, images, y
    gc.collect()
    assert ring() is None


def test_dropped_batch_gives_its_slot_back_without_the_garbage_collector():
    """Nothing of the decoding keeps a batch alive in a reference cycle: with the garbage
    collector off, a batch's slot is free again as soon as the batch is dropped."""
    loader = DataLoader(
        Images(64),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        slot_bytes=SLOT,
        collate_fn=lambda batch: {"images": torch.stack(batch)},
    )
    gc.disable()
    try:
        for batch in loader:
            assert batch["images"].shape == (4, 3, 8, 8)
    finally:
        gc.enable()
    stats = loader.stats()
    assert (stats.ring_full_batches, stats.slot_batches) == (0, 16)

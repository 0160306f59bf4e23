"""loader.stats(): counts after runs whose counts are known in advance.  No timing assertion:
times are only checked to be consistent (non-negative, wait <= wall, fraction in [0, 1])."""

import functools
import gc
import os
import time
import warnings

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader, LoaderStats
from tests.helpers import datasets as D
from tests.helpers.datasets import Images

# Tests whose datasets or collate functions are defined in the test (local):
# they reach workers only by fork, whatever the default start method.
LOCAL_OBJECTS = "fork"

# Slots held by batches are what these tests are about: small leaves stay views.
pytestmark = pytest.mark.usefixtures("views_only")

P = functools.partial
SLOT = 1 << 16  # holds any batch below: a ring from the start, every batch through it


def consistent(stats):
    """What must hold of any snapshot."""
    assert isinstance(stats, LoaderStats)
    assert stats.wait_seconds >= 0 and stats.wall_seconds >= 0
    assert stats.wait_seconds <= stats.wall_seconds + 1e-6
    assert 0.0 <= stats.wait_fraction <= 1.0
    assert (
        stats.slot_batches + stats.unsized_batches + stats.ring_full_batches + stats.spilled_batches
    ) == stats.batches, stats
    assert 0 <= stats.occupancy_max <= stats.ring_slots
    assert 0 <= stats.occupancy_mean <= stats.occupancy_max
    assert stats.bytes_moved == sum(w.bytes for w in stats.workers)
    for w in stats.workers:
        assert w.busy_seconds >= 0 and w.samples >= 0 and w.bytes >= 0


def run_epochs(loader, epochs=1, keep=False):
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for batch in loader:
                if keep:
                    kept.append(batch)
    return kept


def test_fresh_loader_is_all_zero():
    loader = DataLoader(Images(8), batch_size=4, num_workers=2)
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.slot_batches, stats.prefetched_epochs) == (
        0,
        0,
        0,
        0,
    )
    assert stats.wait_fraction == 0.0 and stats.bytes_moved == 0 and stats.workers == ()
    assert "0 batches" in str(stats)


@pytest.mark.parametrize("drop_last, samples, batches", [(False, 30, 8), (True, 28, 7)])
def test_batch_mode_counts(drop_last, samples, batches):
    """30 samples in batches of 4: 8 batches with a partial last one (30 samples), or 7 (28)."""
    loader = DataLoader(
        Images(30), batch_size=4, num_workers=2, slot_bytes=SLOT, drop_last=drop_last
    )
    run_epochs(loader)
    stats = loader.stats()
    consistent(stats)
    assert (stats.batches, stats.samples) == (batches, samples)
    assert stats.slot_batches == batches
    assert (stats.unsized_batches, stats.ring_full_batches, stats.spilled_batches) == (0, 0, 0)
    assert stats.fallback_leaves == 0 and stats.prefetched_epochs == 0
    assert len(stats.workers) == 2
    # round robin: worker 0 has batches 0, 2, 4, 6 (16 samples), worker 1 the rest
    assert [w.samples for w in stats.workers] == [16, samples - 16]
    assert all(w.bytes > 0 for w in stats.workers)
    assert stats.bytes_moved >= samples * 3 * 8 * 8  # at least the images' own bytes
    assert stats.ring_slots > 0 and stats.slot_bytes >= SLOT
    assert 1 <= stats.occupancy_max


@pytest.mark.parametrize("num_workers", [2, 3])
def test_sample_mode_interleaved_counts(num_workers):
    """fetch="sample", "interleaved": the sample at position p is worker p % num_workers's."""
    loader = DataLoader(
        Images(30), batch_size=4, num_workers=num_workers, fetch="sample", assignment="interleaved"
    )
    run_epochs(loader)
    stats = loader.stats()
    consistent(stats)
    assert (stats.batches, stats.samples, stats.slot_batches) == (8, 30, 8)
    assert [w.samples for w in stats.workers] == [
        len(range(i, 30, num_workers)) for i in range(num_workers)
    ]
    assert stats.bytes_moved == 30 * 3 * 8 * 8  # each sample's row, once


def test_sample_mode_dynamic_counts():
    loader = DataLoader(
        Images(30),
        batch_size=4,
        num_workers=3,
        fetch="sample",
        assignment="dynamic",
        drop_last=True,
    )
    run_epochs(loader)
    stats = loader.stats()
    consistent(stats)
    assert (stats.batches, stats.samples, stats.slot_batches) == (7, 28, 7)
    assert sum(w.samples for w in stats.workers) == 28
    assert len(stats.workers) == 3


def test_slot_size_learned_counts_every_sample():
    """Without slot_bytes the first batches go by torch's transport until the ring is sized: they
    are counted as unsized, and their samples still count for their workers."""
    loader = DataLoader(Images(30), batch_size=4, num_workers=2)
    run_epochs(loader)
    stats = loader.stats()
    consistent(stats)
    assert (stats.batches, stats.samples) == (8, 30)
    assert stats.unsized_batches >= 1 and stats.slot_batches + stats.unsized_batches == 8
    assert sum(w.samples for w in stats.workers) == 30
    assert [w.samples for w in stats.workers] == [16, 14]


@pytest.mark.parametrize("fetch", ["batch", "sample"])
def test_ring_full_counted_when_user_holds_every_slot(fetch):
    """list(loader) keeps every batch: once all slots are held the rest go by torch's
    transport, counted as ring_full; occupancy reaches the whole ring."""
    loader = DataLoader(Images(80), batch_size=4, num_workers=2, slot_bytes=SLOT, fetch=fetch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(loader)
    stats = loader.stats()
    consistent(stats)
    assert stats.batches == len(kept) == 20 and stats.samples == 80
    assert stats.ring_full_batches > 0
    assert stats.slot_batches + stats.ring_full_batches == 20
    assert stats.occupancy_max == stats.ring_slots
    assert sum("ring slots are in use" in str(w.message) for w in caught) == 1
    assert sum(w.samples for w in stats.workers) == 80
    assert f"{stats.ring_full_batches} ring full" in str(stats)


def test_no_ring_full_when_batches_are_dropped():
    loader = DataLoader(Images(80), batch_size=4, num_workers=2, slot_bytes=SLOT, fetch="sample")
    run_epochs(loader)
    stats = loader.stats()
    assert stats.ring_full_batches == 0 and stats.slot_batches == 20


def test_spills_counted_batch_mode():
    """batch_size=None, samples growing from 256 B to 64 KiB, 4 KiB slots: the big ones spill
    (delivered whole by torch's transport), the small ones use the ring."""

    class Growing(tud.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.full((2 ** (i + 8),), i % 251, dtype=torch.uint8)

    loader = DataLoader(
        Growing(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        slot_bytes=4096,
    )
    got = run_epochs(loader, keep=False)
    del got
    stats = loader.stats()
    consistent(stats)
    assert stats.batches == 10 and stats.samples == 10
    assert stats.spilled_batches >= 1 and stats.slot_batches >= 1
    assert stats.spilled_batches + stats.slot_batches == 10
    assert f"{stats.spilled_batches} spilled" in str(stats)
    assert stats.bytes_moved >= sum(2 ** (i + 8) for i in range(10))  # spilled ones included


@pytest.mark.parametrize("slot_bytes", [None, 1000])
def test_bytes_moved_counts_the_tensors_torchs_transport_shares(slot_bytes):
    """Batches before the ring is sized (slot_bytes=None) or spilled (every one, with
    1000-byte slots) go by torch's transport: their tensors' bytes count as moved too."""
    dataset = [torch.full((3, 64, 64), float(i)) for i in range(64)]
    loader = DataLoader(
        dataset, batch_size=8, num_workers=2, persistent_workers=True, slot_bytes=slot_bytes
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # the work before the ring counts once the workers have it
            run_epochs(loader, keep=False)
    stats = loader.stats()
    consistent(stats)
    assert stats.slot_batches < stats.batches == 16
    assert stats.bytes_moved >= 2 * 64 * 3 * 64 * 64 * 4, stats.bytes_moved


def test_spills_counted_sample_mode():
    """fetch="sample": the first batch (2 samples of 12 KiB) fixes rows for 2 samples; batches
    of 6 do not fit a slot and spill whole."""
    make = P(Images, 24, shape=(3, 32, 128))
    loader = DataLoader(
        make(), batch_sampler=D.VaryingBatchSampler(24, [2, 6]), num_workers=2, fetch="sample"
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = [b.clone() for b in loader]
    want = list(tud.DataLoader(make(), batch_sampler=D.VaryingBatchSampler(24, [2, 6])))
    assert [torch.equal(a, b) for a, b in zip(got, want, strict=True)] == [True] * 6
    stats = loader.stats()
    consistent(stats)
    assert stats.batches == 6 and stats.samples == 24
    assert stats.spilled_batches == 3 and stats.slot_batches == 3


def test_counts_add_up_over_epochs_and_iterators():
    """Persistent workers over 2 epochs, then a non-persistent loader over 2 iterators: the
    snapshot covers all of a loader's iterators."""
    persistent = DataLoader(
        Images(30), batch_size=4, num_workers=2, slot_bytes=SLOT, persistent_workers=True
    )
    run_epochs(persistent, epochs=2)
    stats = persistent.stats()
    consistent(stats)
    assert (stats.batches, stats.samples, stats.slot_batches) == (16, 60, 16)
    assert [w.samples for w in stats.workers] == [32, 28]

    fresh = DataLoader(Images(30), batch_size=4, num_workers=2, fetch="sample")
    run_epochs(fresh, epochs=2)
    stats = fresh.stats()
    consistent(stats)
    assert (stats.batches, stats.samples, stats.slot_batches) == (16, 60, 16)
    assert sum(w.samples for w in stats.workers) == 60


def test_snapshot_does_not_change_afterwards():
    loader = DataLoader(
        Images(16), batch_size=4, num_workers=2, slot_bytes=SLOT, persistent_workers=True
    )
    run_epochs(loader)
    first = loader.stats()
    run_epochs(loader)
    assert (first.batches, first.samples) == (4, 16)
    assert (loader.stats().batches, loader.stats().samples) == (8, 32)


def test_broken_off_epoch_counts_only_yielded_batches():
    loader = DataLoader(Images(40), batch_size=4, num_workers=2, slot_bytes=SLOT)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    gc.collect()
    stats = loader.stats()
    consistent(stats)
    assert (stats.batches, stats.samples) == (3, 12)


class _SlowFailing(tud.Dataset):
    """Samples 2 and 3 fail, 1 s after a byte comes on the pipe `gate` (inherited by the
    forked workers): the second batch is a long wait ending in an error."""

    def __init__(self, gate):
        self.gate = gate

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i >= 2:
            os.read(self.gate, 1)
            time.sleep(1.0)
            raise ValueError("bad sample")
        return torch.tensor([i])


@pytest.mark.slow
def test_wait_for_a_failed_batch_counts_in_wall_time():
    """The wait for a batch that raises is part of the loop's wall time as well as of the
    wait: the fraction stays a fraction."""
    gate, go = os.pipe()
    try:
        # (A ring from the start: the loop does nothing but wait between its byte and the error.)
        loader = DataLoader(
            _SlowFailing(gate),
            batch_size=2,
            num_workers=2,
            slot_bytes=SLOT,
            multiprocessing_context="fork",
        )  # (the workers inherit `gate`)
        with pytest.raises(ValueError, match="bad sample"):
            for _ in loader:
                os.write(go, b"x")  # batch 0 taken: batch 1's second starts as the loop waits
        stats = loader.stats()
    finally:
        os.close(gate)
        os.close(go)
    assert stats.wait_seconds > 0.2
    assert stats.wait_seconds <= stats.wall_seconds and stats.wait_fraction <= 1


def test_num_workers_0_counts_nothing():
    """num_workers=0 is torch's own path: no ring, no worker counts."""
    loader = DataLoader(Images(8), batch_size=4)
    run_epochs(loader)
    stats = loader.stats()
    assert (stats.batches, stats.samples, stats.ring_slots) == (0, 0, 0) and stats.workers == ()


def test_fallback_leaves_counted():
    def collate(samples):
        dense = torch.stack(samples)
        return {"dense": dense, "sparse": dense.float().to_sparse()}

    loader = DataLoader(
        Images(12),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=LOCAL_OBJECTS,
        slot_bytes=SLOT,
        collate_fn=collate,
    )
    run_epochs(loader)
    stats = loader.stats()
    consistent(stats)
    assert stats.fallback_leaves == 3 and stats.batches == 3


def test_str_has_the_key_figures():
    loader = DataLoader(Images(30), batch_size=4, num_workers=2, fetch="sample")
    run_epochs(loader)
    stats = loader.stats()
    text = str(stats)
    assert "8 batches" in text and "30 samples" in text
    assert f"{stats.ring_slots} x {stats.slot_bytes}" in text
    assert "worker 0" in text and "worker 1" in text and "worker 2" not in text
    assert "15 samples" in text  # each worker's share
    assert "prefetched" in text and "spilled" in text and "ring full" in text
    assert f"{stats.wait_fraction:.0%}" in text
    assert len(text.splitlines()) >= 3 + len(stats.workers)

"""_rebuild.torch_arguments: a loader made again from a torch DataLoader's attributes
(as the integrations make shmloader's in place of the torch loader a framework built)
yields exactly what the torch loader yields, for every way torch's batching is given."""

import pytest
import torch
import torch.utils.data as tud

from shmloader import DataLoader
from shmloader._features._rebuild import options, torch_arguments
from tests.helpers import datasets as D

CASES = {
    "shuffle, generator": lambda: dict(
        dataset=D.IndexMap(21),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
    ),
    "drop_last, custom collate": lambda: dict(
        dataset=D.IndexMap(21), batch_size=4, drop_last=True, collate_fn=D.numpy_collate
    ),
    "batch_sampler": lambda: dict(dataset=D.IndexMap(12), batch_sampler=D.ChunkBatchSampler(12)),
    "batch_size=None": lambda: dict(dataset=D.IndexMap(5), batch_size=None),
    "IterableDataset": lambda: dict(dataset=D.ShardedIterable(11), batch_size=3, drop_last=True),
    "in_order=False, persistent, prefetch": lambda: dict(
        dataset=D.IndexMap(16),
        batch_size=2,
        in_order=False,
        persistent_workers=True,
        prefetch_factor=3,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_rebuilt_loader_yields_the_torch_loaders_batches(case):
    def epochs(loader):
        torch.manual_seed(0)
        return [list(loader) for _ in range(2)]

    original = tud.DataLoader(**CASES[case](), num_workers=2)
    expected = epochs(original)
    rebuilt = DataLoader(**torch_arguments(tud.DataLoader(**CASES[case](), num_workers=2)))
    got = epochs(rebuilt)
    if original.in_order:
        D.assert_same(got, expected)
    else:  # arrival order depends on timing
        assert [sorted(map(repr, epoch)) for epoch in got] == [
            sorted(map(repr, epoch)) for epoch in expected
        ]
    assert rebuilt.stats().batches == sum(map(len, got))
    for name in ("batch_size", "drop_last", "prefetch_factor", "persistent_workers", "in_order"):
        assert getattr(rebuilt, name) == getattr(original, name), name


def test_options_are_shmloaders_own():
    loader = DataLoader(D.IndexMap(4), num_workers=2, num_slots=7, seed_per_sample=True)
    assert options(loader) == {
        "slot_bytes": None,
        "num_slots": 7,
        "fetch": "batch",
        "assignment": None,
        "seed_per_sample": True,
        "prefetch_next_epoch": False,
        "device": None,
    }
    assert options(tud.DataLoader(D.IndexMap(4))) == {}

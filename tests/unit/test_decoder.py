"""The batch decoder (shmloader/_shm/_layout.py, NOTE [layout: one batch's
decoding]): a structure seen before is built again without unpickling, and
must give exactly what unpickling gives; a leaf's capsule holds its slot."""

import gc
from collections import namedtuple

import pytest
import torch
from torch.utils._pytree import tree_leaves

from shmloader._shm import _layout, _ring
from shmloader._shm._ring import Ring
from tests.helpers.datasets import assert_same

SLOT_BYTES = 1 << 16


@pytest.fixture
def lease_of():
    """lease_of(data): a lease of a fresh one-slot ring, `data` placed in it
    as the worker's arena places a batch's leaves; returns (lease, meta for
    the batch and worker state given)."""
    rings = []

    def make(batch, state=None):
        ring = Ring.create_in("/dev/shm", 1, SLOT_BYTES)
        rings.append(ring)
        slot = ring.claim()
        memory = ring.memory(slot)
        offset = 0

        def place_all(leaves):
            nonlocal offset
            refs = []
            for leaf in leaves:
                leaf = leaf.contiguous()
                nbytes = leaf.numel() * leaf.element_size()
                memory.write(offset, leaf.view(torch.uint8).reshape(-1).numpy().tobytes())
                refs.append(
                    _layout.tensor_ref(
                        offset, leaf.dtype, leaf.shape, leaf.stride(), leaf.requires_grad, None
                    )
                )
                offset += (nbytes + 63) // 64 * 64
            return refs

        meta = _layout.dumps(batch, place_all, 1, state)
        ring.publish(slot, 1, 0, 0)
        return ring.acquire(), meta

    yield make
    gc.collect()


def _same(a, b):
    """assert_same, the strides of every tensor too (a plan must keep them)."""
    assert_same(a, b)
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        if isinstance(x, torch.Tensor):
            assert x.stride() == y.stride()


def _batch(value):
    images = torch.full((4, 3, 8, 8), value, dtype=torch.uint8)
    return {
        "image": images,
        "label": torch.arange(4) + value,
        "meta": [value % 7, "name", None, 2.5],
        "pair": (torch.full((2,), value, dtype=torch.bfloat16), True),
    }


def test_a_repeated_structure_is_built_again_exactly(lease_of):
    """Three batches of one structure through one decoder: the second and third
    are built from the first's plan, and equal what unpickling each alone gives,
    their own values, worker state and fresh containers included."""
    decoder = _layout.Decoder()
    results = []
    for value in (1, 2, 3):
        lease, meta = lease_of(_batch(value), state=f"state {value}".encode())
        got = decoder.loads(meta, lease)
        alone = _layout.loads(meta, lease)
        _same(got[0], _batch(value))
        _same(got[0], alone[0])
        assert got[1:] == alone[1:] == (0, 1, f"state {value}".encode())
        results.append(got[0])
    assert decoder._known is not None  # (the plan was kept: the path under test ran)
    # Containers are each batch's own: changing one batch's list leaves the next's.
    results[1]["meta"].append("mine")
    assert results[2]["meta"] == [3, "name", None, 2.5]
    assert results[1]["image"].data_ptr() != results[2]["image"].data_ptr()


def test_a_leaf_met_twice_is_one_object_in_a_rebuilt_batch(lease_of):
    decoder = _layout.Decoder()
    for value in (1, 2):
        shared = torch.full((3,), value)
        lease, meta = lease_of([shared, {"again": shared}])
        batch, *_ = decoder.loads(meta, lease)
        assert batch[0] is batch[1]["again"]
        assert batch[0].tolist() == [value] * 3


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "batch",
    [
        Point(torch.ones(2), torch.zeros(2)),  # not a plain container: unpickled each time
        [torch.ones(2, dtype=torch.uint16)],  # not a DLPack dtype every torch takes
        [torch.ones(2, requires_grad=True)],
    ],
    ids=["namedtuple", "uint16", "requires-grad"],
)
def test_a_structure_without_a_plan_is_unpickled_every_time(lease_of, batch):
    decoder = _layout.Decoder()
    for _ in range(2):
        lease, meta = lease_of(batch)
        got, *_ = decoder.loads(meta, lease)
        _same(got, _layout.loads(meta, lease)[0])
        assert decoder._known is None


def test_another_structure_after_a_known_one_is_decoded_as_itself(lease_of):
    decoder = _layout.Decoder()
    for batch in (_batch(1), [torch.ones(5)], _batch(2)):
        lease, meta = lease_of(batch)
        _same(decoder.loads(meta, lease)[0], batch)


def test_small_leaves_copied_or_viewed_as_asked_on_a_known_structure(lease_of):
    """copy_small is part of what the plan was made for: a pinned ring asks
    for views where another source asks for copies."""
    decoder = _layout.Decoder()
    for copy_small in (True, True, False, True):
        lease, meta = lease_of([torch.arange(4)])
        (leaf,), *_ = decoder.loads(meta, lease, copy_small)
        start = lease.ring.data_address
        inside = start <= leaf.data_ptr() < start + lease.ring.data_bytes
        assert inside == (not copy_small)
        assert leaf.tolist() == [0, 1, 2, 3]


def test_a_view_keeps_its_slot_until_torch_frees_it(lease_of):
    lease, meta = lease_of([torch.ones(SLOT_BYTES // 2, dtype=torch.uint8)])  # (a view: not small)
    ring, slot = lease.ring, lease.slot
    (view,), *_ = _layout.loads(meta, lease)
    del lease
    gc.collect()
    assert ring.slot_state(slot) == _ring.READING
    storage = view.untyped_storage()
    del view
    gc.collect()
    assert ring.slot_state(slot) == _ring.READING  # (the storage still holds it)
    del storage
    gc.collect()
    assert ring.slot_state(slot) == _ring.FREE


def test_a_capsule_torch_never_took_gives_its_slot_back(lease_of):
    lease, _ = lease_of([torch.ones(8)])
    ring, slot = lease.ring, lease.slot
    capsule = lease.leaf_capsule(0, 32, 2, 32, (8,), (1,), False)
    del lease
    gc.collect()
    assert ring.slot_state(slot) == _ring.READING
    del capsule
    gc.collect()
    assert ring.slot_state(slot) == _ring.FREE


@pytest.mark.parametrize(
    "args, error",
    [
        ((SLOT_BYTES - 8, 16, 2, 32, (4,), (1,), False), "outside slot"),
        ((0, 16, 2, 32, (4,), (1, 1), False), "differ in length"),
        ((0, 16, 2, 32, (-4,), (1,), False), None),  # (the caller's check; no wild read)
    ],
    ids=["past-the-slot", "strides", "negative"],
)
def test_leaf_capsule_checks_its_bytes(lease_of, args, error):
    lease, _ = lease_of([torch.ones(8)])
    if error is None:
        with pytest.raises(Exception):  # noqa: B017 - torch refuses a negative size
            torch._C._from_dlpack(lease.leaf_capsule(*args))
    else:
        with pytest.raises(ValueError, match=error):
            lease.leaf_capsule(*args)


def test_a_reference_reaching_past_its_bytes_is_refused(lease_of):
    """The plan's references are checked as unpickling checks them: shape and
    strides within the leaf's span, non-negative."""
    lease, _ = lease_of([torch.ones(8)])
    for shape, stride in [((8,), (2,)), ((2, -1), (1, 1))]:
        meta = _layout.dumps(
            [torch.ones(8)],
            lambda leaves, shape=shape, stride=stride: [
                ("t", 0, torch.float32, shape, stride, 8, False, None)
            ],
            1,
        )
        with pytest.raises(_layout.pickle.UnpicklingError, match="does not fit"):
            _layout.Decoder().loads(meta, lease)

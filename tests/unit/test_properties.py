"""Property tests (hypothesis).

(a) Random nested batch structures through shmloader.DataLoader and torch's DataLoader:
    dicts, tuples, lists and namedtuples of tensors of every dtype (0-dim, empty, transposed,
    sliced, expanded), numpy arrays and scalars, ints, floats (NaN, inf, -0.0), strings, bytes
    and None, from a dataset whose samples are a pure function of (seed, index).  Batched by a
    custom collate_fn (identity, or a dict around the list) and by the default collate where
    the structure is collatable.  shmloader's output must equal torch's exactly
    (tests.helpers.datasets.assert_same: type, dtype, shape, bit-identical values, structure).

(b) The slot-metadata decoder (_layout.loads) fed corrupted metadata: real metadata written
    by _layout.dumps over an Arena in a real ring slot, then bytes flipped, inserted, deleted
    or truncated, slot references rewritten with out-of-range offsets, shapes, strides,
    counts and odd dtypes, or replaced by arbitrary objects.  Decoding must return or raise
    an ordinary Exception; it must never crash the process, and every tensor or array it
    returns must lie inside the slot.  Each example's cases are decoded in a forked child, so
    a segfault is a test failure naming the case, not the end of pytest.

    The three holes this fuzzer found in the decoder (DECODER_BUGS) are recognised by name
    in what loads() returns, fail the run like any new finding, and each keeps a minimal
    regression test at the end.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import math
import os
import pickle
import resource
import select
import signal
import time
import traceback

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from shmloader import DataLoader as ShmDataLoader
from shmloader._shm import _layout
from shmloader._shm._ring import Ring
from shmloader._worker._arena import Arena
from tests.helpers import datasets as D
from tests.helpers.procs import rearm_hang_guard

# Module-level so that batches pickle (torch's transport, spawn) by reference.
NT1 = collections.namedtuple("NT1", ["a"])
NT2 = collections.namedtuple("NT2", ["a", "b"])
NT3 = collections.namedtuple("NT3", ["a", "b", "c"])
NAMEDTUPLES = {1: NT1, 2: NT2, 3: NT3}

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in TORCH_DTYPES}
NP_DTYPES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e308]


# =========================================================================== (a) structures
# A spec is a plain, hashable description of a sample's structure; build(spec, seed, index)
# turns it into the sample.  Values depend on (seed, index, leaf number) only.


def _shapes(max_dims=3):
    return st.lists(st.integers(0, 4), min_size=0, max_size=max_dims).map(tuple)


def _tensor_leaf(collatable, shapes=None):
    variants = ["contig", "transpose", "slice", "expand"]
    rg = st.just(False) if collatable else st.booleans()
    return st.tuples(
        st.just("tensor"),
        st.sampled_from(sorted(DTYPE_BY_NAME)),
        _shapes() if shapes is None else shapes,
        st.sampled_from(variants),
        rg,
    )


def _ndarray_leaf(shapes=None):
    return st.tuples(
        st.just("ndarray"),
        st.sampled_from(NP_DTYPES),
        _shapes() if shapes is None else shapes,
        st.sampled_from(["contig", "transpose", "slice"]),
    )


def _scalar_leaves(collatable):
    floats = st.one_of(
        st.sampled_from(SPECIAL_FLOATS), st.floats(allow_nan=True, allow_infinity=True, width=64)
    )
    # collatable: + index must stay an int64 (default_collate makes a tensor of them)
    ints = st.integers(-(2**62), 2**62) if collatable else st.integers(-(2**70), 2**70)
    leaves = [
        st.tuples(st.just("int"), ints),
        st.tuples(st.just("float"), floats),
        st.tuples(st.just("bool"), st.booleans()),
        st.tuples(st.just("str"), st.text(max_size=4)),
        st.tuples(st.just("bytes"), st.binary(max_size=4)),
        st.tuples(st.just("npscalar"), st.sampled_from(NP_DTYPES)),
    ]
    if not collatable:
        leaves.append(st.just(("none",)))
    return st.one_of(*leaves)


def spec_strategy(collatable: bool):
    leaf = st.one_of(
        _tensor_leaf(collatable),
        _tensor_leaf(collatable),
        _ndarray_leaf(),
        _scalar_leaves(collatable),
    )

    def extend(child):
        keys = st.text(alphabet="abcxyz", min_size=1, max_size=3)
        return st.one_of(
            st.lists(st.tuples(keys, child), max_size=3, unique_by=lambda kv: kv[0]).map(
                lambda items: ("dict", tuple(items))
            ),
            st.lists(child, max_size=3).map(lambda xs: ("tuple", tuple(xs))),
            st.lists(child, max_size=3).map(lambda xs: ("list", tuple(xs))),
            st.integers(1, 3).flatmap(
                lambda k: st.tuples(st.just("nt"), st.just(k), st.tuples(*[child] * k))
            ),
        )

    tree = st.recursive(leaf, extend, max_leaves=8)
    # Most samples also carry a few non-empty tensors and an array of random dtypes and
    # layouts next to the drawn tree, so that every example moves real bytes.
    nonempty = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
    payload = st.tuples(
        tree,
        _tensor_leaf(collatable, nonempty),
        _tensor_leaf(collatable, nonempty),
        _ndarray_leaf(nonempty),
    )
    return st.one_of(payload.map(lambda xs: ("tuple", xs)), tree)


def _fill(rng, dtype_name, shape):
    """A numpy array of `shape` with values of `dtype_name` (including NaN, inf, -0.0 and
    the dtype's extremes); bfloat16 is drawn as float32 and converted by the caller."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return _fill_values(rng, dtype_name, shape)


def _fill_values(rng, dtype_name, shape):
    n = int(np.prod(shape, dtype=np.int64))
    if dtype_name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype_name in ("uint8", "int8", "int16", "int32", "int64"):
        info = np.iinfo(dtype_name)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype_name, endpoint=True)
    base = "float32" if dtype_name == "bfloat16" else dtype_name
    real = np.dtype(base).type(0).real.dtype
    vals = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(real)
    specials = np.array(SPECIAL_FLOATS, dtype=np.float64).astype(real)
    mask = rng.random(n) < 0.2
    vals[mask] = specials[rng.integers(0, len(specials), size=int(mask.sum()))]
    if np.dtype(base).kind == "c":
        imag = rng.standard_normal(n).astype(real)
        imag[rng.random(n) < 0.1] = np.nan
        vals = vals + 1j * imag
        vals = vals.astype(base)
    return vals.reshape(shape).astype(base)


def _make_tensor(rng, dtype_name, shape, variant, requires_grad):
    if variant == "transpose" and len(shape) >= 2:
        base_shape = (shape[1], shape[0], *shape[2:])
    elif variant == "slice" and len(shape) >= 1:
        base_shape = (2 * shape[0] + 1, *shape[1:])
    elif variant == "expand" and len(shape) >= 1:
        base_shape = (1, *shape[1:])
    else:
        base_shape = shape
        variant = "contig"
    arr = _fill(rng, dtype_name, base_shape)
    t = torch.from_numpy(arr.copy(order="C"))
    if dtype_name == "bfloat16":
        t = t.to(torch.bfloat16)
    if variant == "transpose":
        t = t.transpose(0, 1)
    elif variant == "slice":
        t = t[1::2]
    elif variant == "expand":
        t = t.expand(*shape)
    assert tuple(t.shape) == tuple(shape), (t.shape, shape)
    if requires_grad and (t.is_floating_point() or t.is_complex()):
        t = t.detach().requires_grad_(True)  # a leaf with the view's strides
    return t


def _make_ndarray(rng, dtype_name, shape, variant):
    if variant == "transpose" and len(shape) >= 2:
        return _fill(rng, dtype_name, (shape[1], shape[0], *shape[2:])).swapaxes(0, 1)
    if variant == "slice" and len(shape) >= 1:
        return _fill(rng, dtype_name, (2 * shape[0] + 1, *shape[1:]))[1::2]
    return _fill(rng, dtype_name, shape)


def build(spec, seed, index):
    counter = [0]

    def rng():
        counter[0] += 1
        return np.random.default_rng([seed, index, counter[0]])

    def go(s):
        kind = s[0]
        if kind == "tensor":
            return _make_tensor(rng(), *s[1:])
        if kind == "ndarray":
            return _make_ndarray(rng(), *s[1:])
        if kind == "npscalar":
            return _fill(rng(), s[1], (1,))[0]
        if kind == "int":
            return s[1] + index
        if kind == "float":
            return s[1] if index % 2 == 0 or not math.isfinite(s[1]) else s[1] / (index + 1)
        if kind == "bool":
            return s[1] ^ bool(index % 2)
        if kind == "str":
            return f"{s[1]}{index}"
        if kind == "bytes":
            return s[1] + bytes([index % 256])
        if kind == "none":
            return None
        if kind == "dict":
            return {k: go(v) for k, v in s[1]}
        if kind == "tuple":
            return tuple(go(v) for v in s[1])
        if kind == "list":
            return [go(v) for v in s[1]]
        if kind == "nt":
            return NAMEDTUPLES[s[1]](*(go(v) for v in s[2]))
        raise AssertionError(f"unknown spec {s!r}")

    return go(spec)


class SpecMap(tud.Dataset):
    """Sample i is build(spec, seed, i): deterministic, the same in every process."""

    def __init__(self, spec, seed, n):
        self.spec, self.seed, self.n = spec, seed, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return build(self.spec, self.seed, i)


def wrap_collate(batch):
    """A custom collate_fn that keeps the samples as they are, inside a small dict."""
    return {"samples": tuple(batch), "n": len(batch), "none": None, "tag": NT2("w", len(batch))}


COLLATES = {"identity": D.identity_collate, "wrap": wrap_collate}

# Workers beyond the 2 CPUs of the test machines are the point here, not a mistake.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@contextlib.contextmanager
def _tensor_bits_for_any_strides():
    """tests/helpers/datasets.py's _tensor_bits raises RuntimeError ("self.stride(-1) must be 1 to
    view ... as Byte") for tensors that torch calls contiguous although their last stride is
    not 1: empty tensors with a zero stride (torch.from_numpy(np.zeros(0, "f4")), stride
    (0,)) and tensors with size-1 dimensions (torch.zeros(3)[1::2], shape (1,), stride (2,)),
    since .contiguous() then leaves them as they are.  Until the helper handles them, its
    input is first copied into a tensor of standard strides (same dtype, shape, values);
    everything else is the shared helper's."""
    original = D._tensor_bits

    def bits(t):
        t = t.detach()
        return original(torch.empty(t.shape, dtype=t.dtype).copy_(t))

    D._tensor_bits = bits
    try:
        yield
    finally:
        D._tensor_bits = original


# Mostly slots that hold every batch (so that batches come through the ring), also slots
# sized by the loader from its first batches, and slots too small (spills).
SLOT_CHOICES = [1 << 20, 1 << 20, None, 4096]


def _both(spec, seed, n, batch_size, num_workers, collate_fn, slot_bytes):
    rearm_hang_guard()  # per example: 100 of them take minutes on a loaded machine
    ds = SpecMap(spec, seed, n)
    kw = {
        "batch_size": batch_size,
        "num_workers": num_workers,
        "collate_fn": collate_fn,
        "multiprocessing_context": "fork",
    }
    t_out = list(tud.DataLoader(ds, **kw))
    loader = ShmDataLoader(ds, slot_bytes=slot_bytes, **kw)
    s_out = list(loader)
    stats = loader.stats()
    del loader
    assert len(t_out) == len(s_out), f"torch yielded {len(t_out)} batches, shm {len(s_out)}"
    with _tensor_bits_for_any_strides():
        for b, (x, y) in enumerate(zip(t_out, s_out, strict=True)):
            D.assert_same(x, y, f"batch{b}")
    assert stats.batches == len(s_out)
    assert (
        stats.slot_batches + stats.unsized_batches + stats.ring_full_batches + stats.spilled_batches
    ) == stats.batches, stats
    if slot_bytes == 1 << 20:
        assert stats.slot_batches >= 1, f"no batch went through the ring: {stats}"
    event(f"slot_bytes={slot_bytes}: {stats.slot_batches}/{stats.batches} batches via the ring")


SETTINGS_A = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


@settings(max_examples=100, **SETTINGS_A)
@given(
    spec=spec_strategy(collatable=False),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 12),
    batch_size=st.integers(1, 5),
    num_workers=st.integers(1, 3),
    collate=st.sampled_from(sorted(COLLATES)),
    slot_bytes=st.sampled_from(SLOT_CHOICES),
)
@pytest.mark.slow
def test_custom_collate_matches_torch(spec, seed, n, batch_size, num_workers, collate, slot_bytes):
    _both(spec, seed, n, batch_size, num_workers, COLLATES[collate], slot_bytes)


@settings(max_examples=100, **SETTINGS_A)
@given(
    spec=spec_strategy(collatable=True),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 12),
    batch_size=st.integers(1, 5),
    num_workers=st.integers(1, 3),
    slot_bytes=st.sampled_from(SLOT_CHOICES),
)
@pytest.mark.slow
def test_default_collate_matches_torch(spec, seed, n, batch_size, num_workers, slot_bytes):
    _both(spec, seed, n, batch_size, num_workers, None, slot_bytes)


# =========================================================================== (b) decoder fuzz
FUZZ_SLOT_BYTES = 1 << 20
# More examples for a longer hunt: see tests/conftest.py.
FUZZ_EXAMPLES = int(os.environ.get("SHMLOADER_FUZZ_EXAMPLES", "300"))
CHILD_TIMEOUT_S = 60
CHILD_MEMORY_HEADROOM = 2 << 30  # a decoded garbage shape may ask for any amount of memory

# Decoder bugs found (and fixed), recognised from what loads() returned (not from the
# input, so that byte flips that lead to the same bug are recognised too).
DECODER_BUGS = {
    "K1-object-ndarray": "an 'n' reference with an object dtype becomes an object array "
    "over slot bytes; touching an element dereferences them as pointers",
    "K2-ndarray-outside-slot": "an 'n' reference whose strides overflow numpy's extent check "
    "becomes an array reaching outside the slot",
    "K3-tensor-not-in-slot": "a 't' reference with count 0 and a non-empty shape becomes an "
    "uninitialised tensor outside the slot (torch.empty)",
}


@pytest.fixture(scope="module")
def fuzz_ring():
    ring = Ring.create_in("/dev/shm", 2, FUZZ_SLOT_BYTES)
    assert ring.slot_bytes == FUZZ_SLOT_BYTES
    return ring


def _real_meta(ring, batch):
    """Write `batch` into a claimed slot with an Arena, as a worker does; publish; acquire.
    Returns (lease, meta bytes, the references in pickling order)."""
    slot = ring.claim()
    assert slot is not None, "a previous example kept its slot"
    memory = ring.memory(slot)
    storage = torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
    arena = Arena(memory, storage)
    refs = []

    def place_all(leaves):
        refs.extend(arena.place_all(leaves))
        return refs

    try:
        meta = _layout.dumps(batch, place_all, 1)
        off, length = arena.write_meta(meta)
    except BaseException:
        ring.abandon(slot)
        raise
    ring.publish(slot, 1, off, length)
    lease = ring.acquire()
    assert lease.slot == slot and lease.meta() == meta
    return lease, meta, refs


def _redump(batch, refs):
    return _layout.dumps(batch, lambda leaves: list(refs), 1)


# ---- what to corrupt
_BIG = [
    2**31 - 1,
    2**31,
    2**32,
    2**53,
    2**62,
    2**63 - 1,
    2**63,
    2**64,
    2**70,
    -(2**31),
    -(2**62),
    -(2**63),
    -(2**63) - 1,
    -(2**64),
]
_NEAR_SLOT = [FUZZ_SLOT_BYTES + d for d in (-64, -16, -8, -4, -2, -1, 0, 1, 8, 4096)]
_INTS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 5, 7, 8, 63, 64, -1, -2, -3, -8, -64]),
    st.sampled_from(_BIG),
    st.sampled_from(_NEAR_SLOT),
    st.integers(-(2**66), 2**66),
    st.integers(-100, FUZZ_SLOT_BYTES + 100),
)
_JUNK_NOT_NONE = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.just(()),
    st.just([1, 2]),
    st.just({"k": 1}),
    st.just(torch.float32),
    st.just(np.float32),
)
_JUNK = st.one_of(st.none(), _JUNK_NOT_NONE)
_SHAPES = st.one_of(
    st.lists(_INTS, max_size=4).map(tuple),
    st.lists(st.integers(0, 8), max_size=4).map(tuple),
    _JUNK,
)
_TORCH_DTYPE_VALUES = st.one_of(
    st.sampled_from(
        TORCH_DTYPES
        + [
            torch.qint8,
            torch.quint8,
            torch.qint32,
            torch.quint4x2,
            torch.quint2x4,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.float8_e4m3fn,
            torch.complex32,
            torch.bits8,
        ]
    ),
    st.sampled_from(["float32", "<f4", "torch.float32"]),
    _JUNK,
)
_NP_DTYPE_VALUES = st.one_of(
    st.sampled_from(
        [
            "<f4",
            ">f8",
            "|b1",
            "|u1",
            "<i8",
            "<c16",
            "<f2",
            "|V8",
            "|V0",
            "|S5",
            "<U3",
            "<M8[s]",
            "<m8[ns]",
            "|O",
            "O",
            "<f4 ",
            "",
            "f",
            "<f16",
            [("a", "<f4"), ("b", "<i8")],
            [("x", "<i4", (3,))],
            [("a", "O")],
            [("a", "<f8"), ("o", "O")],
            {"names": ["a"], "formats": ["<f8"], "offsets": [0], "itemsize": 16},
        ]
    ),
    _JUNK,
)
_FIELD_VALUES = {
    ("t", 1): _INTS,
    ("t", 2): _TORCH_DTYPE_VALUES,
    ("t", 3): _SHAPES,
    ("t", 4): _SHAPES,
    ("t", 5): _INTS,
    ("t", 6): st.one_of(st.booleans(), _JUNK),
    ("t", 7): st.one_of(st.tuples(_INTS, _INTS), st.tuples(_INTS), _JUNK),
    ("n", 1): _INTS,
    ("n", 2): _NP_DTYPE_VALUES,
    ("n", 3): _SHAPES,
    ("n", 4): _SHAPES,
}
# Shape and strides of one length, small or huge dimensions and strides of any sign.
_DIMS = st.one_of(st.integers(0, 9), st.sampled_from([2**31, 2**32 + 1, 2**61 + 1, 2**62, -1]))
_SHAPE_STRIDES = st.integers(0, 3).flatmap(
    lambda k: st.tuples(
        st.lists(_DIMS, min_size=k, max_size=k).map(tuple),
        st.lists(_INTS, min_size=k, max_size=k).map(tuple),
    )
)
# Not None: a placer answering None means "not a slot leaf", and the leaf is then pickled
# whole (torch's path), which is not corruption.
_CRAFTED_REFS = st.one_of(
    _JUNK_NOT_NONE,
    _INTS,
    st.tuples(st.sampled_from(["t", "n", "x", "", "T"])),
    st.builds(
        lambda *f: ("t", *f),
        _INTS,
        _TORCH_DTYPE_VALUES,
        _SHAPES,
        _SHAPES,
        _INTS,
        st.booleans(),
        st.one_of(st.none(), st.tuples(_INTS, _INTS)),
    ),
    st.builds(lambda *f: ("n", *f), _INTS, _NP_DTYPE_VALUES, _SHAPES, _SHAPES),
    st.builds(
        lambda off, dt, ss, count, rg, storage: ("t", off, dt, *ss, count, rg, storage),
        _INTS,
        st.sampled_from(TORCH_DTYPES),
        _SHAPE_STRIDES,
        _INTS,
        st.booleans(),
        st.one_of(st.none(), st.tuples(_INTS, _INTS)),
    ),
    st.builds(lambda off, dt, ss: ("n", off, dt, *ss), _INTS, _NP_DTYPE_VALUES, _SHAPE_STRIDES),
    st.lists(_INTS, max_size=8).map(lambda xs: ("t", *xs)),
    st.lists(_INTS, max_size=6).map(lambda xs: ("n", *xs)),
)

_REF_EDIT = st.one_of(  # the new field value is drawn when applied (it depends on the kind)
    st.tuples(st.just("field"), st.integers(0, 50), st.integers(1, 7)),
    st.tuples(st.just("whole"), st.integers(0, 50), _CRAFTED_REFS),
)
_BYTE_EDIT = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 8)),
    st.tuples(st.just("set"), st.floats(0, 1), st.integers(0, 255)),
)
_CASE = st.one_of(
    st.tuples(st.lists(_REF_EDIT, max_size=2), st.lists(_BYTE_EDIT, max_size=3)),
    st.tuples(st.just([]), st.lists(_BYTE_EDIT, min_size=1, max_size=6)),
    st.tuples(st.lists(_REF_EDIT, min_size=1, max_size=3), st.just([])),
    st.binary(max_size=64).map(lambda b: ("raw", b)),
)


def _apply_ref_edits(refs, edits, data):
    """The references with `edits` applied (field values drawn from `data`); returns
    (refs, description)."""
    refs = list(refs)
    desc = []
    for edit in edits:
        if not refs:
            break
        if edit[0] == "whole":
            _, i, new = edit
            i %= len(refs)
            refs[i] = new
            desc.append(f"ref[{i}] = {new!r}")
            continue
        _, i, field = edit
        i %= len(refs)
        ref = refs[i]
        if not isinstance(ref, tuple) or len(ref) < 2 or ref[0] not in ("t", "n"):
            continue
        field = 1 + (field - 1) % (len(ref) - 1)
        value = data.draw(_FIELD_VALUES.get((ref[0], field), _INTS), label=f"ref[{i}][{field}]")
        refs[i] = ref[:field] + (value,) + ref[field + 1 :]
        desc.append(f"ref[{i}][{field}] = {value!r}  (was {ref[field]!r})")
    return refs, desc


def _apply_byte_edits(meta, edits):
    meta = bytearray(meta)
    desc = []
    for edit in edits:
        pos = min(int(edit[1] * len(meta)), max(len(meta) - 1, 0))
        if edit[0] == "flip" and meta:
            meta[pos] ^= edit[2]
        elif edit[0] == "set" and meta:
            meta[pos] = edit[2]
        elif edit[0] == "truncate":
            del meta[pos:]
        elif edit[0] == "insert":
            meta[pos:pos] = edit[2]
        elif edit[0] == "delete":
            del meta[pos : pos + edit[2]]
        desc.append(f"{edit[0]} at {pos}: {edit[2:]!r}")
    return bytes(meta), desc


# ---- the child's side: decode, then check that everything returned lies in the slot
def _extent(ptr, shape, strides_bytes, itemsize):
    """[lo, hi) bytes a strided view reaches (exact Python integers: no overflow)."""
    if any(n == 0 for n in shape):
        return None
    lo = ptr + sum(min(0, (n - 1) * s) for n, s in zip(shape, strides_bytes))
    hi = ptr + sum(max(0, (n - 1) * s) for n, s in zip(shape, strides_bytes)) + itemsize
    return lo, hi


def _inspect(obj, lo, hi, depth=0, seen=None):
    """Problems with what loads() returned: [(known bug id or 'NEW', detail)].  Touches the
    bytes of every view found inside the slot (small ones), so that a bad view faults here."""
    seen = set() if seen is None else seen
    if depth > 50 or id(obj) in seen:
        return []
    seen.add(id(obj))
    problems = []
    if type(obj) is torch.Tensor:
        if obj.numel() == 0 or obj.layout != torch.strided or obj.device.type != "cpu":
            return []
        item = obj.element_size()
        ext = _extent(obj.data_ptr(), obj.shape, [s * item for s in obj.stride()], item)
        st_lo = obj.untyped_storage().data_ptr()
        st_hi = st_lo + obj.untyped_storage().nbytes()
        if ext[0] < lo or ext[1] > hi:
            if st_hi <= lo or st_lo >= hi:
                problems.append(
                    (
                        "K3-tensor-not-in-slot",
                        f"tensor {tuple(obj.shape)} {obj.dtype} at "
                        f"{ext[0] - lo:+d} from the slot, storage not in the slot",
                    )
                )
            else:
                problems.append(
                    (
                        "NEW",
                        f"tensor {tuple(obj.shape)} stride {obj.stride()} "
                        f"{obj.dtype} spans [{ext[0] - lo}, {ext[1] - lo}) of a "
                        f"{hi - lo}-byte slot",
                    )
                )
        elif obj.numel() <= 1 << 20:
            obj.detach().clone()  # read every element through the strides
        return problems
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return [("K1-object-ndarray", f"ndarray of dtype {obj.dtype!r} shape {obj.shape}")]
        ptr = obj.__array_interface__["data"][0]
        ext = _extent(ptr, obj.shape, obj.strides, obj.itemsize)
        if ext is None:
            return []
        if ext[0] < lo or ext[1] > hi:
            return [
                (
                    "K2-ndarray-outside-slot",
                    f"ndarray {obj.shape} strides {obj.strides} {obj.dtype} spans "
                    f"[{ext[0] - lo}, {ext[1] - lo}) of a {hi - lo}-byte slot",
                )
            ]
        if obj.size <= 1 << 20:
            obj.tobytes()
        return []
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            problems += _inspect(k, lo, hi, depth + 1, seen)
            problems += _inspect(v, lo, hi, depth + 1, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in list(obj):
            problems += _inspect(v, lo, hi, depth + 1, seen)
    return problems


def _child(metas, lease, wfd, quiet):
    """Decode every meta; report one line per case on wfd.  Never returns."""
    try:
        if quiet:
            faulthandler.disable()  # an expected crash: no "Fatal Python error" noise
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        with open("/proc/self/status") as f:
            vmdata = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        limit = vmdata + CHILD_MEMORY_HEADROOM
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        torch.set_num_threads(1)
        lo = np.frombuffer(lease, dtype=np.uint8).__array_interface__["data"][0]
        hi = lo + len(lease)
        for i, meta in enumerate(metas):
            os.write(wfd, f"start {i}\n".encode())
            try:
                # Views only, which must lie in the slot (small leaves' copies are
                # made from bytes that must: see test_small_leaf_copies_stay_in_the_slot).
                out = _layout.loads(meta, lease, copy_small=False)
            except Exception as e:  # noqa: BLE001 - any ordinary exception is a fine answer
                status = f"exception {type(e).__name__}"
            except BaseException as e:  # noqa: BLE001
                status = f"NEW non-Exception {type(e).__name__}: {e!r}"[:300]
            else:
                try:
                    problems = _inspect(out, lo, hi)
                except Exception as e:  # noqa: BLE001 - e.g. a bits8 tensor, which
                    # torch cannot read: unusable, but an ordinary exception when used
                    problems, status = [], f"returned-unusable {type(e).__name__}"
                else:
                    status = "returned"
                new = [d for k, d in problems if k == "NEW"]
                known = sorted({k for k, _ in problems if k != "NEW"})
                if new:
                    status = "NEW " + "; ".join(new)[:300]
                elif known:
                    status = "known " + ",".join(known)
            os.write(wfd, f"done {i} {status}\n".encode())
    except BaseException:  # noqa: BLE001 - a bug of this harness, not of the decoder
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def _decode_in_child(metas, lease, quiet=False):
    """Decode `metas` in a forked child.  Returns ([status per case], crash or None).
    Unless quiet, a crash also prints the child's Python traceback (faulthandler)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(metas, lease, wfd, quiet)
    os.close(wfd)
    buf = b""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([rfd], [], [], left)
            if ready:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                buf += chunk
    finally:
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
    statuses, started = {}, None
    for line in buf.decode().splitlines():
        word, idx, *rest = line.split(" ", 2)
        if word == "start":
            started = int(idx)
        else:
            statuses[int(idx)] = rest[0] if rest else ""
            started = None
    crash = None
    if os.WIFSIGNALED(status):
        crash = (started, f"killed by {signal.Signals(os.WTERMSIG(status)).name}")
    elif os.WEXITSTATUS(status) == 3:
        raise AssertionError(f"the fuzz harness itself failed in case {started} (see stderr)")
    elif os.WEXITSTATUS(status) != 0 or len(statuses) != len(metas):
        crash = (
            started,
            f"exit status {os.WEXITSTATUS(status)} after {len(statuses)} of {len(metas)} cases",
        )
    if time.monotonic() > deadline:
        crash = (started, f"hung for more than {CHILD_TIMEOUT_S} s")
    return statuses, crash


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=spec_strategy(collatable=False),
    seed=st.integers(0, 2**32 - 1),
    cases=st.lists(_CASE, min_size=1, max_size=12),
    data=st.data(),
)
@pytest.mark.slow
@pytest.mark.one_mode  # no loader: the decoder alone, over a ring of its own
def test_decoder_survives_corrupt_metadata(fuzz_ring, spec, seed, cases, data):
    rearm_hang_guard()  # per example (a longer hunt needs no longer guard)
    # Two samples of the drawn structure, and always a tensor and an array to corrupt.
    batch = {
        "samples": [build(spec, seed, i) for i in range(2)],
        "t": build(("tensor", "float32", (2, 3), "contig", False), seed, 2),
        "n": build(("ndarray", "int16", (3,), "contig"), seed, 3),
    }
    lease, meta, refs = _real_meta(fuzz_ring, batch)
    try:
        assert _redump(batch, refs) == meta  # re-pickling with the same refs is exact
        metas, descs = [], []
        for case in cases:
            if case[0] == "raw":
                metas.append(case[1])
                descs.append([f"raw bytes {case[1]!r}"])
                continue
            ref_edits, byte_edits = case
            new_refs, d1 = _apply_ref_edits(refs, ref_edits, data)
            try:
                m = _redump(batch, new_refs) if d1 else meta
            except Exception as e:  # noqa: BLE001 - an unpicklable crafted ref: skip it
                d1.append(f"(unpicklable: {type(e).__name__}; original refs kept)")
                m = meta
            m, d2 = _apply_byte_edits(m, byte_edits)
            metas.append(m)
            descs.append(d1 + d2)
        statuses, crash = _decode_in_child(metas, lease)
    finally:
        lease.release()

    def describe(i):
        return (
            f"case {i}: edits {descs[i]}\n  meta ({len(metas[i])} bytes) = {metas[i]!r}\n"
            f"  original refs: {refs!r}"
        )

    if crash is not None:
        i, what = crash
        where = describe(i) if i is not None else "between cases"
        raise AssertionError(f"decoding crashed the process ({what}) at {where}")
    for i, status in sorted(statuses.items()):
        event(status.split(" ", 1)[0])
        assert not status.startswith(("NEW", "known")), f"{status}\n{describe(i)}"
    note(f"{len(metas)} cases decoded")


# ---- the decoder bugs found, one minimal regression test each
def _one_ref_meta(ref):
    return _layout.dumps([torch.zeros(1)], lambda leaves: [ref], 1)


@pytest.fixture
def lease_of(fuzz_ring):
    leases = []

    def make():
        slot = fuzz_ring.claim()
        fuzz_ring.publish(slot, 1, 0, 0)
        lease = fuzz_ring.acquire()
        np.frombuffer(lease, dtype=np.uint8)[:] = 0x41  # "pointers" 0x4141414141414141
        leases.append(lease)
        return lease

    yield make
    for lease in leases:
        lease.release()


def _decode_and_read(meta, lease, index):
    """In a child: decode and read element `index` of the first leaf.  Returns how the child
    ended: "refused" (the decoder raised UnpicklingError, as it must for a reference that
    does not fit the slot), "read" (it decoded and the element was read), "exit 1" for any
    other exception, or the signal that killed it."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            faulthandler.disable()  # the crash is expected: no "Fatal Python error" noise
            try:
                out, *_ = _layout.loads(meta, lease, copy_small=False)
            except pickle.UnpicklingError:
                code = 3
            else:
                repr(out[0][index])
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return {0: "read", 3: "refused"}.get(os.WEXITSTATUS(status), f"exit {os.WEXITSTATUS(status)}")


def test_harness_reports_a_crash_in_the_decoder(lease_of):
    """The fork harness turns a segfault inside loads() into a failure that names the case.
    (Slot metadata is a pickle: metadata crafted to call ctypes.string_at(0) segfaults any
    unpickler that does not restrict find_class; random corruption does not get there.)"""
    import ctypes

    class Segfault:
        def __reduce__(self):
            return ctypes.string_at, (8, 1)  # reads address 8

    fine = _layout.dumps([1, "x", None], lambda leaves: [], 1)
    meta = _layout.dumps([Segfault()], lambda leaves: [], 1)
    statuses, crash = _decode_in_child([fine, meta], lease_of(), quiet=True)
    assert statuses == {0: "returned"}
    assert crash == (1, "killed by SIGSEGV")


def _decode_and_touch(meta, lease):
    """In a child: decode and read every element.  The decoder honours its contract if
    this raises an ordinary exception or returns views inside the slot."""
    statuses, crash = _decode_in_child([meta], lease)
    assert crash is None, f"the process crashed: {crash[1]}"
    assert not statuses[0].startswith(("NEW", "known")), statuses[0]


def test_decoder_refuses_object_dtype_ndarray_reference(lease_of):
    # K1: an object array over slot bytes would dereference them as pointers.
    meta = _one_ref_meta(("n", 0, "|O", (1,), (8,)))
    lease = lease_of()
    assert _decode_and_read(meta, lease, 0) == "refused"
    _decode_and_touch(meta, lease)


def test_decoder_refuses_ndarray_stride_overflow_reference(lease_of):
    # K2: (5 - 1) * 2**62 == 2**64 wraps to 0 in numpy's buffer-extent check, so numpy
    # alone would accept an array whose a[1] lies 2**62 bytes past the slot.
    meta = _one_ref_meta(("n", 0, "<f4", (5,), (2**62,)))
    lease = lease_of()
    assert _decode_and_read(meta, lease, 1) == "refused"
    _decode_and_touch(meta, lease)


def test_decoder_refuses_zero_count_tensor_reference(lease_of):
    # K3: count == 0 took the empty-tensor branch (torch.empty(shape)) whatever the shape.
    meta = _one_ref_meta(("t", 0, torch.float32, (1000,), (1,), 0, False, None))
    lease = lease_of()
    assert _decode_and_read(meta, lease, 0) == "refused"
    _decode_and_touch(meta, lease)


def test_decoder_refuses_quantized_tensor_reference(lease_of):
    # K4: a quantized dtype over slot bytes has no quantizer; reading it segfaulted.
    meta = _one_ref_meta(("t", 0, torch.qint8, (1,), (1,), 1, False, None))
    lease = lease_of()
    assert _decode_and_read(meta, lease, 0) == "refused"
    _decode_and_touch(meta, lease)

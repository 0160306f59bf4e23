"""Batch layout: a batch <-> (slot bytes, small metadata).

A batch of any structure (tuples, lists, dicts, namedtuples, dataclasses, ...)
is pickled with torch's ForkingPickler, except that every dense CPU tensor
and numeric numpy array is replaced by a *slot reference*: where its bytes lie
in the slot, its dtype, shape and strides.  The pickle is the metadata; the
bytes never go through it.  On the consumer side the references become views
of the slot, except small leaves that share their bytes with no other leaf
(labels, ids, boxes: at most SMALL_LEAF_BYTES), which are copied out as they
arrive, as cheaply as a view is made: kept (a list of labels for a metric,
say), they would otherwise hold a whole slot each.  Which leaves go into the
slot is decided in _slot_rules.py (NOTE [slot rules]), where in it by the
placer (see _arena.py); this module only knows the reference format.

The metadata is two lengths (of the next two parts), then two pickles: first
the slot references of the batch's leaves, in the order the batch's pickling
met them (with the count of fallback leaves and of samples), then the batch
itself, each of its slot leaves pickled as a call of _slot_leaf on the number
of its reference, so that the pickle memo keeps a leaf that occurs twice one
object; last, the worker's state as its bytes (none: no state).  The batch is
pickled once, its leaves collected on the way and placed after it (the placer
sees them all, and so which of them share their bytes), so that a __reduce__ of
the user's runs once, as under torch's transport (for a batch that fits its
slot).  Reference tuples (made by tensor_ref and array_ref):
    ("t", byte_offset, torch.dtype, shape, stride, span in elements, requires_grad,
     storage: None where no other leaf views its bytes, else the (byte offset, size)
     of the bytes that the leaves sharing its storage span together, which they
     share as one storage again, as under torch's transport)
    ("n", byte_offset, numpy dtype, shape, strides)
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from ._slot_rules import QUANTIZED, is_slot_ndarray, is_slot_tensor

TENSOR = "t"
NDARRAY = "n"
# Leaves up to this size (and alone on their bytes) are copied out of the slot.
SMALL_LEAF_BYTES = 16384
# numpy's unpickling copies an array of up to this many bytes (it then owns its
# data); a larger one keeps the pickle's bytes as its base.
NUMPY_OWNS_UP_TO = 1000
# The lengths of the metadata's two pickles, at its start.
_LENGTHS = struct.Struct("<II")
# DLPack's type codes of the dtypes every supported torch takes from a capsule
# (kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLComplex 5, kDLBool 6; the
# bits are the dtype's); leaves of other dtypes are made by torch.frombuffer
# and Tensor.set_.
_DLPACK_CODES = {
    torch.bool: 6,
    torch.uint8: 1,
    **dict.fromkeys((torch.int8, torch.int16, torch.int32, torch.int64), 0),
    **dict.fromkeys((torch.float16, torch.float32, torch.float64), 2),
    torch.bfloat16: 4,
    **dict.fromkeys((torch.complex64, torch.complex128), 5),
}
_from_dlpack = torch._C._from_dlpack


def tensor_ref(
    offset: int, dtype, shape, stride, requires_grad: bool, storage: tuple[int, int] | None
) -> tuple:
    """The reference of a tensor leaf at byte `offset` of the slot; `storage`:
    see the module's note."""
    return (
        TENSOR,
        offset,
        dtype,
        tuple(shape),
        tuple(stride),
        span_elements(shape, stride),
        requires_grad,
        storage,
    )


def array_ref(offset: int, dtype, shape, strides) -> tuple:
    """The reference of a numpy leaf at byte `offset` of the slot."""
    return (NDARRAY, offset, dtype, shape, strides)


def _slot_leaf(number):
    """A slot leaf is pickled as a call of this on its reference's number;
    the unpickler (see _RefUnpickler.find_class) calls its own in its place,
    which makes the leaf.  Going through a reduce lets the pickle memo keep a
    leaf that occurs twice in a batch one object, as torch's pickling does;
    and unlike a persistent_id hook, which the pickler would call for every
    object of a batch (each int of a list of them), reducer_override is not
    called for plain ints, floats, strings, lists, tuples and dicts."""
    raise pickle.UnpicklingError(f"slot reference {number!r} outside a slot's metadata")


class _RefPickler(ForkingPickler):
    def __init__(self, file, owns):
        # Leaves that are not placed are pickled as torch's transport pickles
        # them: ForkingPickler's default protocol (under protocol 5 a
        # read-only numpy array would arrive read-only; torch's arrives
        # writable).
        super().__init__(file)
        self._owns = owns
        self.leaves = []  # slot leaves in the order met (the memo asks once per object)
        self.fallback_leaves = 0

    def reducer_override(self, obj):
        if is_slot_tensor(obj) or is_slot_ndarray(obj):
            self.leaves.append(obj)
            return _slot_leaf, (len(self.leaves) - 1,)
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            # CUDA, sparse, nested, subclass or object arrays: torch's own
            # pickling path carries them.
            self.fallback_leaves += 1
            _move_out_of_slot(obj, self._owns)
        return NotImplemented


def _move_out_of_slot(obj, owns) -> None:
    """Give a tensor that views memory owns() is true of (a slot: a tensor
    subclass stacked there, say) a copy of its bytes to view instead, before
    torch's pickling shares its storage: that would move the whole slot's
    storage into shared memory of its own, under the worker's later batches.
    The tensor stays the same object (its class, attributes, requires_grad and
    leafness are torch's to pickle); only its data is swapped."""
    if (
        owns is not None
        and isinstance(obj, torch.Tensor)
        and obj.layout == torch.strided
        and obj.device.type == "cpu"
        and not obj.is_nested
        and owns(obj)
    ):
        obj.data = obj.detach().clone()


def _with_refs(
    refs, fallback_leaves: int, samples: int, worker_state: bytes | None, batch_pickle: bytes
) -> bytes:
    head = pickle.dumps((refs, fallback_leaves, samples), pickle.HIGHEST_PROTOCOL)
    return _LENGTHS.pack(len(head), len(batch_pickle)) + head + batch_pickle + (worker_state or b"")


def dumps(batch, place_all, samples: int, worker_state: bytes | None = None, owns=None) -> bytes:
    """The metadata of `batch`: its slot-able leaves (dense CPU tensors and
    numeric numpy arrays) become the references place_all(leaves) gives for
    them, after the batch is pickled; then (how many tensor-like leaves could
    not be placed and travel through torch's pickling instead, samples in the
    batch, the worker's state after the batch (see _worker/_state.py) or None).
    Leaves that torch's pickling carries are copied first where owns(tensor)
    is true (they view a slot; owns may be None)."""
    buf = io.BytesIO()
    pickler = _RefPickler(buf, owns)
    pickler.dump(batch)
    refs = place_all(pickler.leaves)
    return _with_refs(refs, pickler.fallback_leaves, samples, worker_state, buf.getvalue())


class _TemplatePickler(pickle.Pickler):
    def __init__(self, file, ref_of):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._ref_of = ref_of
        self.refs = []

    def reducer_override(self, obj):
        ref = self._ref_of(obj)
        if ref is None:
            return NotImplemented
        self.refs.append(ref)
        return _slot_leaf, (len(self.refs) - 1,)


def dumps_refs(structure, ref_of, samples: int) -> bytes:
    """Metadata for a batch whose leaves are already in the slot: `structure`
    holds placeholders for which ref_of(obj) gives the slot reference (None
    for everything else)."""
    buf = io.BytesIO()
    pickler = _TemplatePickler(buf, ref_of)
    pickler.dump(structure)
    return _with_refs(pickler.refs, 0, samples, None, buf.getvalue())


class _DetachPickler(ForkingPickler):
    def __init__(self, file, owns):
        super().__init__(file)  # torch's protocol, as in _RefPickler
        self._owns = owns
        self.shared_bytes = 0  # of the storages torch's transport shares, not pickles
        self._shared = set()

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            _move_out_of_slot(obj, self._owns)
            self._count(obj)
        return NotImplemented

    def _count(self, tensor) -> None:
        if tensor.layout == torch.strided and tensor.device.type == "cpu" and not tensor.is_nested:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._shared:  # views of one storage: once
                self._shared.add(storage.data_ptr())
                self.shared_bytes += storage.nbytes()


def dumps_detached(obj, owns) -> tuple[bytes, int]:
    """Pickle `obj` for torch's transport, copying out every tensor for which
    owns(tensor) is true (owns may be None), so the result shares no memory
    with the slot.  Returns the pickle and the bytes of the CPU tensor
    storages that torch's transport shares beside it."""
    buf = io.BytesIO()
    pickler = _DetachPickler(buf, owns)
    pickler.dump(obj)
    return buf.getvalue(), pickler.shared_bytes


def span_elements(shape, stride) -> int:
    """Elements from a strided tensor's first to its last, inclusive."""
    if any(n == 0 for n in shape):
        return 0
    return sum((n - 1) * st for n, st in zip(shape, stride)) + 1


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file, make_leaf):
        super().__init__(file)
        # Not a method of this unpickler: its memo keeps what find_class
        # returns, and a bound method would make a cycle that keeps the
        # batch's leaves (and so its slot) alive until the garbage collector.
        self._make_leaf = make_leaf

    def find_class(self, module, name):
        if name == "_slot_leaf" and module == __name__:
            return self._make_leaf
        return super().find_class(module, name)


class _LeafMaker:
    """Turns slot references back into leaves (views of the slot, or copies
    of small ones), refusing any that would not lie wholly inside the slot: a
    corrupted slot is an error, never a wild read.
    (leaf_spec and SlotMemory.leaf_capsule check a DLPack leaf's span, shape
    and strides, torch.frombuffer and Tensor.set_ any other tensor's; numpy's
    own extent check can overflow, so it is done here.)"""

    __slots__ = ("_buffer", "_copy_small", "refs", "made", "specs", "_storages")

    def __init__(self, slot_buffer, copy_small, refs):
        self._buffer = slot_buffer
        self._copy_small = copy_small
        self.refs = refs  # the metadata's references
        self.made = {}  # id(leaf) -> its reference's number
        self.specs = {}  # number -> leaf_spec(), for leaves one capsule makes whole
        self._storages = None  # (byte offset, size) -> the storage leaves share there

    def __call__(self, number):
        if type(number) is not int or not 0 <= number < len(self.refs):
            raise pickle.UnpicklingError(f"slot reference number {number!r} is not in the metadata")
        leaf = self._make(number, self.refs[number])
        self.made[id(leaf)] = number
        return leaf

    def _make(self, number, ref):
        if type(ref) is not tuple or not ref:
            raise pickle.UnpicklingError(f"slot reference {ref!r} is not a reference")
        kind = ref[0]
        if kind == TENSOR:
            _, offset, dtype, shape, stride, count, requires_grad, storage = ref
            if type(dtype) is not torch.dtype or dtype in QUANTIZED:
                raise pickle.UnpicklingError(f"slot reference {ref!r} has no plain dtype")
            if offset % dtype.itemsize:  # a misaligned view: vector loads would fault
                raise pickle.UnpicklingError(f"slot reference {ref!r} is not aligned")
            if count == 0:
                if (
                    math.prod(shape) != 0
                    or len(stride) != len(shape)
                    or any(type(n) is not int or n < 0 for n in stride)
                ):
                    raise pickle.UnpicklingError(f"slot reference {ref!r} has no bytes")
                tensor = torch.empty_strided(shape, stride, dtype=dtype)  # its strides kept
            elif storage is not None:
                tensor = torch.empty((0,), dtype=dtype).set_(
                    self._shared_storage(storage),
                    self._offset_in(storage, offset, ref),
                    shape,
                    stride,
                )
            elif dtype in _DLPACK_CODES:
                spec = leaf_spec(ref, self._copy_small)
                tensor = _from_dlpack(self._buffer.leaf_capsule(*spec))
                if not requires_grad:
                    self.specs[number] = spec
            else:  # (a copy would be made as a view is: it is never smaller than a page)
                tensor = torch.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)
                tensor.set_(tensor.untyped_storage(), 0, shape, stride)
            return tensor.requires_grad_() if requires_grad else tensor
        if kind == NDARRAY:
            _, offset, dtype, shape, strides = ref
            dtype = np.dtype(dtype)
            if (
                dtype.hasobject
                or offset % dtype.alignment
                or not _inside(offset, shape, strides, dtype.itemsize, len(self._buffer))
            ):
                raise pickle.UnpicklingError(f"slot reference {ref!r} does not fit the slot")
            array = np.ndarray(
                shape, dtype=dtype, buffer=self._buffer, offset=offset, strides=strides
            )
            return self._as_unpickled(array) if self._copy_small else array
        raise pickle.UnpicklingError(f"unknown slot reference kind {kind!r}")

    def _shared_storage(self, storage) -> torch.UntypedStorage:
        """The one storage over the slot's (offset, size) bytes that the
        leaves referring to it share (torch.frombuffer checks the span)."""
        if (
            type(storage) is not tuple
            or len(storage) != 2
            or not all(type(n) is int and n >= 0 for n in storage)
        ):
            raise pickle.UnpicklingError(f"slot storage {storage!r} is not (offset, size)")
        if self._storages is None:
            self._storages = {}
        shared = self._storages.get(storage)
        if shared is None:
            first, nbytes = storage
            shared = self._storages[storage] = torch.frombuffer(
                self._buffer, dtype=torch.uint8, count=nbytes, offset=first
            ).untyped_storage()
        return shared

    @staticmethod
    def _offset_in(storage, offset: int, ref) -> int:
        """A leaf's storage offset, in elements, in the storage it shares
        (Tensor.set_ checks its extent there)."""
        itemsize = ref[2].itemsize
        if offset < storage[0] or (offset - storage[0]) % itemsize:
            raise pickle.UnpicklingError(f"slot reference {ref!r} does not lie in its storage")
        return (offset - storage[0]) // itemsize

    @staticmethod
    def _as_unpickled(array):
        """A numpy leaf as numpy's unpickling (torch's transport) makes it,
        where that is not a view of the slot: a byte-swapped dtype in the
        native byte order (a structured one keeps its fields' orders), and
        a copy that owns its data up to NUMPY_OWNS_UP_TO bytes, and above that,
        up to SMALL_LEAF_BYTES, a copy over a buffer it does not own.  (The
        arena places arrays in C or Fortran order, which a copy keeps.)"""
        if array.dtype.byteorder not in "=|":
            return array.astype(array.dtype.newbyteorder("="))
        if array.size == 0:  # its strides kept (a copy would zero them), and no slot held
            return np.ndarray(array.shape, array.dtype, buffer=bytearray(0), strides=array.strides)
        if array.nbytes <= NUMPY_OWNS_UP_TO:
            return array.copy(order="K")
        if array.nbytes > SMALL_LEAF_BYTES:
            return array
        order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
        copy = np.ndarray(array.shape, array.dtype, buffer=bytearray(array.nbytes), order=order)
        copy[...] = array
        return copy


def _inside(offset, shape, strides, itemsize, size) -> bool:
    """Whether an array's every byte lies in [0, size), in exact integers."""
    if len(shape) != len(strides) or any(n < 0 for n in shape):
        return False
    if any(n == 0 for n in shape):
        return 0 <= offset <= size
    low = offset + sum(min(0, (n - 1) * st) for n, st in zip(shape, strides))
    high = offset + sum(max(0, (n - 1) * st) for n, st in zip(shape, strides)) + itemsize
    return 0 <= low and high <= size


def leaf_spec(ref, copy_small: bool) -> tuple:
    """SlotMemory.leaf_capsule's arguments for a tensor reference of a
    DLPack dtype, with neither a storage shared with other leaves nor zero
    elements: a storage of exactly this leaf's bytes (torch.save and pickling
    of one leaf then carry that leaf only), which cannot be resized, as a
    view's (and torch's shared memory) cannot; a view holds the slot's lease
    until it dies, and a small leaf (copy_small) is a copy of its bytes."""
    _, offset, dtype, shape, stride, count, _, _ = ref
    if (
        len(stride) != len(shape)
        or not all(type(n) is int and n >= 0 for n in (*shape, *stride))
        or span_elements(shape, stride) > count
    ):
        raise pickle.UnpicklingError(f"slot reference {ref!r} does not fit its bytes")
    nbytes = count * dtype.itemsize
    code, bits = _DLPACK_CODES[dtype], dtype.itemsize * 8
    return offset, nbytes, code, bits, shape, stride, copy_small and nbytes <= SMALL_LEAF_BYTES


# What a batch's structure may be built of without its pickle (see Decoder).
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})
_LEAF = object()


def _plan(obj, made: dict, containers: set):
    """How to build `obj` again from new leaves: (_LEAF, number), (an atom's
    type, the atom), (tuple or list, [plans]) or (dict, [(key, plan)]); None
    where it cannot be (any other type, or a container met twice, which the
    pickle keeps one object)."""
    number = made.get(id(obj))
    if number is not None:
        return _LEAF, number
    kind = type(obj)
    if kind in _ATOMS:
        return kind, obj
    if kind not in (tuple, list, dict) or id(obj) in containers:
        return None
    containers.add(id(obj))
    if kind is dict:
        items = [(key, _plan(value, made, containers)) for key, value in obj.items()]
        if all(type(key) in _ATOMS and plan is not None for key, plan in items):
            return dict, items
        return None
    parts = [_plan(part, made, containers) for part in obj]
    return (kind, parts) if None not in parts else None


def _builder(plan) -> Callable[[list], Any]:
    """A function of the new leaves that builds the batch: tuple or list
    itself where the batch is one of its leaves in order, as most are."""
    kind, parts = plan
    if kind in (tuple, list) and parts == [(_LEAF, i) for i in range(len(parts))]:
        return kind
    return functools.partial(_build, plan)


def _build(plan, leaves):
    kind, arg = plan
    if kind is _LEAF:
        return leaves[arg]
    if kind is dict:
        return {key: _build(part, leaves) for key, part in arg}
    if kind is tuple or kind is list:
        return kind([_build(part, leaves) for part in arg])
    return arg  # an atom


class Decoder:
    """Batches back from their metadata, for one consumer.

    NOTE [layout: one batch's decoding]
    On the training thread, decoding a batch costs mostly what it touches
    for the first time since the last step (the model's step evicts the
    caches): each torch call, each pickle, each Python function.  So (a) a
    tensor leaf is made by one torch call, torch._C._from_dlpack over a
    capsule of the slot's bytes (SlotMemory.leaf_capsule), instead of
    torch.frombuffer and Tensor.set_; and (b) a consumer's batches repeat
    one structure, so the decoder keeps the last one's: where a batch's
    metadata starts with the same bytes (lengths, references, the batch's
    pickle), its references were checked already and its containers are
    built again from a plan, without unpickling anything.  Only plain
    tuples, lists and dicts of tensor leaves of DLPack dtypes and of atoms
    have a plan; any other batch is unpickled every time."""

    __slots__ = ("_known", "_copy_small", "_specs", "_make_batch", "_counts")

    def __init__(self) -> None:
        self._known = None  # the last structure's bytes, where it has a plan

    def loads(self, meta: bytes, slot_buffer, copy_small: bool = True):
        """Rebuild a batch from its metadata, its leaves viewing `slot_buffer`
        (small ones copied out of it, unless not copy_small: a pinned ring's
        views are pinned memory).  Returns (batch, number of leaves that came
        through torch's pickling, samples in the batch, the worker's state or
        None)."""
        known = self._known
        if known is not None and copy_small == self._copy_small and meta.startswith(known):
            leaves = [_from_dlpack(slot_buffer.leaf_capsule(*spec)) for spec in self._specs]
            return (self._make_batch(leaves), *self._counts, meta[len(known) :] or None)
        if len(meta) < _LENGTHS.size:
            raise pickle.UnpicklingError(f"slot metadata of {len(meta)} bytes has no lengths")
        head_bytes, batch_bytes = _LENGTHS.unpack_from(meta)
        end = _LENGTHS.size + head_bytes + batch_bytes
        if end > len(meta):
            raise pickle.UnpicklingError(
                f"slot metadata of {len(meta)} bytes is shorter than its parts ({end} bytes)"
            )
        view = memoryview(meta)
        # The references need no hook: the C unpickler reads them, dtypes included.
        head = pickle.loads(view[_LENGTHS.size : _LENGTHS.size + head_bytes])
        if type(head) is not tuple or len(head) != 3 or type(head[0]) is not list:
            raise pickle.UnpicklingError("slot metadata without its list of slot references")
        refs, fallback_leaves, samples = head
        make_leaf = _LeafMaker(slot_buffer, copy_small, refs)
        # An unpickler of its own: the batch's pickle numbers its memo from 0.
        batch = _RefUnpickler(io.BytesIO(view[end - batch_bytes : end]), make_leaf).load()
        self._remember(meta[:end], make_leaf, batch, copy_small, (fallback_leaves, samples))
        return batch, fallback_leaves, samples, meta[end:] or None

    def _remember(self, known, make_leaf, batch, copy_small, counts) -> None:
        """Keep this batch's structure, where it has a plan (see the NOTE):
        every reference made into a leaf by one capsule, as its spec says."""
        self._known = None
        specs = make_leaf.specs
        if len(specs) != len(make_leaf.refs):
            return
        plan = _plan(batch, make_leaf.made, set())
        if plan is not None:
            self._specs = [specs[number] for number in range(len(specs))]
            self._make_batch = _builder(plan)
            self._known, self._copy_small, self._counts = known, copy_small, counts


def loads(meta: bytes, slot_buffer, copy_small: bool = True):
    """One batch's Decoder.loads()."""
    return Decoder().loads(meta, slot_buffer, copy_small)

"""fetch="sample": a batch slot filled row by row, one sample per row.

The first sample fixes the batch layout.  torch's own collate, run on that
one sample with every leaf it would stack replaced by a _Field, yields the
structure default_collate builds (dicts, lists, namedtuples, ...) and the
list of fields in the order collate visits them.  Each field gets a region
of the slot holding `capacity` rows of one sample's bytes back to back, so
the batch's tensor for that field is the region's first n rows: exactly the
(n, *shape) tensor default_collate would stack.

torch's default_collate also runs once on each of that sample's unusual tensor
leaves (other dtypes or layouts), so that one torch cannot batch fails with
torch's own error.  Workers flatten every later sample the same way (collate
again, recording leaves), check that its structure is the first sample's
(container types, keys in order, lengths, attributes) and each leaf against
its field, and copy the leaves into their rows.  The
main process turns the structure into a batch of views with _layout's slot
references; nothing about the batch is pickled per batch.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data._utils.collate import (
    collate,
    default_collate,
    default_collate_err_msg_format,
)

from .._errors import SampleLayoutError
from .._shm import _layout
from .._shm._ring import copy_stream
from .._shm._slot_rules import collate_may_refuse
from ._arena import aligned


class _Field:
    """Placeholder for one stacked leaf in the batch structure."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def __eq__(self, other):
        return type(other) is _Field and other.number == self.number

    # Unhashable, as it defines __eq__ (typed as typeshed types list's: mypy
    # takes None for an incompatible override of object.__hash__).
    __hash__: ClassVar[None] = None  # type: ignore[assignment]


def _describe(dtype, shape) -> str:
    return f"{str(dtype).replace('torch.', '')} of shape {tuple(shape)}"


def _leaf_spec(leaf):
    """(torch dtype, per-sample shape) that default_collate gives this leaf."""
    if isinstance(leaf, torch.Tensor):
        if leaf.layout != torch.strided or leaf.device.type != "cpu" or leaf.is_nested:
            raise SampleLayoutError(
                f"fetch='sample' writes samples into shared memory and needs dense CPU "
                f"tensors, but a sample holds a {leaf.layout} tensor on {leaf.device}; "
                "use fetch='batch'."
            )
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            raise SampleLayoutError(
                f"fetch='sample' batches are plain tensors viewing shared memory, but a "
                f"sample holds a {type(leaf).__name__} (a torch.Tensor subclass), which "
                "torch's collate stacks through the subclass's own __torch_function__ (a "
                "plain subclass stays one, torchvision's tv_tensors come out plain); use "
                "fetch='batch', or return plain tensors (torchvision: "
                "transforms.v2.ToPureTensor())."
            )
        return leaf.dtype, tuple(leaf.shape)
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.hasobject or leaf.dtype.kind in "SU":
            raise TypeError(default_collate_err_msg_format.format(leaf.dtype))
        return torch.from_numpy(np.empty(0, leaf.dtype)).dtype, leaf.shape
    if isinstance(leaf, (np.bool_, np.number)):
        return torch.as_tensor(leaf).dtype, ()
    if isinstance(leaf, float):
        return torch.float64, ()
    return torch.tensor([leaf]).dtype, ()  # int: int64, or bool for a bool


def _leaf_kind(leaf) -> str:
    """Which of collate's leaf rules `leaf` takes: a field's samples must all
    take the first one's (torch's batch would fail, or differ, otherwise)."""
    if isinstance(leaf, torch.Tensor):
        return "tensor"
    if isinstance(leaf, np.ndarray):
        return "numpy array"
    if isinstance(leaf, (np.bool_, np.number)):
        return "numpy scalar"
    return "float" if isinstance(leaf, float) else "Python int"


def _refuse_text(batch, *, collate_fn_map=None):
    raise SampleLayoutError(
        f"fetch='sample' writes every field of a sample into a fixed-size row of shared "
        f"memory, but a sample holds a {type(batch[0]).__name__} ({batch[0]!r:.40}), "
        "whose size varies; use fetch='batch' (the default) for such samples."
    )


_STACKED = (torch.Tensor, np.ndarray, np.bool_, np.number, float, int)  # default_collate's leaves


def _leaf_map(on_leaf):
    """A collate_fn_map sending every leaf default_collate stacks to on_leaf."""
    fn = lambda batch, *, collate_fn_map=None: on_leaf(batch[0])  # noqa: E731
    return {**dict.fromkeys(_STACKED, fn), str: _refuse_text, bytes: _refuse_text}


def _flatten(sample):
    """(the batch structure collate builds from `sample` alone, with each leaf
    it would stack replaced by a numbered _Field; the leaves, in that order)."""
    leaves = []

    def add(leaf):
        leaves.append(leaf)
        return _Field(len(leaves) - 1)

    return collate([sample], collate_fn_map=_leaf_map(add)), leaves


def _attributes(obj) -> dict:
    """An object's instance attributes, as collate's copy of a mapping keeps
    them: its __dict__ (unless that is the mapping itself, an "attribute
    dict", whose items are compared as items), its __slots__ values and a
    defaultdict's default_factory."""
    own = getattr(obj, "__dict__", None)
    found = dict(own) if own is not None and own is not obj else {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # as Python mangles it
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                found[name] = getattr(obj, name)
    if isinstance(obj, collections.defaultdict):
        found["default_factory"] = obj.default_factory
    return found


class _ByValue(pickle.Pickler):
    """Pickles by value: tensors as their dtype, shape and bytes (torch's own
    pickling gives each a fresh serialization id); used with no memo, so two
    equal objects pickle alike, shared or not (a cyclic value then fails, and
    counts as different; a set's order still counts)."""

    def __init__(self, file):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.fast = True  # no memo

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            return tuple, ((str(obj.dtype), tuple(obj.shape), bytes(data.numpy())),)
        return NotImplemented


def _by_value(obj) -> bytes:
    buffer = io.BytesIO()
    _ByValue(buffer).dump(obj)
    return buffer.getvalue()


def _same_attributes(got, want) -> bool:
    if type(want) in (dict, list, tuple):
        return True
    a, b = _attributes(got), _attributes(want)
    if not a and not b:
        return True
    try:  # by value: arrays, tensors, NaN and objects without __eq__ alike
        return _by_value(a) == _by_value(b)
    except Exception:  # noqa: BLE001 - attributes that cannot be compared differ
        return False


def _difference(got, want, path=""):
    """Where and how structure `got` differs from `want` (see _flatten), or
    None: the same container types, keys in the same order, the same lengths
    and the same container attributes (collate copies a mapping's)."""
    where = path or "the sample"
    if type(got) is not type(want):
        return f"{where} is a {type(got).__name__} where it was a {type(want).__name__}"
    if type(want) is _Field:
        return None if got == want else f"{where} moved"
    if isinstance(want, Mapping):
        keys = list(got.keys())
        if keys != list(want.keys()) or list(map(type, keys)) != list(map(type, want.keys())):
            return f"{where} has keys {keys!r} where it had {list(want.keys())!r}"
        pairs = [(got[k], want[k], f"{path}[{k!r}]") for k in want.keys()]
    elif isinstance(want, Sequence):
        if len(got) != len(want):
            return f"{where} has {len(got)} items where it had {len(want)}"
        pairs = [(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want))]
    else:
        pairs = []
    if not _same_attributes(got, want):
        return f"the attributes of {where} differ"
    return next((d for d in (_difference(*p) for p in pairs) if d is not None), None)


def _named_leaves(obj, prefix=""):
    """(what error messages call it, leaf) for a sample's leaves, in collate's order."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_leaves(value, f"{prefix}[{key!r}]")
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, (str, bytes)):
        for i, value in enumerate(obj):
            yield from _named_leaves(value, f"{prefix}[{i}]")
    else:
        yield (f"field {prefix} of this sample" if prefix else "this sample"), obj


class SampleLayout:
    """Where each field of a batch of up to `capacity` samples lies in a slot."""

    def __init__(self, sample, capacity: int):
        structure, leaves = _flatten(sample)
        for leaf in leaves:
            if collate_may_refuse(leaf):
                default_collate([leaf])  # a leaf torch cannot batch fails with torch's error
        fields = [_leaf_spec(leaf) for leaf in leaves]
        self.kinds = [_leaf_kind(leaf) for leaf in leaves]
        self._structure = pickle.dumps(structure)
        self._skeleton = structure
        self.capacity = capacity
        self.names = [name for name, _ in _named_leaves(sample)]
        if len(self.names) != len(fields):
            self.names = [f"field {i} of this sample" for i in range(len(fields))]
        self.dtypes = [dtype for dtype, _ in fields]
        self.shapes = [shape for _, shape in fields]
        self.row_bytes = [math.prod(shape) * dtype.itemsize for dtype, shape in fields]
        self.offsets = []
        end = 0
        for row_bytes in self.row_bytes:
            offset = aligned(end)
            self.offsets.append(offset)
            end = offset + capacity * row_bytes
        self.slot_bytes = max(end, 1)
        self.sample_bytes = sum(self.row_bytes)
        self._meta: dict[int, bytes] = {}  # nrows -> the metadata (see meta())

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_meta", "_skeleton")}

    def __setstate__(self, state):
        self.__dict__.update(state, _meta={}, _skeleton=pickle.loads(state["_structure"]))

    # ---- worker side --------------------------------------------------------

    def write_row(self, memory, storage, row: int, sample, index) -> None:
        """Copy `sample` (dataset[index]) into row `row` of the slot whose
        SlotMemory and uint8 storage are given; a sample that does not fit
        raises SampleLayoutError, naming its index, before any byte is
        written."""
        try:
            tensors = self._fitted(sample, row == 0)
        except SampleLayoutError as e:
            e.args = (f"{e.args[0]} (the sample is dataset[{index!r}])",)
            raise
        for i, t in enumerate(tensors):
            nbytes = self.row_bytes[i]
            offset = self.offsets[i] + row * nbytes
            if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                copy_stream(memory, offset, t.data_ptr(), nbytes)
            else:
                # set_(storage, offset, size) without a stride (contiguous) is
                # torch's, but its stubs have the overload with a stride only.
                dst = torch.empty((0,), dtype=t.dtype).set_(  # type: ignore[call-overload]
                    storage, offset // t.dtype.itemsize, t.shape
                )
                dst.copy_(t)

    def _fitted(self, sample, first: bool) -> list:
        """The sample's leaves as tensors of its fields' dtypes and shapes
        (`first`: it is its batch's first sample)."""
        try:
            structure, leaves = _flatten(sample)
        except TypeError as e:  # a leaf no collate rule takes (None, say)
            if first:  # torch's collate fails on it the same way
                raise
            where, leaf = next(
                (
                    (name, leaf)
                    for name, leaf in _named_leaves(sample)
                    if not isinstance(leaf, (*_STACKED, str, bytes))
                ),
                ("a field of this sample", None),
            )
            raise SampleLayoutError(
                f"fetch='sample': {where} is a {type(leaf).__name__}, which default_collate "
                "cannot batch, where the loader's first sample had a field of a fixed layout; "
                "every sample must have the first one's fields (use fetch='batch' "
                "otherwise)."
            ) from e
        difference = _difference(structure, self._skeleton)
        if difference is None and len(leaves) != len(self.dtypes):  # a container unseen above
            difference = f"the sample has {len(leaves)} fields where it had {len(self.dtypes)}"
        if difference is not None:
            raise SampleLayoutError(
                f"fetch='sample': {difference} in the loader's first sample; every sample "
                "must have its structure (container types, keys in the same order, lengths), "
                "since batches are laid out from it (use fetch='batch' otherwise)."
            )
        return [self._checked(i, leaf, first) for i, leaf in enumerate(leaves)]

    def _checked(self, i: int, leaf, first: bool) -> torch.Tensor:
        """The leaf as a tensor of field i's dtype and shape (`first`: the
        leaf is the batch's first sample's, whose tensor torch's collate
        makes the batch's from)."""
        dtype, shape, kind = self.dtypes[i], self.shapes[i], self.kinds[i]
        if (
            type(leaf) is torch.Tensor
            and kind == "tensor"
            and leaf.dtype is dtype
            and leaf.shape == shape
            and leaf.device.type == "cpu"
            and leaf.layout == torch.strided
            and not leaf.requires_grad
            and not leaf.is_neg()
            and not leaf.is_conj()
        ):
            return leaf
        got_kind = _leaf_kind(leaf)
        if got_kind != kind:
            raise SampleLayoutError(
                f"fetch='sample': {self.names[i]} is a "
                f"{got_kind}, but the first sample of the loader fixed it as a {kind}; "
                "every sample must match it (use fetch='batch' otherwise)."
            )
        got_dtype, got_shape = _leaf_spec(leaf)
        if got_dtype is not dtype or tuple(got_shape) != tuple(shape):
            raise SampleLayoutError(
                f"fetch='sample': {self.names[i]} is "
                f"{_describe(got_dtype, got_shape)}, but the first sample of the loader fixed "
                f"it as {_describe(dtype, shape)}; every sample must match it (use "
                "fetch='batch' for samples whose shapes or dtypes vary)."
            )
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad or (first and (leaf.is_neg() or leaf.is_conj())):
                # What a worker's default_collate refuses: stacking into shared
                # memory with out= (any sample), a batch tensor made from a
                # negative or conjugate view (the first): torch's own error.
                default_collate([leaf])
            return leaf.detach()
        if isinstance(leaf, (np.ndarray, np.bool_, np.number)):
            return torch.as_tensor(leaf)  # negative strides: torch's ValueError
        return torch.tensor(leaf, dtype=dtype)

    # ---- main side ----------------------------------------------------------

    def meta(self, nrows: int) -> bytes:
        """The batch metadata (see _layout) for a slot whose first nrows rows
        are written."""
        meta = self._meta.get(nrows)
        if meta is None:
            structure = pickle.loads(self._structure)
            meta = self._meta[nrows] = _layout.dumps_refs(
                structure,
                lambda obj: self._ref(obj.number, nrows) if type(obj) is _Field else None,
                nrows,
            )
        return meta

    def _ref(self, i: int, nrows: int):
        dtype, shape = self.dtypes[i], (nrows, *self.shapes[i])
        stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        return _layout.tensor_ref(self.offsets[i], dtype, shape, stride, False, None)

"""fetch="sample": a batch slot filled row by row, one sample per row.

The first sample fixes the batch layout.  torch's own collate, run on that
one sample with every leaf it would stack replaced by a _Field, yields the
structure default_collate builds (dicts, lists, namedtuples, ...) and the
list of fields in the order collate visits them.  Each field gets a region
of the slot holding `capacity` rows of one sample's bytes back to back, so
the batch's tensor for that field is the region's first n rows: exactly the
(n, *shape) tensor default_collate would stack.

Workers flatten every later sample the same way (collate again, recording
leaves), check each leaf against its field, and copy it into its row.  The
main process turns the structure into a batch of views with _layout's slot
references; nothing about the batch is pickled per batch.
"""
from __future__ import annotations

import math
import pickle

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, default_collate_err_msg_format

from . import _layout
from ._arena import ALIGN
from ._ring import copy_stream


class SampleLayoutError(RuntimeError):
    """A sample does not fit the batch layout the first sample fixed."""


class _Field:
    """Placeholder for one stacked leaf in the batch structure."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number


def _describe(dtype, shape) -> str:
    return f"{str(dtype).replace('torch.', '')} of shape {tuple(shape)}"


def _leaf_spec(leaf):
    """(torch dtype, per-sample shape) that default_collate gives this leaf."""
    if isinstance(leaf, torch.Tensor):
        if leaf.layout != torch.strided or leaf.device.type != "cpu" or leaf.is_nested:
            raise SampleLayoutError(
                f"fetch='sample' writes samples into shared memory and needs dense CPU "
                f"tensors, but a sample holds a {leaf.layout} tensor on {leaf.device}; "
                "use fetch='batch'.")
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


def _refuse_text(batch, *, collate_fn_map=None):
    raise SampleLayoutError(
        f"fetch='sample' writes every field of a sample into a fixed-size row of shared "
        f"memory, but a sample holds a {type(batch[0]).__name__} ({batch[0]!r:.40}), "
        "whose size varies; use fetch='batch' (the default) for such samples.")


def _leaf_map(on_leaf):
    """A collate_fn_map sending every leaf default_collate stacks to on_leaf."""
    fn = lambda batch, *, collate_fn_map=None: on_leaf(batch[0])  # noqa: E731
    return {torch.Tensor: fn, np.ndarray: fn, np.bool_: fn, np.number: fn, float: fn,
            int: fn, str: _refuse_text, bytes: _refuse_text}


def _leaves(sample) -> list:
    found = []
    collate([sample], collate_fn_map=_leaf_map(lambda leaf: found.append(leaf)))
    return found


def _paths(obj, prefix=""):
    """Names of a sample's leaves, in collate's order, for error messages."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, f"{prefix}[{key!r}]")
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, (str, bytes)):
        for i, value in enumerate(obj):
            yield from _paths(value, f"{prefix}[{i}]")
    else:
        yield prefix or "the sample"


class SampleLayout:
    """Where each field of a batch of up to `capacity` samples lies in a slot."""

    def __init__(self, sample, capacity: int):
        fields = []

        def add(leaf):
            fields.append(_leaf_spec(leaf))
            return _Field(len(fields) - 1)

        self._structure = pickle.dumps(collate([sample], collate_fn_map=_leaf_map(add)))
        self.capacity = capacity
        self.names = list(_paths(sample))
        if len(self.names) != len(fields):
            self.names = [f"field {i}" for i in range(len(fields))]
        self.dtypes = [dtype for dtype, _ in fields]
        self.shapes = [shape for _, shape in fields]
        self.row_bytes = [math.prod(shape) * dtype.itemsize for dtype, shape in fields]
        self.offsets = []
        end = 0
        for row_bytes in self.row_bytes:
            offset = -(-end // ALIGN) * ALIGN
            self.offsets.append(offset)
            end = offset + capacity * row_bytes
        self.slot_bytes = max(end, 1)
        self.sample_bytes = sum(self.row_bytes)
        self._meta = {}

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_meta"}

    def __setstate__(self, state):
        self.__dict__.update(state, _meta={})

    # ---- worker side --------------------------------------------------------

    def write_row(self, memory, storage, row: int, sample) -> None:
        """Copy `sample` into row `row` of the slot whose SlotMemory and uint8
        storage are given; a sample that does not fit raises SampleLayoutError
        before any byte is written."""
        leaves = _leaves(sample)
        if len(leaves) != len(self.dtypes):
            raise SampleLayoutError(
                f"fetch='sample': this sample has {len(leaves)} fields, but the first sample "
                f"of the loader had {len(self.dtypes)}; samples must share one structure "
                "(use fetch='batch' otherwise).")
        tensors = [self._checked(i, leaf) for i, leaf in enumerate(leaves)]
        for i, t in enumerate(tensors):
            nbytes = self.row_bytes[i]
            offset = self.offsets[i] + row * nbytes
            if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                copy_stream(memory, offset, t.data_ptr(), nbytes)
            else:
                dst = torch.empty((0,), dtype=t.dtype).set_(
                    storage, offset // t.dtype.itemsize, t.shape)
                dst.copy_(t)

    def _checked(self, i: int, leaf) -> torch.Tensor:
        """The leaf as a tensor of field i's dtype and shape."""
        dtype, shape = self.dtypes[i], self.shapes[i]
        if type(leaf) is torch.Tensor and leaf.dtype is dtype and leaf.shape == shape \
                and leaf.device.type == "cpu" and leaf.layout == torch.strided \
                and not leaf.requires_grad:
            return leaf
        got_dtype, got_shape = _leaf_spec(leaf)
        if got_dtype is not dtype or tuple(got_shape) != tuple(shape):
            raise SampleLayoutError(
                f"fetch='sample': field {self.names[i]} of this sample is "
                f"{_describe(got_dtype, got_shape)}, but the first sample of the loader fixed "
                f"it as {_describe(dtype, shape)}; every sample must match it (use "
                "fetch='batch' for samples whose shapes or dtypes vary).")
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                # A worker's default_collate stacks into shared memory with out=,
                # which autograd refuses: the batch fails with torch's own error.
                torch.stack([leaf], out=torch.empty((1, *leaf.shape), dtype=leaf.dtype))
            return leaf.detach()
        if isinstance(leaf, (np.ndarray, np.bool_, np.number)):
            return torch.as_tensor(np.ascontiguousarray(leaf))
        return torch.tensor(leaf, dtype=dtype)

    # ---- main side ----------------------------------------------------------

    def meta(self, nrows: int) -> bytes:
        """The batch metadata (see _layout) for a slot whose first nrows rows
        are written."""
        meta = self._meta.get(nrows)
        if meta is None:
            structure = pickle.loads(self._structure)
            meta = self._meta[nrows] = _layout.dumps_refs(structure, lambda obj: (
                self._ref(obj.number, nrows) if type(obj) is _Field else None), nrows)
        return meta

    def _ref(self, i: int, nrows: int):
        dtype, shape = self.dtypes[i], (nrows, *self.shapes[i])
        stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        count = nrows * self.row_bytes[i] // dtype.itemsize
        return (_layout.TENSOR, self.offsets[i], dtype, shape, stride, count, False)

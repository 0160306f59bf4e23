"""Worker side of a slot: a bump allocator over its bytes, the collate that
stacks samples straight into it, and the placer that _layout uses.

One copy per leaf, as torch's own collate: the default collate stacks samples
into their final place in the slot (instead of into a fresh shared-memory
segment); leaves that are not already in the slot (a custom collate_fn's
output, numpy arrays) are copied in once when the metadata is written.

Sharing is kept as torch's transport keeps it: a leaf that occurs twice is
placed once (and decoded as one object, see _layout), and tensors that view one storage
view one copy of the bytes they span together, with their own offsets and
strides, and share one storage again when decoded, so in-place writes reach each other
and torch.save or deepcopy keep them one.  A tensor alone on its storage
keeps its strides too (transposed, expanded) when it spans all of it, or fewer
bytes than its elements take (expanded over part of it), and is
otherwise copied alone and densely (torch would move its whole storage: all
of a dataset-sized tensor for a sample sliced from it).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.multiprocessing.reductions import reduce_tensor
from torch.utils.data._utils import collate as _torch_collate
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate_fn_map,
)

from .._shm import _layout
from .._shm._ring import copy_stream
from .._shm._slot_rules import copies_as_row, stacks_into_slot

ALIGN = 64  # cache line; also a multiple of every dtype's itemsize


def aligned(offset: int) -> int:
    """offset rounded up to the next multiple of ALIGN."""
    return -(-offset // ALIGN) * ALIGN


def _storage_key(leaf: torch.Tensor) -> int:
    """Which storage a tensor views: the storage itself, not its address, since
    two storages over one memory (torch.from_numpy twice over an array) are
    two under torch's transport, which moves each storage on its own.  (The
    batch's leaves, and so their storages, live while it is placed.)"""
    return leaf.untyped_storage()._cdata


def _bytes_are_values(leaf: torch.Tensor) -> bool:
    """Whether copying the storage bytes a tensor spans copies its values: not
    for an empty one, nor a conjugate or negative view (lazy bits)."""
    return leaf.numel() > 0 and not leaf.is_conj() and not leaf.is_neg()


def _as_torch_sends(leaf: torch.Tensor) -> torch.Tensor:
    """The tensor torch's transport delivers for `leaf`: its storage with its
    offset, shape and strides, without a conjugate or negative view's lazy
    bit (torch's pickling drops it, so the raw storage values arrive)."""
    if leaf.is_conj():
        leaf = leaf.conj()
    if leaf.is_neg():
        leaf = torch._neg_view(leaf)
    return leaf


def _spans_its_storage(leaf: torch.Tensor) -> bool:
    """Whether a tensor spans every byte of its storage (a whole tensor, a
    transposed or an expanded one): its storage's bytes are then copied as
    they are, keeping its strides as torch's transport does."""
    if not _bytes_are_values(leaf):
        return False
    start, end = _byte_range(leaf)
    return start == 0 and end >= leaf.untyped_storage().nbytes()


def _span_is_smaller(leaf: torch.Tensor) -> bool:
    """Whether a tensor spans fewer bytes than its elements take (some
    overlap: a stride of 0, or an as_strided window)."""
    if not _bytes_are_values(leaf):
        return False
    start, end = _byte_range(leaf)
    return end - start < leaf.nbytes


def _byte_range(leaf: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that a tensor spans."""
    # storage_offset() is typed int | SymInt (a symbolic one under tracing); a
    # batch's leaf is a real tensor, whose offset is an int.
    start: int = leaf.storage_offset() * leaf.dtype.itemsize  # type: ignore[assignment]
    return start, start + _layout.span_elements(leaf.shape, leaf.stride()) * leaf.dtype.itemsize


def shared_spans(leaves) -> dict[int, tuple[int, int]]:
    """For each storage that several tensors among `leaves` view (by
    _storage_key), the bytes [first, end) they span together: a slot holds
    one copy of them."""
    views: dict[int, list[tuple[int, int]]] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sent = _as_torch_sends(leaf)
            if _bytes_are_values(sent):
                views.setdefault(_storage_key(sent), []).append(_byte_range(sent))
    spans = {}
    for key, ranges in views.items():
        if len(ranges) > 1:
            first = min(start for start, _ in ranges)
            # Aligned, so that each view keeps its elements' alignment.
            spans[key] = (first - first % ALIGN, max(end for _, end in ranges))
    return spans


class SlotFull(Exception):
    """The batch (data plus metadata) does not fit its slot."""


class Arena:
    """Allocates aligned regions of one slot, front to back, for one batch."""

    def __init__(self, memory, storage: torch.UntypedStorage, reserve: int = 0):
        """`reserve`: bytes at the slot's end that only the metadata may use
        (it carries the worker's state, see _worker_state.STATE_BYTES)."""
        self._memory = memory  # SlotMemory: keeps the mapping alive
        self._storage = storage
        self._base = storage.data_ptr()
        self._capacity = storage.nbytes()
        self._data_capacity = max(0, self._capacity - reserve)
        self.used = 0
        # _storage_key -> [first, end) bytes that its views span together
        self._shared: dict[int, tuple[int, int]] = {}
        self._copies: dict[int, int] = {}  # _storage_key -> slot offset of the copy of those bytes
        self._tensors: list[tuple[int, int]] = []  # [start, end) of each tensor() made, in order
        # id(leaf) -> (offset, bytes) of the tensor() that it and other leaves view
        self._tensor_shared: dict[int, tuple[int, int]] = {}

    def _alloc(self, nbytes: int, capacity: int | None = None) -> int:
        capacity = self._data_capacity if capacity is None else capacity
        offset = aligned(self.used)
        if offset + nbytes > capacity:
            raise SlotFull(f"{offset + nbytes} bytes needed, slot holds {capacity}")
        self.used = offset + nbytes
        return offset

    def tensor(self, dtype: torch.dtype, shape, stride=None) -> torch.Tensor:
        """An uninitialised tensor living in the slot."""
        if stride is None:
            stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        nbytes = _layout.span_elements(shape, stride) * dtype.itemsize
        offset = self._alloc(nbytes)
        self._tensors.append((offset, offset + nbytes))
        return torch.empty((0,), dtype=dtype).set_(
            self._storage, offset // dtype.itemsize, shape, stride
        )

    def stack(self, batch) -> torch.Tensor:
        """torch.stack(batch) into the slot.  Large rows that are plain
        contiguous copies of the first one's layout are copied bypassing the
        cache (see streams_rows); anything else (and every error) is
        torch.stack's."""
        elem = batch[0]
        out = self.tensor(elem.dtype, (len(batch), *elem.shape))
        if not streams_rows(batch):
            return torch.stack(batch, 0, out=out)
        nbytes = elem.nbytes
        offset = out.storage_offset() * elem.dtype.itemsize
        for i, t in enumerate(batch):
            copy_stream(self._memory, offset + i * nbytes, t.data_ptr(), nbytes)
        return out

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self._base

    def place_all(self, leaves) -> list:
        """The slot references for a batch's leaves (each object once, in
        the order its pickling met them), copying into the slot those not
        already in it."""
        self._note_shared_storages(leaves)
        return [self.place(leaf) for leaf in leaves]

    def _note_shared_storages(self, leaves) -> None:
        """Note the storages that several of the leaves view, and the bytes
        they span together, before place() meets them one by one; and the
        tensors stacked in the slot that several leaves view (a collate
        function's x and x[0]): torch's transport gives such leaves one
        storage, so that a write through one shows through the others."""
        owned: list[torch.Tensor] = []
        others: list[torch.Tensor] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                (owned if self.owns(leaf) else others).append(leaf)
        self._shared = shared_spans(others)
        self._tensor_shared = {}
        if len(owned) > 1:
            starts = [start for start, _ in self._tensors]
            views: dict[int, list[int]] = {}
            for leaf in owned:
                start, _ = _byte_range(leaf)
                views.setdefault(bisect.bisect_right(starts, start) - 1, []).append(id(leaf))
            for made, ids in views.items():
                if len(ids) > 1:
                    start, end = self._tensors[made]
                    self._tensor_shared.update(dict.fromkeys(ids, (start, end - start)))

    def place(self, leaf):
        """The slot reference for `leaf`, copying it into the slot if needed."""
        if isinstance(leaf, np.ndarray):
            offset = self._alloc(leaf.nbytes)
            # Fortran order stays Fortran order, as numpy's pickling keeps it.
            order = "F" if leaf.flags.f_contiguous and not leaf.flags.c_contiguous else "C"
            view = np.ndarray(
                leaf.shape, leaf.dtype, buffer=self._memory, offset=offset, order=order
            )
            view[...] = leaf
            # The dtype itself: its .str would drop a structured dtype's fields.
            return _layout.array_ref(offset, leaf.dtype, view.shape, view.strides)
        if leaf.requires_grad and not leaf.is_leaf:
            reduce_tensor(leaf)  # raises torch's error: its pickling refuses such a tensor
        storage = None  # (offset, size) of the bytes it shares with other leaves
        if self.owns(leaf):
            leaf_ref = leaf  # stacked by SlotCollate
            storage = self._tensor_shared.get(id(leaf))
        elif (
            key := _storage_key(leaf := _as_torch_sends(leaf))
        ) in self._shared or _spans_its_storage(leaf):
            leaf_ref = self._in_storage_copy(leaf)
            if key in self._shared:
                first, end = self._shared[key]
                storage = (self._copies[key], end - first)
        elif _span_is_smaller(leaf):
            # A part of its storage, alone, whose elements overlap (expanded
            # over part of it): the bytes it spans, strides kept, as torch
            # keeps them (a dense copy would repeat them, to any size).
            leaf_ref = self._in_storage_copy(leaf)
        else:
            # A part of its storage, alone: densely, in the layout torch's
            # pickling would keep (channels_last stays channels_last); an
            # empty one keeps its strides, as torch's does.
            stride = (
                leaf.stride()
                if leaf.numel() == 0
                else torch.empty_like(leaf, device="meta").stride()
            )
            copy = self.tensor(leaf.dtype, leaf.shape, stride)
            with torch.no_grad():
                copy.copy_(leaf)
            leaf_ref = copy
        return _layout.tensor_ref(
            leaf_ref.storage_offset() * leaf.dtype.itemsize,
            leaf.dtype,
            leaf.shape,
            leaf_ref.stride(),
            leaf.requires_grad,
            storage,
        )

    def _in_storage_copy(self, leaf: torch.Tensor) -> torch.Tensor:
        """`leaf` as a view, with its own strides, of the slot's one copy of
        the bytes that its storage's views span (copied at the first)."""
        key = _storage_key(leaf)
        own = _byte_range(leaf)
        first, end = self._shared.get(key, own)
        base = self._copies.get(key)
        if base is None:
            base = self._copies[key] = self._alloc(end - first)
            copy_stream(self._memory, base, leaf.untyped_storage().data_ptr() + first, end - first)
        start = base + own[0] - first
        return torch.empty((0,), dtype=leaf.dtype).set_(
            self._storage, start // leaf.dtype.itemsize, leaf.shape, leaf.stride()
        )

    def write_meta(self, meta: bytes) -> tuple[int, int]:
        offset = self._alloc(len(meta), self._capacity)
        self._memory.write(offset, meta)
        return offset, len(meta)


# Rows of at least this many bytes are copied with non-temporal stores: a batch
# of them outgrows the caches, which such stores neither read into nor evict the
# worker's data from.  Smaller rows go through torch.stack, one call for the
# batch, where a call per row costs more than the copy (with a call per row,
# the benchmark's limit on 64-row batches of 1 KiB ran at a third of its rate).
STREAM_ROW_BYTES = 64 * 1024


def streams_rows(batch) -> bool:
    """Whether a batch of tensors is stacked row by row with non-temporal
    stores: rows that large, each a plain copy of the first one's layout."""
    elem = batch[0]
    return elem.nbytes >= STREAM_ROW_BYTES and all(copies_as_row(t, elem) for t in batch)


class Measure:
    """A placer that only counts the bytes a batch would take in a slot: it
    sizes the ring from the first batches, before any slot exists."""

    def __init__(self):
        self.used = 0

    def place_all(self, leaves) -> list:
        """The bytes Arena.place_all would take: a leaf alone densely, one
        spanning its storage with its storage's bytes, leaves viewing one
        storage with the bytes they span together, once; each with a
        reference at least as long as the real one will be (offsets no
        smaller), so that the metadata is measured too."""
        shared = shared_spans(leaves)
        copies = {}  # _storage_key -> (slot offset, bytes) of its views' one copy
        refs = []
        for leaf in leaves:
            offset = aligned(self.used)
            if isinstance(leaf, np.ndarray):
                self.used = offset + leaf.nbytes
                refs.append(_layout.array_ref(offset, leaf.dtype, leaf.shape, leaf.strides))
                continue
            sent = _as_torch_sends(leaf)
            key = _storage_key(sent)
            if key in shared:
                if key not in copies:
                    first, end = shared[key]
                    copies[key] = (offset, end - first)
                    self.used = offset + end - first
                storage = copies[key]
                offset = sum(storage)  # past any view's own offset in the copy
            else:
                start, end = _byte_range(sent)
                spanned = _spans_its_storage(sent) or _span_is_smaller(sent)
                self.used = offset + (end - start if spanned else leaf.nbytes)
                storage = (offset, leaf.nbytes)  # (where Arena's is None: longer)
            refs.append(
                _layout.tensor_ref(
                    offset, leaf.dtype, leaf.shape, leaf.stride(), leaf.requires_grad, storage
                )
            )
        return refs


def slot_bytes_needed(batch, owns=None) -> int:
    measure = Measure()
    meta = _layout.dumps(batch, measure.place_all, 0, owns=owns)
    return aligned(measure.used) + len(meta)


def changed_collation() -> str | None:
    """Which entry of default_collate_fn_map a user set (torch's own are all
    functions of its collate module), or None."""
    for key, fn in default_collate_fn_map.items():
        if getattr(fn, "__module__", None) != _torch_collate.__name__:
            return f"its entry for {key!r} is {fn!r}"
    return None


class SlotCollate:
    """torch's default_collate, except that stacked tensors are allocated in
    the current slot.  With no slot (ring not sized yet, or every slot held),
    in this process's own memory, not in torch's shared memory (/dev/shm):
    the batch is then copied into a one-off segment (see _one_off.py).  Where
    default_collate_fn_map collates tensors otherwise it is default_collate
    (its output is then copied into the slot)."""

    def __init__(self) -> None:
        self.arena: Arena | None = None

    def __call__(self, batch):
        # The map as it is now: the user may change it, as torch's
        # default_collate follows it.
        fn_map = dict(default_collate_fn_map)
        if fn_map.get(torch.Tensor) is collate_tensor_fn:
            fn_map[torch.Tensor] = self._collate_tensor
        return collate(batch, collate_fn_map=fn_map)

    def _collate_tensor(self, batch, *, collate_fn_map=None):
        elem = batch[0]
        if not stacks_into_slot(elem):
            return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        try:
            if self.arena is not None:
                try:
                    return self.arena.stack(batch)
                except SlotFull:
                    # The batch outgrew the slot: it is delivered whole outside
                    # the ring (the caller notices arena is None and counts a
                    # spill), the rest of it stacked here.  Not collated again
                    # from its start: the user's collate functions would run
                    # twice (and draw twice from the RNGs).
                    self.arena = None
            # Into a tensor of the first sample's dtype and a contiguous
            # layout, as torch's collate in a worker stacks (into shared
            # memory, which this batch gets a copy in): a plain stack would
            # promote mixed dtypes and keep channels_last.
            out = torch.empty((len(batch), *elem.shape), dtype=elem.dtype)
            return torch.stack(batch, 0, out=out)
        except (TypeError, RuntimeError):
            # torch's collate in a worker first counts every sample's
            # elements: a sample that is no tensor (None) fails there, with
            # its AttributeError, before any stacking error.
            for sample in batch:
                sample.numel()
            raise

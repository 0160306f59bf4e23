"""What a slot can hold: the one place that decides which leaves of a batch
live in a slot, and which of them are copied there as raw bytes.

NOTE [slot rules]
Three questions, asked by three modules, answered here so that they cannot
drift apart:

- Which leaves a slot holds at all (is_slot_tensor, is_slot_ndarray): _layout
  places exactly these in the slot and sends every other leaf through torch's
  own pickling (contract 2), and refuses a reference naming a dtype that no
  placed leaf can have (QUANTIZED).
- Which rows are stacked into a slot as raw bytes (stacks_into_slot,
  copies_as_row): _arena's SlotCollate stacks a batch into its slot only
  where torch's collate would give the same tensor, and copies large rows
  with non-temporal stores only where a byte copy is what torch.stack does.
- Which sample leaves torch.stack batches like any other (PLAIN_DTYPES,
  collate_may_refuse): fetch="sample" (_sample_layout) runs torch's own
  collate once on any other tensor leaf of the first sample, so that one
  torch cannot batch fails with torch's error.

The sets differ on purpose: PLAIN_DTYPES is the dtypes known to stack as
any other, a subset of those a slot holds (tests/unit/test_slots.py checks it);
a slot also holds the rarer ones (float8, complex32, ...), which torch's
collate decides on.
"""

from __future__ import annotations

import numpy as np
import torch

# A quantized dtype over raw bytes is a tensor with no quantizer: reading it
# segfaults inside torch.  is_slot_tensor never places one, so a reference
# naming one is corrupt (_layout refuses it).
QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _has_no_typed_storage(dtype) -> bool:
    try:
        torch._utils._element_size(dtype)
    except TypeError:
        return True
    return False


# Dtypes a slot never holds, so that they take torch's own paths, failing or
# working as torch's do: bit and sub-byte dtypes (bits8, uint4, ...), whose
# shared storage torch's default collate cannot make (a TypeError), and the
# quantized ones, even over plain bytes (t.view(torch.quint8)).
_NOT_IN_SLOTS = QUANTIZED | frozenset(
    dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype) and _has_no_typed_storage(dtype)
)


def is_slot_tensor(obj) -> bool:
    """A tensor whose bytes can live in a slot: plain, dense, strided, CPU,
    of a plain dtype torch's collate can stack."""
    return (
        type(obj) is torch.Tensor
        and obj.layout == torch.strided
        and obj.device.type == "cpu"
        and not obj.is_nested
        and not obj.is_quantized
        and not obj.is_meta
        and obj.dtype not in _NOT_IN_SLOTS
    )


def is_slot_ndarray(obj) -> bool:
    """A numpy array of plain numbers (no objects), which a slot can hold."""
    return type(obj) is np.ndarray and not obj.dtype.hasobject


def stacks_into_slot(elem) -> bool:
    """Whether a batch whose first sample is `elem` is stacked into its slot
    by SlotCollate.  Not a conjugate or negative view: torch's collate raises
    for one first in a worker (at elem.new(storage)), where a stack into the
    slot would not."""
    return is_slot_tensor(elem) and not elem.is_conj() and not elem.is_neg()


def copies_as_row(t, elem) -> bool:
    """A row `t` of a batch whose first row is `elem` that a raw byte copy
    stacks exactly as torch.stack would."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and t.device.type == "cpu"
        and t.dtype == elem.dtype
        and t.shape == elem.shape
        and t.is_contiguous()
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


# Dtypes torch.stack batches like any other; a tensor of another dtype (bits,
# sub-byte, ...) or layout goes through torch's own collate once first.
PLAIN_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)


def collate_may_refuse(leaf) -> bool:
    """Whether torch's worker collate might refuse this sample leaf (a
    tensor only): running it on every first sample would cost a
    shared-memory segment (milliseconds in a fresh worker) on the path to
    the first batch."""
    return isinstance(leaf, torch.Tensor) and not (
        leaf.layout == torch.strided
        and leaf.dtype in PLAIN_DTYPES
        and not leaf.is_nested
        and not leaf.is_conj()
        and not leaf.is_neg()
    )

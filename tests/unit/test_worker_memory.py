"""Workers keep the memory of freed samples (shmloader/_worker/_malloc.py): a block that
glibc would otherwise map afresh and unmap for every sample comes from the heap,
so no batch pays page faults for memory the previous one gave back."""

import ctypes

import pytest
import torch
from torch.utils.data import Dataset

from shmloader import DataLoader

BLOCK = 24 * 2**20  # above glibc's initial 128 KiB mmap threshold, below its 32 MiB maximum


def _in_heap(address) -> bool:
    """Whether `address` lies in the heap: in any of its mappings (a process forked
    from another, as from a forkserver, has its heap in two once it grows it)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                low, high = (int(n, 16) for n in line.split()[0].split("-"))
                if low <= address < high:
                    return True
    return False


class MallocProbe(Dataset):
    """Sample i: whether a fresh BLOCK-byte malloc in this process came from the heap
    (kept and reused) rather than from a mapping of its own (unmapped when freed)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        address = libc.malloc(BLOCK)
        try:
            return torch.tensor(_in_heap(address))
        finally:
            libc.free(address)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver", "fork"])
def test_worker_malloc_keeps_freed_memory(context):
    """A worker starts with glibc's defaults (its mmap threshold is below BLOCK): only
    keep_freed_memory puts BLOCK on the heap."""
    got = torch.cat(
        list(
            DataLoader(MallocProbe(), batch_size=2, num_workers=2, multiprocessing_context=context)
        )
    )
    assert got.tolist() == [True] * 4


@pytest.mark.slow
def test_worker_init_fn_may_set_its_own_malloc_options():
    got = torch.cat(
        list(
            DataLoader(
                MallocProbe(),
                batch_size=2,
                num_workers=2,
                multiprocessing_context="spawn",
                worker_init_fn=_default_mmap_threshold,
            )
        )
    )
    assert got.tolist() == [False] * 4


def _default_mmap_threshold(worker_id):
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: glibc's default

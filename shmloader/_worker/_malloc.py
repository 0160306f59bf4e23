"""Workers keep the memory of freed samples for the next ones.

glibc's malloc serves allocations above its mmap threshold (128 KiB at first, raised
as such blocks are freed) with fresh mmaps, unmaps them when freed, and gives the top
of its heap back to the kernel once enough of it is free.  A worker that builds a
sample of a few images, boxes and masks, or decodes a JPEG, then frees it, can so lose
its memory on every batch and fault it in again, page by page, for the next one:
thousands of page faults a batch, and about a third of the throughput on the
benchmark's multi-field workload in the runs where it happened.  Which runs it happens
in depends on what else lies at the top of the heap.  Each worker therefore asks glibc
(other allocators are left as they are) to keep freed memory: blocks up to the largest
mmap threshold it accepts come from the heap, and the heap is never trimmed.  A
worker's memory then stays at its high-water mark instead of going up and down with
every sample.  A worker_init_fn runs after this and may set other values.
"""

import ctypes

# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on
# 64-bit systems: allocations below it come from the heap, which can be reused.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20
NEVER = -1  # as M_TRIM_THRESHOLD: never give the top of the heap back to the kernel


# Looked up once, where the worker code is imported (a server's workers fork
# with it): a lookup in each worker costs ~0.25 ms, 100 pages copied on write.
_mallopt = getattr(ctypes.CDLL(None), "mallopt", None)


def keep_freed_memory() -> None:
    """Have malloc (glibc's; others are left as they are) keep the memory of freed
    samples for the next ones, in this process."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        _mallopt(M_TRIM_THRESHOLD, NEVER)

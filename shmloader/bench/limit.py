"""The transport-free limit: the loaders' worker-side work with no hand-off at all.

As many processes as the loaders have workers, started by multiprocessing's default
method (what torch and shmloader use when multiprocessing_context is None), take the
same batches of indices in the same round-robin order, fetch them from the same dataset
object with torch's own fetcher (the dataset's __getitem__ for every index), and collate
them as torch's default_collate does - but into a shared-memory buffer of their own,
allocated and touched before any timing and reused by every batch. Nothing reaches the
main process except one message per worker per epoch, so the limit is the cost of the
work itself: a loader's fraction of it says how much its transport costs. Tensor leaves
are stacked as shmloader's workers stack them, the cheaper of the two loaders' copies:
large rows of one plain layout with non-temporal stores (cheaper than torch.stack for
samples of megabytes), anything else with torch.stack(..., out=...) as torch's collate does.

One thing is not left to chance: whether malloc hands a batch's freed samples back to
the kernel, to be faulted in again, page by page, by the next batch's. That depends on
what else happens to lie at the top of the heap (this loop, left alone, lost it on every
batch and ran at a fifth of its speed on 12 MB samples). The limit's workers therefore
tell malloc to keep freed memory, as shmloader's workers do (shmloader/_worker/_malloc.py);
torch's workers leave malloc as it is.
"""

import contextlib
import multiprocessing
import time
from math import prod
from typing import Any

import torch
from torch.utils.data import _DatasetKind
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from .._shm._ring import Ring, copy_stream
from .._shm._segment import SHM_DIR
from .._worker._arena import streams_rows
from .._worker._malloc import keep_freed_memory
from .errors import BenchmarkError
from .measure import Epoch, Spec, consume

LIMIT = "limit"  # the transport-free limit's name in epochs, records and charts
ALIGN = 64  # bytes: each leaf starts on a cache line, as in shmloader's slots


def buffer_bytes(spec: Spec) -> int:
    """Bytes that the tensor leaves of a batch with layout `spec` take, each aligned."""
    return sum(-(-prod(shape) * dtype.itemsize // ALIGN) * ALIGN for _, shape, dtype in spec)


class BufferCollate:
    """torch's default_collate, except that every tensor it makes is placed in one
    preallocated buffer, front to back, overwriting the previous batch."""

    def __init__(self, memory: Any):
        self._memory = memory  # a slot's memory (shmloader's Ring), for copy_stream
        self._buffer = torch.frombuffer(memory, dtype=torch.uint8)
        self._buffer.fill_(0)  # fault every page in now, not in the first timed epoch
        self._used = 0
        self._map = {
            **default_collate_fn_map,
            torch.Tensor: self._stack,
            int: self._numbers,
            float: self._numbers,
        }

    def __call__(self, samples: list) -> Any:
        self._used = 0
        return collate(samples, collate_fn_map=self._map)

    def _take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        start = -(-self._used // ALIGN) * ALIGN
        self._used = start + prod(shape) * dtype.itemsize
        if self._used > self._buffer.numel():
            raise RuntimeError(
                f"a batch needs more than the {self._buffer.numel()} bytes sized from the first one"
            )
        return self._buffer[start : self._used].view(dtype).view(shape)

    def _stack(self, batch: list[torch.Tensor], *, collate_fn_map=None) -> torch.Tensor:
        # What collate_tensor_fn does in a worker, with this buffer as `out`; plain rows
        # copied as shmloader's workers copy them (see _arena.Arena.stack).
        elem = batch[0]
        out = self._take(elem.dtype, (len(batch), *elem.shape))
        if not streams_rows(batch):
            return torch.stack(batch, 0, out=out)
        offset = out.data_ptr() - self._buffer.data_ptr()
        for i, row in enumerate(batch):
            copy_stream(self._memory, offset + i * elem.nbytes, row.data_ptr(), elem.nbytes)
        return out

    def _numbers(self, batch: list, *, collate_fn_map=None) -> torch.Tensor:
        made = default_collate_fn_map[type(batch[0])](batch)  # torch.tensor(batch), as torch does
        return self._take(made.dtype, tuple(made.shape)).copy_(made)


def _worker(dataset: Any, batches: list[list[int]], nbytes: int, spec: Spec, conn: Any) -> None:
    """Allocate and touch the buffer, then run an epoch of `batches` per request."""
    torch.set_num_threads(1)  # as torch's worker loop (and shmloader's) does
    keep_freed_memory()
    ring = Ring.create_in(SHM_DIR, 1, nbytes)  # shared memory as a loader's slot is
    ring.reserve(0)
    fetcher = _DatasetKind.create_fetcher(
        _DatasetKind.Map,
        dataset,
        auto_collation=True,
        collate_fn=BufferCollate(ring.memory(0)),
        drop_last=False,
    )
    try:
        conn.send("ready")
        while conn.recv():
            conn.send(_epoch(fetcher, batches, spec))
    except KeyboardInterrupt:
        pass  # Ctrl-C reaches the whole process group: the main process reports it


def _epoch(fetcher: Any, batches: list[list[int]], spec: Spec) -> tuple[int, int]:
    """Fetch and collate every batch; returns (samples, bytes) of the epoch."""
    samples = total_bytes = 0
    for indices in batches:
        batch_samples, batch_bytes = consume(fetcher.fetch(indices), spec)
        samples += batch_samples
        total_bytes += batch_bytes
    return samples, total_bytes


class TransportFreeLimit:
    """The worker processes of the limit; epoch() runs one epoch of every worker and
    times it from the main process. Use as a context manager: exiting stops them."""

    def __init__(self, dataset: Any, batches: list[list[int]], num_workers: int, spec: Spec):
        self._batches = len(batches)
        context = multiprocessing.get_context()
        self._conns, self._processes = [], []
        for worker_id in range(num_workers):
            conn, child_conn = context.Pipe()
            # Round robin from worker 0, as both loaders dispatch an epoch's batches.
            process = context.Process(
                target=_worker,
                daemon=True,
                args=(
                    dataset,
                    batches[worker_id::num_workers],
                    buffer_bytes(spec),
                    spec,
                    child_conn,
                ),
            )
            process.start()
            child_conn.close()
            self._conns.append(conn)
            self._processes.append(process)
        for worker_id in range(num_workers):
            self._receive(worker_id)  # "ready": its buffer is allocated and touched

    def epoch(self) -> Epoch:
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        for conn in self._conns:
            conn.send(True)
        results = [self._receive(worker_id) for worker_id in range(len(self._conns))]
        wall_s = time.perf_counter() - wall_start
        return Epoch(
            wall_s,
            time.process_time() - cpu_start,
            self._batches,
            sum(samples for samples, _ in results),
            sum(nbytes for _, nbytes in results),
        )

    def _receive(self, worker_id: int) -> Any:
        try:
            return self._conns[worker_id].recv()
        except EOFError:  # the worker is gone; its traceback, if any, is on stderr
            process = self._processes[worker_id]
            process.join()
            raise BenchmarkError(
                f"limit worker {worker_id} (pid {process.pid}) exited with code {process.exitcode}"
            ) from None

    def __enter__(self) -> "TransportFreeLimit":
        return self

    def __exit__(self, *exc_info) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):  # a worker that died has closed its end
                conn.send(False)
        for process in self._processes:
            process.join()

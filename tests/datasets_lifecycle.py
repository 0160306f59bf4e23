"""Module-level datasets for failure tests (picklable for spawn/forkserver)."""

import multiprocessing.util
import os
import signal
import time

import torch
from torch.utils.data import Dataset, Sampler


class Images(Dataset):
    """Small deterministic uint8 'images'."""

    def __init__(self, n, shape=(3, 8, 8)):
        self.n = n
        self.shape = shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full(self.shape, i % 251, dtype=torch.uint8)


class Buckets(Sampler):
    """A bucketing batch sampler's batches: 2 to 60 samples, a large one before a larger one."""

    def __init__(self, sizes=(2, 40, 4, 60, 2, 60, 8, 1)):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)

    def __iter__(self):
        start = 0
        for n in self.sizes:
            yield list(range(start, start + n))
            start += n


class WorkerTempDirs(Images):
    """An image and the path of its worker's multiprocessing temp dir, which the
    worker makes as torch's fd sharing does."""

    def __getitem__(self, i):
        return super().__getitem__(i), multiprocessing.util.get_temp_dir()


class Failing(Dataset):
    def __init__(self, n, bad):
        self.n = n
        self.bad = bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        return i


class Dying(Dataset):
    """Its worker dies at sample `at`: by `signum`, or os._exit(1) for 0."""

    def __init__(self, n, at, signum):
        self.n = n
        self.at = at
        self.signum = signum

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at:
            if self.signum:
                os.kill(os.getpid(), self.signum)
                time.sleep(5)
            os._exit(1)
        return i


class Sleepy(Dataset):
    def __init__(self, n, seconds):
        self.n = n
        self.seconds = seconds

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return i


class Rows(Dataset):
    """Samples a raw row copy must not be used for: `kind` picks which."""

    def __init__(self, n, kind):
        self.n = n
        self.kind = kind

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i
        if self.kind == "transposed":
            return base.transpose(0, 2)
        if self.kind == "conj":
            return torch.complex(base, -base).conj()
        if self.kind == "grad":
            return base.requires_grad_()
        if self.kind == "mixed_dtype":
            return base.double() if i % 2 else base
        if self.kind == "mixed_shape":
            return base if i % 3 else base[:1]
        return base


# ---- faults that fire once, for tests/kill_driver.py --------------------------
# The first process to create `stamp` (O_EXCL) fires the fault, after writing
# "<time.monotonic()> <pid>" there; every later call, in any process, does not.
# So the fault is transient (one bad read, one OOM kill) and the next epoch,
# with fresh or persistent workers, must work.  time.monotonic() is
# CLOCK_MONOTONIC, the same clock in every process, so the main process can
# measure how long after the fault its error came.

from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402  (this part of the file only)


def _fire_once(stamp):
    try:
        fd = os.open(stamp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{time.monotonic()!r} {os.getpid()}\n".encode())
    finally:
        os.close(fd)
    return True


class FaultOnce(Dataset):
    """Ints 0..n-1; loading sample `at` fails once, by `how`: "sigkill",
    "sigsegv" (a real segfault: a read at address 0), "exit" (os._exit(1)) or
    "raise" (ValueError)."""

    def __init__(self, n, at, how, stamp):
        self.n = n
        self.at = at
        self.how = how
        self.stamp = stamp

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and _fire_once(self.stamp):
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(10)
            elif self.how == "sigsegv":
                import ctypes

                ctypes.string_at(0)
                time.sleep(10)
            elif self.how == "exit":
                os._exit(1)
            raise ValueError(f"sample {i} is broken (FaultOnce)")
        return i


class InitFailsOnce:
    """A worker_init_fn: worker `worker_id` raises LookupError, once."""

    def __init__(self, worker_id, stamp):
        self.worker_id = worker_id
        self.stamp = stamp

    def __call__(self, worker_id):
        if worker_id == self.worker_id and _fire_once(self.stamp):
            raise LookupError(f"worker_init_fn failed in worker {worker_id} (InitFailsOnce)")


class StreamFailsOnce(IterableDataset):
    """Ints 0..n-1 sharded by get_worker_info(); __iter__ of worker
    `bad_worker` raises KeyError once, before returning an iterator."""

    def __init__(self, n, bad_worker, stamp):
        self.n = n
        self.bad_worker = bad_worker
        self.stamp = stamp

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if wid == self.bad_worker and _fire_once(self.stamp):
            raise KeyError(f"__iter__ failed in worker {wid} (StreamFailsOnce)")
        return iter(range(wid, self.n, nw))

"""Module-level datasets for failure tests (picklable for spawn/forkserver)."""
import os
import signal
import time

import torch
from torch.utils.data import Dataset


class Images(Dataset):
    """Small deterministic uint8 'images'."""

    def __init__(self, n, shape=(3, 8, 8)):
        self.n = n
        self.shape = shape

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full(self.shape, i % 251, dtype=torch.uint8)


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

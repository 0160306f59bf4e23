"""Warnings that point at the user's line, past shmloader's and torch's loader frames."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from types import FrameType
from typing import TYPE_CHECKING

import torch.utils.data
from torch.utils.data import dataloader as torch_dataloader

from .._errors import ShmloaderWarning

if TYPE_CHECKING:
    from ._stats import Counters

# shmloader's package (every subpackage of it) and torch's loader.
_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(__file__)),
    os.path.dirname(torch.utils.data.__file__),
)


def warn(
    message: str, category: type[Warning] = ShmloaderWarning, also_past: tuple[str, ...] = ()
) -> None:
    """warnings.warn(message), naming the first frame that is not shmloader's,
    torch's loader's, or in one of the folders `also_past` (a framework's)."""
    internal = _INTERNAL_DIRS + also_past
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


# torch's loader warns with stacklevel=2, naming the frame that called the
# method that warns: torch's own loader, for the calls that shmloader makes in
# its place (an iterator's super().__init__, check_worker_number_rationality).
# Those calls are made from a function compiled as if it stood on torch's line
# that makes the same call, in torch's module, so that such a warning names the
# same file, line and module as torch's (filters by module, such as
# filterwarnings(..., module="torch.utils.data"), treat both alike).
def _torch_line(owner, call: str) -> int:
    """The line of torch's source of `owner` that reads `call` (its first
    line, should a torch version word it otherwise)."""
    lines, first = inspect.getsourcelines(owner)
    return next((first + i for i, line in enumerate(lines) if line.strip() == call), first)


@functools.cache
def _caller_at(owner, call: str):
    namespace = {"__name__": torch_dataloader.__name__}
    source = "\n" * (_torch_line(owner, call) - 1) + "def call(f, *args): return f(*args)\n"
    exec(compile(source, inspect.getfile(owner), "exec"), namespace)
    return namespace["call"]


def init_as_torch(function, *args):
    """function(*args) as _MultiProcessingDataLoaderIter's super().__init__."""
    caller = _caller_at(
        torch_dataloader._MultiProcessingDataLoaderIter.__init__, "super().__init__(loader)"
    )
    return caller(function, *args)


def check_workers_as_torch(function):
    """function() as DataLoader._get_iterator's worker-number check."""
    caller = _caller_at(
        torch_dataloader.DataLoader._get_iterator, "self.check_worker_number_rationality()"
    )
    return caller(function)


def warn_as_torch_worker_start(message: str) -> None:
    """warnings.warn(message) as _MultiProcessingDataLoaderIter.__init__
    warns while starting a worker (stacklevel=2): at the line of torch's
    DataLoader._get_iterator that makes that iterator."""
    owner = torch_dataloader.DataLoader._get_iterator
    warnings.warn_explicit(
        message,
        UserWarning,
        inspect.getfile(owner),
        _torch_line(owner, "return _MultiProcessingDataLoaderIter(self)"),
        module=torch_dataloader.__name__,
        registry=vars(torch_dataloader).setdefault("__warningregistry__", {}),
        module_globals=vars(torch_dataloader),
    )


class DeferredWarnings:
    """An iterator's warnings: one that filters turn into an error (pytest -W
    error) is kept, and raised by the next next() before it takes anything,
    or in place of the epoch's StopIteration, so no batch or task in flight
    is lost.  One whose error is never raised (the iterator is reset or
    dropped first) clears its once-only flag on the loader's counters, so it
    comes again."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters  # the loader's: its once-only flags
        # (error, its flag); next() looks at it before each batch
        self.errors: list[tuple[Warning, str | None]] = []

    def warn(self, message: str, flag: str | None = None) -> None:
        try:
            warn(message)
        except Warning as error:
            # Without its traceback, whose frames hold the iterator: kept, it
            # would make a cycle that only the garbage collector ends, and an
            # iterator left with it unraised (a break) would keep its workers.
            self.errors.append((error.with_traceback(None), flag))

    def raise_first(self) -> None:
        raise self.errors.pop(0)[0]

    def forget(self) -> None:
        for _, flag in self.errors:
            if flag is not None:
                setattr(self.counters, flag, False)
        self.errors = []

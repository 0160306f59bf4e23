"""Warnings that point at the user's line, past shmloader's and torch's loader frames."""
from __future__ import annotations

import os
import sys
import warnings

import torch.utils.data

_INTERNAL_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.utils.data.__file__))


def warn(message: str) -> None:
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


# torch's loader warns with stacklevel=2, naming the frame that called the
# method that warns: torch's own loader, for the calls that shmloader makes in
# its place (super().__init__ of an iterator, check_worker_number_rationality).
# Made through call_as_torch, such a warning names torch's loader module as
# torch's does, so filters by module (filterwarnings(..., module="torch.utils.data"))
# treat it alike.  (The frame's file stays this one.)
_as_torch: dict = {"__name__": "torch.utils.data.dataloader"}
exec(compile("def call_as_torch(function, *args):\n    return function(*args)\n",
             __file__, "exec"), _as_torch)
call_as_torch = _as_torch["call_as_torch"]


class WarnsBetweenBatches:
    """For iterators: a warning that filters turn into an error (pytest -W
    error) is raised by the next next() before it takes anything, or in place
    of the epoch's StopIteration, so no batch or task in flight is lost.  One
    whose error is never raised (the iterator is reset or dropped first)
    clears its once-only flag on the loader's counters, so it comes again."""

    def _warn(self, message: str, flag: str | None = None) -> None:
        try:
            warn(message)
        except Warning as error:
            # Without its traceback, whose frames hold this iterator: kept, it
            # would make a cycle that only the garbage collector ends, and an
            # iterator left with it unraised (a break) would keep its workers.
            self._deferred_warnings.append((error.with_traceback(None), flag))

    def _raise_deferred_warning(self) -> None:
        raise self._deferred_warnings.pop(0)[0]

    def _forget_deferred_warnings(self) -> None:
        for _, flag in self._deferred_warnings:
            if flag is not None:
                setattr(self._counters, flag, False)
        self._deferred_warnings = []

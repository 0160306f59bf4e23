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


def warn_between_batches(message: str) -> Warning | None:
    """warn(message), except that where warning filters turn it into an error
    (pytest -W error), the error is returned instead of raised: the iterator
    raises it before its next batch, so no batch or task in flight is lost."""
    try:
        warn(message)
    except Warning as error:
        return error
    return None

"""The two ways a measurement fails, the user's traceback, and the optional packages it
may need."""

import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType

# The optional dependencies of the measuring code: pyproject.toml's `bench` extra.
INSTALL_EXTRA = 'pip install "shmloader[bench]"'


class BenchmarkError(RuntimeError):
    """A loader yielded something other than what the reference loader yielded, or a
    worker of the transport-free limit failed."""


class InputError(ValueError):
    """Bad input to a measuring command: the message says what was wrong and what to do.
    `trace` holds the traceback of the user's code that failed, where there is one."""

    def __init__(self, message: str, trace: str = ""):
        super().__init__(message)
        self.trace = trace


def user_trace() -> str:
    """The traceback of the exception being handled, less the frames of this package and
    of the import machinery: where the user's code failed ("" where it failed in none of
    its frames, a call with the wrong arguments, say: the message says it all)."""
    kind, error, tb = sys.exc_info()
    here = str(Path(__file__).parent)
    frames = [
        frame
        for frame in traceback.extract_tb(tb)
        if not frame.filename.startswith((here, "<frozen "))
    ]
    if not frames:
        return ""
    return "".join(
        [
            "Traceback (most recent call last):\n",
            *traceback.format_list(frames),
            *traceback.format_exception_only(kind, error),
        ]
    )


def require(module: str, purpose: str) -> ModuleType:
    """Import `module`, which comes with the bench extra, or raise InputError naming
    what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.partition(".")[0]
        raise InputError(
            f"{purpose} needs {package}, which cannot be imported ({error}): {INSTALL_EXTRA}"
        ) from None

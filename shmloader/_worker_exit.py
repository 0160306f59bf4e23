"""How a worker process leaves when it cannot return from its loop.

multiprocessing's exit handlers remove the temp dir a process made (torch's fd
sharing makes one, for a socket, once a batch goes by torch's transport).  An
os._exit skips them, and every such exit would leave a /tmp/pymp-* behind; so
those ways out remove it themselves.  (SIGTERM stays torch's: its C handler
ends the worker at once, even inside a long C call, which a Python handler
could not; a worker stopped that way leaves its dir, as torch's does.)
"""

from __future__ import annotations

import os
import shutil
from multiprocessing import process

from torch.utils.data._utils import signal_handling

# multiprocessing's temp dir as the worker started: the main process's, if it
# had made one (a child inherits it), which is the main process's to remove.
_inherited_temp_dir = None


def _temp_dir():
    return process.current_process()._config.get("tempdir")


def set_exit_handlers() -> None:
    """torch's signal handlers (a message for SIGSEGV, SIGBUS, SIGFPE; a
    SIGTERM from the main process exits quietly), and note the temp dir
    inherited."""
    global _inherited_temp_dir
    _inherited_temp_dir = _temp_dir()
    signal_handling._set_worker_signal_handlers()


def remove_own_temp_dir() -> None:
    tempdir = _temp_dir()
    if tempdir is not None and tempdir != _inherited_temp_dir:
        shutil.rmtree(tempdir, ignore_errors=True)


def exit_now(status: int) -> None:
    remove_own_temp_dir()
    os._exit(status)


def orphaned() -> None:
    """The main process is gone: leave at once.  The kernel closes the fds
    and unmaps the ring, and multiprocessing's exit path could block:
    flushing stdio into a pipe nobody reads any more, joining threads."""
    exit_now(0)

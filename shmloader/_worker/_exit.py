"""How a worker process leaves when it cannot return from its loop: the
main process gone, or the ring out of its reach (exit statuses the main
process reads, see _protocol.NO_RING_FDS_EXIT).

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
from typing import NoReturn

from torch.utils.data._utils import signal_handling

from ._protocol import NO_RING_FDS_EXIT, NO_RING_MAPPING_EXIT

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


def step_aside() -> None:
    """Run from now on only where a core has nothing else to run (every
    thread at SCHED_IDLE): this worker is leaving with nobody waiting for it
    (LEAVE, a non-persistent iterator's epoch ended).  Its exit tears down
    an address space forked from a server with torch in it, some 4 ms of
    CPU, at the moment the next epoch's workers start on the same cores and
    the training loop waits for their first batch.  Only where nobody
    waits: a shutdown joins its workers, and a process at SCHED_IDLE on
    busy cores could take seconds to leave."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(thread), os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass  # (a thread that has just ended)


def exit_now(status: int) -> NoReturn:
    remove_own_temp_dir()
    os._exit(status)


def orphaned() -> NoReturn:
    """The main process is gone: leave at once.  The kernel closes the fds
    and unmaps the ring, and multiprocessing's exit path could block:
    flushing stdio into a pipe nobody reads any more, joining threads."""
    exit_now(0)


class NoRingFds(Exception):
    """The ring's fds did not all arrive with their message, or could not be
    duplicated to map it."""


class NoRingMapping(Exception):
    """The ring could not be mapped: no address space left for it."""


def without_ring(worker_id: int, error: NoRingFds | NoRingMapping) -> NoReturn:
    """Leave, saying why on stderr, with the exit status by which the main
    process names the cause (_pool._exit_description)."""
    if isinstance(error, NoRingFds):
        os.write(
            2,
            f"shmloader worker {worker_id}: the ring's file descriptors did not "
            f"arrive ({error}): too many open files.\n".encode(),
        )
        exit_now(NO_RING_FDS_EXIT)
    os.write(2, f"shmloader worker {worker_id}: could not map the ring ({error}).\n".encode())
    exit_now(NO_RING_MAPPING_EXIT)

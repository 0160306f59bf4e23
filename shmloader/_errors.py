"""shmloader's public exceptions and its warning categories, in one place.

NOTE [errors: one base, old bases kept]
Every exception shmloader raises of its own derives from ShmloaderError, so
`except shmloader.ShmloaderError` catches them all, and each also keeps the
base it had before that base came (RuntimeError for all three), so an
`except RuntimeError` written for them still catches them.  Errors of the
user's code (dataset, sampler, collate_fn) are not shmloader's: they are
re-raised with their own types, as torch re-raises them (contract 5).
tests/unit/test_errors.py holds both to it.

Every warning of shmloader's own (a ring full, a spill, ...; not those it
gives as torch gives them) is a ShmloaderWarning, a UserWarning as torch's
loader's are: a project whose warning filters make warnings errors (pytest
-W error) can keep them warnings with one filter, which a message cannot
give.  RingBypassedWarning is one of them.  They are warnings, not errors:
no ShmloaderError (under `-W error` they are raised, and a handler for the
loader's errors should not swallow them).

The modules that raise them import them from here; none of them depends on
any other shmloader module, so both the worker side and the main side can.
"""

from __future__ import annotations


class ShmloaderError(Exception):
    """The base of the exceptions shmloader raises of its own (see
    NOTE [errors: one base, old bases kept])."""


class WorkerDied(ShmloaderError, RuntimeError):
    """A worker process exited while the main process was waiting for it."""


class SharedMemoryError(ShmloaderError, RuntimeError):
    """The ring does not fit in shared memory."""


class SampleLayoutError(ShmloaderError, RuntimeError):
    """A sample does not fit the batch layout the first sample fixed."""


class ShmloaderWarning(UserWarning):
    """The category of shmloader's own warnings (see NOTE [errors: one base,
    old bases kept])."""


class RingBypassedWarning(ShmloaderWarning):
    """A framework is about to move a shmloader loader's batches by torch's
    transport instead of shmloader's ring (and without its options)."""

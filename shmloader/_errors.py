"""shmloader's public exceptions and its warning category, in one place.

NOTE [errors: one base, old bases kept]
Every exception shmloader raises of its own derives from ShmloaderError, so
`except shmloader.ShmloaderError` catches them all, and each also keeps the
base it had before that base came (RuntimeError for all three), so an
`except RuntimeError` written for them still catches them.  Errors of the
user's code (dataset, sampler, collate_fn) are not shmloader's: they are
re-raised with their own types, as torch re-raises them (contract 5).
tests/unit/test_errors.py holds both to it.

RingBypassedWarning is a warning, not an error: it stays a UserWarning and
is no ShmloaderError (under `-W error` it is raised, and a handler for the
loader's errors should not swallow it).  It has no base of shmloader's own:
shmloader's other warnings (ring full, spill, ...) are plain UserWarnings,
as torch's loader's are, so such a base would cover this one category only.

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


class RingBypassedWarning(UserWarning):
    """A framework is about to move a shmloader loader's batches by torch's
    transport instead of shmloader's ring (and without its options)."""

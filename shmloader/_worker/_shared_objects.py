"""What every worker of an iterator gets alike (the dataset, collate_fn,
worker_init_fn), pickled once for all of them under spawn and forkserver.

multiprocessing pickles a Process's arguments once per process: a dataset
holding a list of a million (path, label) tuples is pickled again for every
worker, in the main process, one after the other, at every epoch of a
non-persistent loader.  Here the main process pickles those objects once
(SharedObjects.dump) into a sealed memfd segment, and each worker maps the
segment and unpickles its own copy (SharedObjects.load).  Under fork nothing
is pickled: workers inherit the objects.

NOTE [shared objects: fds]
The objects are pickled as multiprocessing pickles a process's arguments
(ForkingPickler, a "spawning popen" set), so that they travel as they do to
torch's workers: a tensor's storage is moved to shared memory and sent as an
fd (torch's file_descriptor strategy), a SharedList as its segment's fd, a
Connection or Queue as theirs.  The fds those reductions hand the spawning
popen are kept here (_Collector) and sent to each worker, after the segment's
own, over its result socket (SharedObjects.fds, see _standby.py); in a worker,
InheritedFd.detach() returns a duplicate of the one it stands for, as the
popens' own DupFd does, so each object that takes one owns its own.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from multiprocessing import context, reduction
from typing import Any

from .._shm._segment import new_sealable_segment, seal_segment, write_segment

# In a worker, while its shared objects are unpickled: the fds they were sent with.
_inherited: list[int] = []


class InheritedFd:
    """Stands for the index-th fd the objects were pickled with (see the NOTE)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return os.dup(_inherited[self.index])


class _Collector:
    """The spawning popen while the objects are pickled: keeps the fds
    reductions hand it (a duplicate each, theirs may be closed meanwhile)."""

    DupFd = InheritedFd

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(os.dup(fd))
        return len(self.fds) - 1


class SharedObjects:
    """A mapping of names to objects, pickled once, for every worker."""

    def __init__(self, segment: int, fds: list[int]) -> None:
        self._segment = segment  # the pickle's sealed segment
        self._fds = fds  # the fds its objects were pickled with

    @classmethod
    def dump(cls, objects: dict[str, Any]) -> SharedObjects:
        """Pickle `objects` as multiprocessing would for a worker; its errors
        (PicklingError, TypeError, AttributeError) are multiprocessing's."""
        collector = _Collector()
        buffer = io.BytesIO()
        context.set_spawning_popen(collector)  # type: ignore[arg-type]  # (a popen's part)
        try:
            reduction.ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(objects)
        except BaseException:
            _close(collector.fds)
            raise
        finally:
            context.set_spawning_popen(None)
        segment = new_sealable_segment("shmloader-objects")
        try:
            write_segment(segment, "The workers' dataset", buffer.getbuffer(), 0)
            seal_segment(segment)
        except BaseException:
            _close([segment, *collector.fds])
            raise
        return cls(segment, collector.fds)

    @property
    def fds(self) -> list[int]:
        """What a worker receives to load them: the segment's fd, then the
        objects' (SharedObjects.received)."""
        return [self._segment, *self._fds]

    @classmethod
    def received(cls, fds: list[int]) -> SharedObjects:
        """In a worker: the objects of the fds it received (their order: fds)."""
        return cls(fds[0], fds[1:])

    def close(self) -> None:
        """Its fds: the main process's once every worker has them, a worker's
        once it has loaded the objects."""
        _close(self.fds)
        self._fds = []

    def load(self) -> dict[str, Any]:
        """In a worker: the objects, unpickled from the segment."""
        _inherited[:] = self._fds
        try:
            with mmap.mmap(self._segment, 0, prot=mmap.PROT_READ) as data:
                return pickle.loads(data)
        finally:
            self.close()
            _inherited.clear()


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)

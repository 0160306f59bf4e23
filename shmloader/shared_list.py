"""SharedList: a dataset's index (paths, labels, ...) in shared memory, read by
forked and spawned workers without a copy.

Why: a list of Python objects shared with forked workers is copied into each of
them page by page as they read it, because every `samples[i]` writes the
entry's reference count (pytorch issue 13246): each worker ends up with the
whole list.  A SharedList keeps its entries as bytes in one sealed memfd
segment that every process maps read-only; reading an entry decodes a new
object and writes nothing that is shared.

The segment, written whole before it is mapped (native byte order: it never
leaves this machine):

    header   _HEADER: magic, entry count n, data bytes
    offsets  n + 1 uint64: entry i is data[offsets[i]:offsets[i + 1]]
    data     each entry as marshal.dumps writes it

marshal (CPython's format for code constants) stores exactly the types an
index holds (str, bytes, int, float, bool, None, tuples of them) compactly,
and decodes one in C.  Its format may change between Python versions, so the
bytes never outlive the processes of one interpreter: plain pickle (a file,
torch.save) carries the entries themselves (see SharedList.__reduce__).
"""

from __future__ import annotations

import marshal
import mmap
import operator
import os
import struct
import sys
import weakref
from array import array
from collections.abc import Sequence, Sized
from itertools import accumulate, islice
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import ClassVar

from ._shm._segment import new_sealable_segment, seal_segment, write_segment

_MAGIC = b"shmlist1"
_HEADER = struct.Struct("=8sQQ")  # magic, entry count, data bytes
_OFFSET_BYTES = 8  # a uint64, array "Q"
# Entries encoded (building), or decoded (iterating, comparing), at a time:
# what those hold beside the segment, about 2 MB for 2 M ImageFolder entries
# (2 % of their segment; 1 << 16 took 12 %, for no faster build).
_CHUNK = 1 << 13

_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})
_PLAIN_OR_TUPLE = _PLAIN | {tuple}
# What a subclass is stored as (bool cannot be subclassed).
_BASES = (str, bytes, int, float)
_SUPPORTED = "str, bytes, int, float, bool, None and tuples of them"

_loads = marshal.loads


class SharedList(Sequence):
    """An immutable list of str, bytes, int, float, bool, None and tuples of
    them, held in shared memory that worker processes map instead of copying:

        self.samples = SharedList(self.samples)

    Entries come back equal to those given, as new objects of the built-in
    types (a namedtuple comes back a tuple, numpy.float64 a float).  A slice
    is a list.  See docs/shared_list.md."""

    __slots__ = ("__weakref__", "_data", "_fd", "_len", "_map", "_offsets")

    def __init__(self, entries=()):
        if isinstance(entries, SharedList):
            self._open(os.dup(entries._fd), populate=True)  # the same, immutable, segment
        else:
            self._open(_build(entries), populate=True)

    @classmethod
    def _from_fd(cls, fd: int) -> SharedList:
        """The SharedList whose segment `fd` is (owned from now on)."""
        shared = cls.__new__(cls)
        # Not populated: a worker maps only the pages it reads.
        shared._open(fd, populate=False)
        return shared

    def _open(self, fd: int, populate: bool) -> None:
        """Map segment `fd` and own it.  The process that builds a list maps
        all of it (its pages exist already): workers' pages are then shared
        with it, never counted as theirs alone."""
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                raise ValueError
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            segment = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            magic, count, data_bytes = _HEADER.unpack_from(segment)
            offsets_end = _HEADER.size + _OFFSET_BYTES * (count + 1)
            if magic != _MAGIC or offsets_end + data_bytes != size:
                raise ValueError
        except ValueError:
            os.close(fd)
            raise ValueError(f"file descriptor {fd} does not hold a SharedList's segment") from None
        except BaseException:
            os.close(fd)
            raise
        view = memoryview(segment)
        self._map = segment
        self._offsets = view[_HEADER.size : offsets_end].cast("Q")
        self._data = view[offsets_end:]
        self._len = count
        self._fd = fd
        weakref.finalize(self, os.close, fd)

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory the entries take (header, offsets, data)."""
        return len(self._map)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        # The hot path of a dataset's __getitem__: kept to a few C calls.
        if type(index) is not int:
            return self._get_other(index)
        if index < 0:
            index += self._len
            if index < 0:
                raise IndexError("SharedList index out of range")
        elif index >= self._len:
            raise IndexError("SharedList index out of range")
        # One offset: marshal.loads reads one entry and ignores the bytes after it.
        return _loads(self._data[self._offsets[index] :])

    def _get_other(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step == 1:
                return list(self._entries(start, stop))
            return [self[i] for i in range(start, stop, step)]
        try:
            position = operator.index(index)  # a numpy or torch integer, a bool
        except TypeError:
            raise TypeError(
                f"SharedList indices must be integers or slices, not {type(index).__name__}"
            ) from None
        return self[position]

    def _entries(self, start: int, stop: int):
        """Entries start..stop-1 in order, decoded a chunk of offsets at a time."""
        piece = self._data.__getitem__
        for first in range(start, stop, _CHUNK):
            bounds = self._offsets[first : min(first + _CHUNK, stop) + 1].tolist()
            yield from map(_loads, map(piece, map(slice, bounds, bounds[1:])))

    def __iter__(self):
        return self._entries(0, self._len)

    def __contains__(self, value) -> bool:
        return value in self._entries(0, self._len)

    def count(self, value) -> int:
        return operator.countOf(self._entries(0, self._len), value)

    def index(self, value, start=0, stop=sys.maxsize) -> int:
        start, stop, _ = slice(start, stop).indices(self._len)  # list.index's clamping
        try:
            return start + operator.indexOf(self._entries(start, stop), value)
        except ValueError:
            raise ValueError(f"{value!r} is not in SharedList") from None

    def __eq__(self, other):
        """Equal to a list (or SharedList) of equal entries, as a list is."""
        if not isinstance(other, (list, SharedList)):
            return NotImplemented
        if len(other) != self._len:
            return False
        return all(
            self[first : first + _CHUNK] == other[first : first + _CHUNK]
            for first in range(0, self._len, _CHUNK)
        )

    # None: equal to lists, which have none (typed as typeshed types list's:
    # mypy takes None for an incompatible override of object.__hash__).
    __hash__: ClassVar[None] = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, self[:3]))
        more = f", ... {self._len - 3} more" if self._len > 3 else ""
        return f"SharedList([{shown}{more}])"

    def __copy__(self):
        return self  # immutable

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        # Plain pickle (a file, torch.save, cloudpickle): the entries themselves,
        # which load anywhere into a SharedList of its own.  multiprocessing
        # sends the segment instead (_reduce_for_process).
        return SharedList, (list(self),)


def _reduce_for_process(shared: SharedList):
    """How multiprocessing sends a SharedList (a worker's dataset under spawn
    or forkserver, a Queue, a Pipe): the segment's fd, which the receiver
    maps; the entries stay where they are.  (Under fork the dataset is not
    pickled at all: workers inherit the mapping.)"""
    return _attach, (DupFd(shared._fd),)


def _attach(fd) -> SharedList:
    return SharedList._from_fd(fd.detach())


ForkingPickler.register(SharedList, _reduce_for_process)


def _build(entries) -> int:
    """A sealed segment holding `entries`, as an fd.  TypeError naming the
    first entry of a type it cannot hold; SharedMemoryError where memory is
    short."""
    if not isinstance(entries, Sized):
        entries = list(entries)
    count = len(entries)
    fd = new_sealable_segment("shmloader-list")
    try:
        data_at = _HEADER.size + _OFFSET_BYTES * (count + 1)
        written = 0  # data bytes so far: where the next entry starts
        write_segment(fd, "SharedList", bytes(_OFFSET_BYTES), _HEADER.size)  # offsets[0]
        source = iter(entries)
        for first in range(0, count, _CHUNK):
            chunk = list(islice(source, _CHUNK))
            if len(chunk) < min(_CHUNK, count - first):  # (offsets past them would be 0)
                raise ValueError(
                    f"SharedList: the entries' len() is {count}, but iterating "
                    f"them gave {first + len(chunk)}"
                )
            if not _all_plain(chunk):
                chunk = _as_plain(chunk, first)
            encoded = list(map(marshal.dumps, chunk))
            ends = array("Q", accumulate(map(len, encoded), initial=written))
            write_segment(
                fd, "SharedList", memoryview(ends)[1:], _HEADER.size + _OFFSET_BYTES * (first + 1)
            )
            write_segment(fd, "SharedList", b"".join(encoded), data_at + written)
            written = ends[-1]
        # Last: a segment cut short by an error never reads as a SharedList.
        write_segment(fd, "SharedList", _HEADER.pack(_MAGIC, count, written), 0)
        seal_segment(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _all_plain(values) -> bool:
    """Whether every value is exactly (no subclass) a str, bytes, int, float,
    bool, None, or a tuple of them: what marshal stores as itself.  Checked as
    a set of types per tuple field, in C (a tenth of a loop's time), for the
    usual list of tuples of one length; tuples of several lengths are left to
    _as_plain, one by one.  (zip(*values) would also be C, but its iterator
    per entry sets off the garbage collector over the caller's whole list.)"""
    kinds = set(map(type, values))
    if not kinds <= _PLAIN_OR_TUPLE:
        return False
    if tuple not in kinds:
        return True
    tuples = values if len(kinds) == 1 else [v for v in values if type(v) is tuple]
    widths = set(map(len, tuples))
    if len(widths) != 1:
        return False
    return all(
        _all_plain(list(map(operator.itemgetter(field), tuples))) for field in range(widths.pop())
    )


class _Unsupported(Exception):
    def __init__(self, value):
        self.value = value


def _plain(value):
    """`value` with each subclass of a supported type made its base type;
    _Unsupported for the first value of any other type."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, tuple):
        return tuple(map(_plain, value))
    for base in _BASES:
        if isinstance(value, base):
            return base(value)
    raise _Unsupported(value)


def _as_plain(chunk: list, first: int) -> list:
    """`chunk` (entries `first`... of the list) made of exact types, or a
    TypeError naming its first entry of a type a SharedList cannot hold."""
    plain = []
    for position, entry in enumerate(chunk, first):
        try:
            plain.append(_plain(entry))
        except _Unsupported as e:
            kind = type(e.value)
            name = (
                kind.__qualname__
                if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__qualname__}"
            )
            inside = "" if e.value is entry else f" ({e.value!r:.60})"
            raise TypeError(
                f"SharedList cannot hold entry {position}, {entry!r:.100}: it holds a "
                f"{name}{inside}. A SharedList holds {_SUPPORTED}: convert the entries "
                "first (a list to a tuple, a numpy integer with int() or .tolist(), a Path "
                "with str())."
            ) from None
    return plain

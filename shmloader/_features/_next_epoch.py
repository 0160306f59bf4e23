"""prefetch_next_epoch: the next epoch's indices drawn early, invisibly.

When epoch e's sampler runs out, the next epoch's sampler starts drawing at
once, but on private copies: every torch.Generator the loader and its
samplers hold is switched to a private state around each draw (and back to
the user's state after it), and samplers with set_epoch are set to epoch
e + 1 around it (and back).  So until the next iter(), the user's
generators and samplers are exactly as torch would leave them: the user may
draw from the generator, reseed it, or call set_epoch, and sees no trace of
the prefetch.

At the next iter() the prefetched epoch is adopted only if the samplers and
generators are what that epoch assumed: generators untouched since, samplers
set to epoch e + 1 (by the user, as DDP code does before each epoch), every
other attribute unchanged (by content, followed into the containers and
objects it holds, since they may be changed in place: see _Snapshot; a
sampler that is a plain list likewise).  Then the generators take their private states,
as if the draws had happened now.  Otherwise the prefetched batches are
dropped and the epoch is drawn afresh, from whatever the user set.  Anything
else a sampler draws from (torch's global RNG, when there is no generator)
is not private: see the README.
"""

from __future__ import annotations

import array
import collections
import pickle
import random
import types

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .._worker._user_objects import attribute

_PRIMITIVES = (int, float, str, bool, bytes, type(None))


def loader_samplers(loader):
    """The loader's sampler and batch_sampler, and samplers they hold (a
    BatchSampler's sampler), each once."""
    seen = []
    todo = [loader.sampler, loader.batch_sampler]
    while todo:
        obj = todo.pop(0)
        if obj is not None and all(obj is not s for s in seen):
            seen.append(obj)
            # (type(), not isinstance: a dead weakref.proxy raises on the latter)
            todo += [v for _, v in _attributes(obj) if issubclass(type(v), Sampler)]
    return seen


# Random generators other than torch's that a sampler may hold and draw from.
_OTHER_RNGS = (random.Random, np.random.RandomState, np.random.Generator)


def _generators(loader, kinds=(torch.Generator,)):
    """The loader's generator and the generators of `kinds` its samplers hold
    whose state can be read (random.SystemRandom's cannot), each once."""
    found = [loader.generator] if loader.generator is not None else []
    for sampler in loader_samplers(loader):
        for _, value in _attributes(sampler):
            if (
                issubclass(type(value), kinds)
                and all(value is not g for g in found)
                and _has_state(value)
            ):
                found.append(value)
    return found


def _has_state(rng) -> bool:
    try:
        _get_state(rng)
    except Exception:  # noqa: BLE001 - NotImplementedError, or a subclass's own
        return False
    return True


def _get_state(rng):
    if isinstance(rng, (torch.Generator, np.random.RandomState)):
        return rng.get_state()
    if isinstance(rng, random.Random):
        return rng.getstate()
    return rng.bit_generator.state


def _set_state(rng, state) -> None:
    if isinstance(rng, (torch.Generator, np.random.RandomState)):
        rng.set_state(state)
    elif isinstance(rng, random.Random):
        rng.setstate(state)
    else:
        rng.bit_generator.state = state


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return pickle.dumps(a) == pickle.dumps(b)


def can_prefetch(loader) -> bool:
    """Whether the next epoch can be drawn invisibly: a sampler with set_epoch
    must keep its epoch in an int `epoch` attribute, to be set back after
    each draw."""
    return all(
        type(attribute(sampler, "epoch")) is int
        for sampler in loader_samplers(loader)
        if callable(attribute(sampler, "set_epoch"))
    )


def sampler_generators(loader):
    """The generators the loader's samplers hold (RandomSampler(generator=g),
    say), besides the loader's own generator."""
    return [g for g in _generators(loader) if g is not loader.generator]


# How far a snapshot looks into the samplers' attributes (see the README's
# Limits): containers and objects are followed this deep, and up to this many
# of them in all; a dict or set of more entries, and arrays and tensors past
# this many bytes in all, are compared by identity.  A list or tuple of
# numbers or strings (indices) is copied whole, at C speed, its elements'
# types judged from up to _SAMPLED of them.
_DEPTH = 8
_NODES = 10_000
_ENTRIES = 1_000_000
_BYTES = 64 << 20
_SAMPLED = 1024
# Values that cannot change in place (an index, a weight, a name).
_IMMUTABLE = (*_PRIMITIVES, np.generic)
# Objects whose attributes are not a sampler's state: code, and the loaders
# themselves (their counters move with every batch).  (The loader's dataset
# counts by its length alone: see _Snapshot._of.)
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    DataLoader,
    _BaseDataLoaderIter,
)


class _Snapshot:
    """What a loader's generator and samplers are now, comparable with what
    they were: a sampler's state may sit in its attributes, in containers or
    helper objects they hold, changed in place (a list of buckets reshuffled,
    a dict of settings), or in __slots__."""

    def __init__(self, dataset):
        self._dataset = dataset
        self._nodes = 0
        self._bytes = 0

    def of(self, value, depth: int = 0):
        try:
            return self._of(value, depth)
        except Exception:  # noqa: BLE001 - a tensor with no plain bytes, a dead weakref.proxy
            return ("object", id(value))

    def _of(self, value, depth):
        if isinstance(value, _PRIMITIVES):
            return value
        if isinstance(value, torch.Generator):
            return bytes(value.get_state().numpy())
        if isinstance(value, np.generic):
            return ("numpy", value.dtype.str, value.tobytes())
        if value is self._dataset:  # a sampler's data_source: the data, not how it is drawn
            return ("dataset", _length(value))
        self._nodes += 1
        # Another dataset (a Subset whose indices a sampler draws from): its
        # length too, and its attributes like any object's.
        length = (_length(value),) if isinstance(value, Dataset) else ()
        if depth >= _DEPTH or self._nodes > _NODES or isinstance(value, _OPAQUE):
            return ("object", id(value), *length)
        return (self._content(value, depth + 1), *length)

    def _content(self, value, depth):
        if isinstance(value, (list, tuple, collections.deque)):
            items = value if isinstance(value, (list, tuple)) else list(value)
            if _all_immutable(items):
                return (type(value), tuple(items))
            return (type(value), self._each(items, depth, value))
        if isinstance(value, (dict, set, frozenset)) and len(value) > _ENTRIES:
            return ("object", id(value))
        if isinstance(value, dict):
            if _all_immutable(list(value.values())):
                return (type(value), tuple(value.items()))
            return (type(value), tuple(value), self._each(list(value.values()), depth, value))
        if isinstance(value, (set, frozenset)):
            # Its elements are hashable, mostly immutable: by equality.
            return (type(value), frozenset(value))
        if isinstance(value, array.array):
            return ("array", value.typecode, value.tobytes())
        if isinstance(value, np.ndarray) and value.dtype.hasobject:  # its bytes are pointers
            if value.size > _NODES - self._nodes:
                return ("object", id(value))
            return ("ndarray", value.shape, self._each(list(value.ravel()), depth, value))
        if isinstance(value, (torch.Tensor, np.ndarray)):
            self._bytes += value.nbytes
            if self._bytes > _BYTES:
                return ("object", id(value))
            if isinstance(value, np.ndarray):
                return ("ndarray", value.dtype.str, value.shape, value.tobytes())
            data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            return (
                "tensor",
                value.dtype,
                tuple(value.shape),
                bytes(data.reshape(-1).view(torch.uint8).numpy()),
            )
        if isinstance(value, _OTHER_RNGS):
            # A new state object each call, whole (a budget's identity would differ).
            return (type(value), id(value), pickle.dumps(_get_state(value)))
        # An object: by identity (another one assigned) and by its attributes.
        attrs = [(k, self.of(v, depth)) for k, v in _attributes(value)]
        return (type(value), id(value), tuple(attrs))

    def _each(self, items, depth, container) -> tuple:
        """Snapshots of `items` (the container's), each of which may change in
        place; the container's identity alone where there are more than the
        nodes left to follow."""
        if len(items) > _NODES - self._nodes:
            return ("object", id(container))
        return tuple(self.of(v, depth) for v in items)


def _length(dataset):
    """len(dataset), which a sampler draws indices below, or None without one."""
    try:
        return len(dataset)
    except Exception:  # noqa: BLE001 - no __len__, or one that raises
        return None


def _all_immutable(values) -> bool:
    """Whether `values` (a list, tuple or dict's values) hold only values that
    cannot change in place (numbers, strings, and tuples of them), judged from
    up to _SAMPLED of them."""
    step = max(1, len(values) // _SAMPLED)
    return all(_immutable(v) for v in values[::step]) and (not values or _immutable(values[-1]))


def _immutable(value) -> bool:
    return isinstance(value, _IMMUTABLE) or (
        type(value) is tuple and all(isinstance(v, _IMMUTABLE) for v in value)
    )


def _attributes(obj):
    """An object's attributes: its __dict__'s and its __slots__' that are set."""
    pairs = list((attribute(obj, "__dict__") or {}).items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{cls.__name__.lstrip('_')}{name}"  # a private name, mangled
            if name not in ("__dict__", "__weakref__"):
                try:
                    value = getattr(obj, name)
                except Exception:  # noqa: BLE001 - unset (a __getattr__ may raise anything)
                    continue
                pairs.append((name, value))
    return pairs


def _capture(loader):
    snapshot = _Snapshot(loader.dataset)
    # The dataset's length too: the default samplers draw below it.
    return [
        snapshot.of(loader.dataset),
        snapshot.of(loader.generator),
        *(snapshot.of(sampler) for sampler in loader_samplers(loader)),
    ]


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - elements that cannot say (tensors in a list)
        return False


class PrefetchedEpoch:
    """The draws of epoch `epoch` made before its iter() (see the module note)."""

    def __init__(self, loader, epoch: int):
        self.epoch = epoch
        self._loader = loader
        # Drawn from privately: numpy's and Python's generators too.
        self._generators = _generators(loader, (torch.Generator, *_OTHER_RNGS))
        self._private_states = [_get_state(g) for g in self._generators]
        # (sampler, the epoch to draw with) for samplers with set_epoch: e + 1
        # from the sampler's own count where it keeps one.
        self._epochs = []
        for sampler in loader_samplers(loader):
            if callable(attribute(sampler, "set_epoch")):
                now = attribute(sampler, "epoch")
                self._epochs.append((sampler, now + 1 if type(now) is int else epoch))
        self._expected = None
        self._left = None  # the user's generator states the last draw left
        self.failed = False  # a draw raised, or the loop drew: the epoch is left to iter()

    def draw(self, fn):
        """fn() (a draw from the next epoch's sampler iterator), made in the
        next epoch's configuration and invisible outside it.  A draw that
        raises ends the prefetch (StopIteration, now and after): the next
        iter() draws the epoch afresh and meets the error where torch does."""
        if self.failed:
            raise StopIteration
        # The user's generators and samplers as they are now (the loop may
        # have set an epoch since the last draw).  A generator the loop drew
        # from since then has moved on from where this epoch was drawn: torch
        # would draw the epoch after those draws, so it is left to iter().
        user_states = [_get_state(g) for g in self._generators]
        if self._left is not None and not all(
            _same_state(a, b) for a, b in zip(user_states, self._left)
        ):
            self.failed = True
            raise StopIteration
        user_epochs = [attribute(sampler, "epoch") for sampler, _ in self._epochs]
        try:
            for g, state in zip(self._generators, self._private_states):
                _set_state(g, state)
            for sampler, then in self._epochs:
                sampler.set_epoch(then)
            return fn()
        except StopIteration:
            raise
        except Exception:  # noqa: BLE001 - see above
            self.failed = True
            raise StopIteration from None
        finally:
            self._private_states = [_get_state(g) for g in self._generators]
            for g, state in zip(self._generators, user_states):
                _set_state(g, state)
            self._left = user_states
            # What the user's objects must look like at the next iter().
            self._expected = _capture(self._loader)
            for (sampler, _), now in zip(self._epochs, user_epochs):
                if now is not None:
                    sampler.set_epoch(now)
            # Again: a set_epoch that reseeds a generator (which torch never
            # calls here) must leave the user's draws where they were.
            for g, state in zip(self._generators, user_states):
                _set_state(g, state)

    def holds(self) -> bool:
        """Whether the next iter() finds what this epoch was drawn with (and
        its sampler did not fail: then that iter() draws it afresh)."""
        return (
            not self.failed
            and self._expected is not None
            and _same(_capture(self._loader), self._expected)
        )

    def adopt(self) -> None:
        """The draws happen now: the generators move on as they would have."""
        for g, state in zip(self._generators, self._private_states):
            _set_state(g, state)

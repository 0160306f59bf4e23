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
other attribute unchanged (lists, tensors and arrays by content, since they
may be changed in place; a sampler that is a plain list likewise).  Then the generators take their private states,
as if the draws had happened now.  Otherwise the prefetched batches are
dropped and the epoch is drawn afresh, from whatever the user set.  Anything
else a sampler draws from (torch's global RNG, when there is no generator)
is not private: see the README.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Sampler

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
            todo += [v for v in getattr(obj, "__dict__", {}).values() if isinstance(v, Sampler)]
    return seen


def _generators(loader):
    found = [loader.generator] if loader.generator is not None else []
    for sampler in loader_samplers(loader):
        for value in getattr(sampler, "__dict__", {}).values():
            if isinstance(value, torch.Generator) and all(value is not g for g in found):
                found.append(value)
    return found


def can_prefetch(loader) -> bool:
    """Whether the next epoch can be drawn invisibly: a sampler with set_epoch
    must keep its epoch in an int `epoch` attribute, to be set back after
    each draw."""
    return all(type(getattr(sampler, "epoch", None)) is int for sampler in loader_samplers(loader)
               if callable(getattr(sampler, "set_epoch", None)))


def sampler_generators(loader):
    """The generators the loader's samplers hold (RandomSampler(generator=g),
    say), besides the loader's own generator."""
    return [g for g in _generators(loader) if g is not loader.generator]


def _value(value, dataset):
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, torch.Generator):
        return bytes(value.get_state().numpy())
    if value is dataset:  # a sampler's data_source: the data, not how it is drawn
        return "dataset"
    # Indices and weights a user may change in place (a list sampler
    # reshuffled before each epoch, SubsetRandomSampler's indices): by content.
    try:
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(value))
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            return ("tensor", value.dtype, tuple(value.shape),
                    bytes(data.reshape(-1).view(torch.uint8).numpy()))
        if isinstance(value, np.ndarray):
            return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    except Exception:  # noqa: BLE001 - a tensor with no plain bytes (sparse, meta, ...)
        pass
    return ("object", id(value))


def _capture(loader):
    dataset = loader.dataset
    snapshot = [_value(loader.generator, dataset)]
    for sampler in loader_samplers(loader):
        if hasattr(sampler, "__dict__"):
            attrs = sorted((k, _value(v, dataset)) for k, v in vars(sampler).items())
            snapshot.append((type(sampler), attrs))
        else:  # a plain iterable of indices (torch takes any as sampler)
            snapshot.append(_value(sampler, dataset))
    return snapshot


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
        self._generators = _generators(loader)
        self._private_states = [g.get_state() for g in self._generators]
        # (sampler, the epoch to draw with) for samplers with set_epoch: e + 1
        # from the sampler's own count where it keeps one.
        self._epochs = []
        for sampler in loader_samplers(loader):
            if callable(getattr(sampler, "set_epoch", None)):
                now = getattr(sampler, "epoch", None)
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
        user_states = [g.get_state() for g in self._generators]
        if self._left is not None and not all(
                torch.equal(a, b) for a, b in zip(user_states, self._left)):
            self.failed = True
            raise StopIteration
        user_epochs = [getattr(sampler, "epoch", None) for sampler, _ in self._epochs]
        try:
            for g, state in zip(self._generators, self._private_states):
                g.set_state(state)
            for sampler, then in self._epochs:
                sampler.set_epoch(then)
            return fn()
        except StopIteration:
            raise
        except Exception:  # noqa: BLE001 - see above
            self.failed = True
            raise StopIteration from None
        finally:
            self._private_states = [g.get_state() for g in self._generators]
            for g, state in zip(self._generators, user_states):
                g.set_state(state)
            self._left = user_states
            # What the user's objects must look like at the next iter().
            self._expected = _capture(self._loader)
            for (sampler, _), now in zip(self._epochs, user_epochs):
                if now is not None:
                    sampler.set_epoch(now)

    def holds(self) -> bool:
        """Whether the next iter() finds what this epoch was drawn with (and
        its sampler did not fail: then that iter() draws it afresh)."""
        return not self.failed and self._expected is not None and \
            _same(_capture(self._loader), self._expected)

    def adopt(self) -> None:
        """The draws happen now: the generators move on as they would have."""
        for g, state in zip(self._generators, self._private_states):
            g.set_state(state)

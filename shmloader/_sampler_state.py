"""prefetch_next_epoch: is a prefetched epoch still the one the next iter()
would draw?

The next epoch's batches are drawn early, when this epoch's sampler runs
out.  They stand only if, when iter() comes, nothing that drew them has
changed since: the samplers' attributes (an epoch set by set_epoch, flags,
which objects they hold) and every torch.Generator among them or the
loader's.  Anything else (the dataset's contents, torch's global RNG, which a
sampler without a generator draws from) is not looked at; see the README.
"""
from __future__ import annotations

import torch

_PRIMITIVES = (int, float, str, bool, bytes, type(None))


def _samplers(loader):
    seen = []
    for obj in (loader.sampler, loader.batch_sampler):
        if obj is not None and all(obj is not s for s in seen):
            seen.append(obj)
    return seen


def _value(value):
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, torch.Generator):
        return bytes(value.get_state().numpy())
    return ("object", id(value))


class SamplerState:
    def __init__(self, snapshot):
        self._snapshot = snapshot

    @staticmethod
    def advance_epoch(loader, next_epoch: int) -> None:
        """Call set_epoch(e + 1) on every sampler that has one, e being its
        own `epoch` attribute where it keeps one, else next_epoch - 1."""
        for sampler in _samplers(loader):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                epoch = getattr(sampler, "epoch", None)
                set_epoch(epoch + 1 if type(epoch) is int else next_epoch)

    @classmethod
    def capture(cls, loader) -> "SamplerState":
        snapshot = [_value(loader.generator)]
        for sampler in _samplers(loader):
            attrs = getattr(sampler, "__dict__", {})
            snapshot.append((type(sampler), sorted((k, _value(v)) for k, v in attrs.items())))
        return cls(snapshot)

    def holds(self, loader) -> bool:
        """Whether the loader's samplers are still as captured."""
        return self.capture(loader)._snapshot == self._snapshot

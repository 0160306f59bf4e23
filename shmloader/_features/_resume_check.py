"""load_state_dict()'s checks: whether a state fits the loader and holds
what a state of its version holds, each field saying what is wrong with it;
and a state taken after an epoch's last batch made into that epoch's end.
The state's format itself: _resume.py.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from .._worker._state import UnsavedState, own_state_copy, restore_worker_rng
from ._next_epoch import sampler_generators
from ._resume import STATE_VERSION, loader_config, sampler_state, stateful_sampler


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _above(below: int, beyond: list) -> bool:
    """Whether `beyond` lists distinct numbers past `below` (below them, all were yielded)."""
    return len(set(beyond)) == len(beyond) and all(n > below for n in beyond)


def _worker_states(value) -> bool:
    """A list of plain worker states: a dataset's state, with RNG states or (the
    main process's, without workers) none."""
    return isinstance(value, list) and all(
        s is None
        or isinstance(s, dict)
        and "dataset" in s
        and ("random" in s) == ("numpy" in s) == ("torch" in s)
        for s in value
    )


def _yielded_numbers(value) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and _is_int(value[0])
        and value[0] >= 0
        and isinstance(value[1], list)
        and all(map(_is_int, value[1]))
        and _above(value[0], value[1])
    )


# What each field of a state must be: (description, test).  See NOTE [resume:
# state format] in _resume.py.
_FIELDS = {
    "config": ("a dict", lambda v: isinstance(v, dict)),
    "epoch": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "epoch_finished": ("a bool", lambda v: isinstance(v, bool)),
    "batches_yielded": ("an int >= 0", lambda v: _is_int(v) and v >= 0),
    "batches_yielded_beyond": (
        "a list of ints",
        lambda v: isinstance(v, list) and all(map(_is_int, v)),
    ),
    "batches_yielded_by_worker": (
        "a list of [int >= 0, list of ints] per worker",
        lambda v: isinstance(v, list) and all(_yielded_numbers(w) for w in v),
    ),
    # (torch draws it as a non-negative int64)
    "base_seed": (
        "an int in [0, 2**63) or None",
        lambda v: v is None or _is_int(v) and 0 <= v < 1 << 63,
    ),
    "generator_state": ("a tensor or None", lambda v: v is None or isinstance(v, torch.Tensor)),
    "sampler_generator_states": (
        "a list of tensors",
        lambda v: isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v),
    ),
    "torch_rng_state": ("a tensor or None", lambda v: v is None or isinstance(v, torch.Tensor)),
    "sampler_started": ("a bool", lambda v: isinstance(v, bool)),
    "sampler_state": ("anything", lambda v: True),
    "worker_states": ("a list of worker states or None", _worker_states),
    "epoch_start_worker_states": ("a list of worker states or None", _worker_states),
    "persistent_workers": ("a bool", lambda v: isinstance(v, bool)),
}


def check_state(loader, state) -> dict:
    """The state, if this loader can resume from it, else a clear error; a
    state taken after an epoch's last batch made into that epoch's end (see
    epoch_run_out).  (A torchdata state was made shmloader's before, where it
    can be: _foreign_state.py.)"""
    if not isinstance(state, dict):
        raise ValueError(
            "load_state_dict expects a dict made by shmloader's "
            f"DataLoader.state_dict(), got {type(state).__name__}"
        )
    if "version" not in state:
        raise ValueError(
            "load_state_dict expects a dict made by shmloader's "
            "DataLoader.state_dict(); this dict has no 'version' key"
        )
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"this state has version {state['version']}; this shmloader reads "
            f"version {STATE_VERSION}"
        )
    for key, (what, fits) in _FIELDS.items():
        if key not in state:
            raise ValueError(
                f"this state has no {key!r}: load_state_dict expects a dict made "
                "by shmloader's DataLoader.state_dict(), unchanged"
            )
        if not fits(state[key]):
            raise ValueError(
                f"this state's {key!r} should be {what}, but it is "
                f"{state[key]!r:.200}; was it changed after state_dict()?"
            )
    ours = loader_config(loader)
    theirs = state["config"]
    differ = [
        k
        for k in ours
        if theirs.get(k) != ours[k] and not (k == "num_workers" and loader.seed_per_sample)
    ]
    if differ:
        details = ", ".join(f"{k}={theirs.get(k)!r} there, {ours[k]!r} here" for k in differ)
        raise ValueError(
            f"this state was saved by a DataLoader configured differently ({details}); "
            "a state resumes only the same dataset with the same batching. "
            + (
                "(num_workers may differ with seed_per_sample=True.)"
                if "num_workers" in differ
                else ""
            )
        )
    _check_consistent(loader, state)
    return epoch_run_out(loader, state) or state


def epoch_run_out(loader, state: dict) -> dict | None:
    """A map-style state taken after the last batch of its epoch (every one
    of the len(loader) batches yielded) but before the loop asked for more,
    so before the iterator ran out, as the state taken once it has run out:
    one that resumes with the next epoch whole.  (Mid-epoch, it would resume
    the epoch's rest, which is empty: a framework that resumes such a
    checkpoint into the next epoch, as Lightning does, would lose it.)

    The generators and the sampler are not yet where the next epoch starts
    from (without workers the sampler has not run out: a RandomSampler
    draws once more as it does), so the epoch's sampler is run out here, on
    the loader's own sampler and generators restored to the epoch's start
    (as resuming mid-epoch draws the yielded batches again), and their states
    after it are the next epoch's start; the loader's are then put back as
    they were (Resume sets them again).  None where that is not so: an
    IterableDataset (its length says nothing sure about its batches), a
    sampler without len(), an epoch not done, or a sampler that does not run
    out where len() says it does."""
    if loader._dataset_kind == 1 or state["epoch_finished"] or state["batches_yielded_beyond"]:
        return None
    try:
        batches = len(loader)
    except TypeError:  # a sampler without len()
        return None
    if batches <= 0 or state["batches_yielded"] != batches:
        return None
    ended = _run_sampler_out(loader, state, batches)
    if ended is None:
        return None
    generator_state, sampler_generator_states, sampler_state_then = ended
    return {
        **state,
        "epoch": state["epoch"] + 1,
        "epoch_finished": True,
        "batches_yielded": 0,
        "batches_yielded_beyond": [],
        "batches_yielded_by_worker": [],
        "generator_state": generator_state,
        "sampler_generator_states": sampler_generator_states,
        "torch_rng_state": None,
        "sampler_started": False,
        "sampler_state": sampler_state_then,
        "epoch_start_worker_states": [],
    }


def _run_sampler_out(loader, state: dict, batches: int):
    """(loader generator's state, its samplers' generators' states, the
    sampler's own state_dict()) once the epoch `state` began has drawn
    `batches` batches and its sampler has run out; None if it gives fewer or
    more, or fails.  Torch's global RNG (which a RandomSampler without a
    generator seeds itself from) is drawn from as it stood at the epoch's
    start, privately; the loader's generators and sampler are left as they
    were."""
    generator = loader.generator
    generators = sampler_generators(loader)
    stateful = stateful_sampler(loader)
    before = (
        generator.get_state() if generator is not None else None,
        [g.get_state() for g in generators],
        own_state_copy(stateful, "the sampler's") if stateful is not None else None,
    )
    try:
        with torch.random.fork_rng(devices=[]):
            if state["torch_rng_state"] is not None:
                torch.set_rng_state(state["torch_rng_state"])
            if generator is not None and state["generator_state"] is not None:
                generator.set_state(state["generator_state"])
            if len(state["sampler_generator_states"]) == len(generators):
                for g, saved in zip(generators, state["sampler_generator_states"]):
                    g.set_state(saved)
            if stateful is not None and state["sampler_state"] is not None:
                stateful.load_state_dict(state["sampler_state"])
            drawn = iter(loader._index_sampler)
            for _ in range(batches):
                next(drawn)
            try:
                next(drawn)
            except StopIteration:
                pass
            else:
                return None  # more batches than len(loader) says: not the epoch's end
            ended = (
                generator.get_state() if generator is not None else None,
                [g.get_state() for g in generators],
                sampler_state(loader),
            )
    except Exception:  # noqa: BLE001 - resumed mid-epoch instead, which meets it at iter()
        return None
    finally:
        if generator is not None and before[0] is not None:
            generator.set_state(before[0])
        for g, saved in zip(generators, before[1]):
            g.set_state(saved)
        if stateful is not None and before[2] is not None:
            with contextlib.suppress(Exception):
                if not isinstance(before[2], UnsavedState):
                    stateful.load_state_dict(before[2])
    if isinstance(ended[2], UnsavedState):
        return None
    return ended


def _check_consistent(loader, state) -> None:
    """The fields' values agree with each other, and the RNG states restore
    (tried on fresh RNGs: a worker that failed to would die with the cause
    seen only on its stderr)."""
    if not _above(state["batches_yielded"], state["batches_yielded_beyond"]):
        raise ValueError(
            f"this state's 'batches_yielded_beyond' {state['batches_yielded_beyond']!r:.200} should "
            f"list distinct batches after the first {state['batches_yielded']} (its "
            "'batches_yielded'); was it changed after state_dict()?"
        )
    workers = state["config"]["num_workers"]  # (may differ from the loader's: seed_per_sample)
    if not (_is_int(workers) and workers >= 0):
        raise ValueError(
            f"this state's config 'num_workers' should be an int >= 0, but it is "
            f"{workers!r:.200}; was it changed after state_dict()?"
        )
    per_worker = max(1, workers)  # num_workers=0: the main process's
    # Mid-epoch, an entry per worker; at an epoch's end, those or none.
    lengths = (per_worker,) if not state["epoch_finished"] else (0, per_worker)
    for key in ("worker_states", "epoch_start_worker_states", "batches_yielded_by_worker"):
        if len(state[key]) not in lengths:
            raise ValueError(
                f"this state's {key!r} has {len(state[key])} entries, but it was saved "
                f"{'mid-epoch ' if len(lengths) == 1 else ''}with num_workers={workers} "
                f"(so {' or '.join(map(str, lengths))}); was it changed after state_dict()?"
            )
    for key in ("worker_states", "epoch_start_worker_states"):
        for worker_id, worker_state in enumerate(state[key]):
            if worker_state is not None and "random" in worker_state:
                _check_restores(
                    f"{key}[{worker_id}]",
                    lambda s=worker_state: restore_worker_rng(
                        s, random.Random(), np.random.RandomState(), torch.Generator()
                    ),
                )
    generators = [loader.generator] if loader.generator is not None else [None]
    for key, saved, fits in (
        ("generator_state", [state["generator_state"]], generators),
        ("torch_rng_state", [state["torch_rng_state"]], [None]),
        ("sampler_generator_states", state["sampler_generator_states"], sampler_generators(loader)),
    ):
        if len(saved) != len(fits):  # (restore_sampler then leaves them as they are)
            continue
        for i, (tensor, like) in enumerate(zip(saved, fits)):
            if tensor is not None:
                device = like.device if like is not None else "cpu"
                _check_restores(
                    f"{key}" + (f"[{i}]" if len(fits) > 1 else ""),
                    lambda t=tensor, d=device: torch.Generator(device=d).set_state(t),
                )


def _check_restores(field: str, restore) -> None:
    try:
        restore()
    except Exception as e:
        raise ValueError(
            f"this state's {field!r} holds RNG states that do not restore "
            f"({type(e).__name__}: {e}); was it changed after state_dict()?"
        ) from None

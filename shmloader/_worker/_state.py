"""A worker's state, as each batch carries it for state_dict(): its RNG
states (random, numpy, torch) and an IterableDataset's own state_dict(),
taken after every batch, made plain data when a state is saved, and set
back when a worker starts from a saved state.

NOTE [resume: the worker's state]
Workers take snapshots (worker_snapshot, cheap: a pickle) and restore them
(restore_worker_rng); the main process only keeps them and makes them plain
(plain_worker_state, where state_dict() is called: see _resume.py).  Both
sides use this module, so it imports nothing of the main side's: the rest
of resuming (_resume.py, _resume_progress.py, _resume_check.py) is the main
process's.  UnsavedState and own_state_copy serve the main process's
sampler state too: a state that could not be taken is the same thing there.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from array import array

import numpy as np
import torch

# Room kept at the end of every slot for the worker state its batch carries
# (about 10 KB of RNG states, plus an IterableDataset's state), so that it
# never makes a batch spill.
STATE_BYTES = 16384


def carries_state(dataset_kind: int, seed_per_sample: bool) -> bool:
    """Whether each batch carries its worker's state: always, except where
    positions alone decide the RNG (seed_per_sample over a map-style dataset)."""
    return dataset_kind == 1 or not seed_per_sample  # 1: _DatasetKind.Iterable


@dataclasses.dataclass(frozen=True)
class UnsavedState:
    """Stands for a dataset's or sampler's state that could not be taken.
    torch's DataLoader never calls their state_dict(), so its failing must
    not stop iteration: only the loader's state_dict() fails, saying why."""

    reason: str


def own_state(obj, whose: str):
    """obj.state_dict(), or an UnsavedState saying why not."""
    try:
        return obj.state_dict()
    except Exception as e:
        return UnsavedState(f"{whose} state_dict() raised {type(e).__name__}: {e}")


def _unpicklable(whose: str, e: Exception) -> UnsavedState:
    return UnsavedState(
        f"{whose} state_dict() returned what pickle cannot keep ({type(e).__name__}: {e})"
    )


def own_state_copy(obj, whose: str):
    """obj.state_dict() as it is now (a copy: an object may keep updating
    the dict it returned), or an UnsavedState saying why not."""
    state = own_state(obj, whose)
    if isinstance(state, UnsavedState):
        return state
    try:
        return pickle.loads(pickle.dumps(state, pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        return _unpicklable(whose, e)


def worker_snapshot(stateful) -> bytes:
    """This worker's RNG states (and `stateful`'s state_dict(), if given),
    pickled: cheap to take after every batch."""
    version, internal, gauss = random.getstate()
    # numpy's stubs type get_state() as get_state(legacy=False), a dict; the default is
    # legacy=True, under which the global RandomState (MT19937) gives this tuple.
    keys: np.ndarray
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[assignment]
    rng = (
        version,
        array("I", internal).tobytes(),
        gauss,
        name,
        keys.tobytes(),
        pos,
        has_gauss,
        cached,
        torch.get_rng_state().numpy().tobytes(),
    )
    dataset_state = own_state(stateful, "the dataset's") if stateful is not None else None
    try:
        return pickle.dumps((rng, dataset_state), pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return pickle.dumps((rng, _unpicklable("the dataset's", e)), pickle.HIGHEST_PROTOCOL)


def plain_worker_state(snapshot) -> dict | None:
    """A worker_snapshot() as plain data (what a state_dict holds)."""
    if snapshot is None or isinstance(snapshot, dict):
        return snapshot
    rng, dataset_state = pickle.loads(snapshot)
    version, internal, gauss, name, keys, pos, has_gauss, cached, torch_state = rng
    return {
        "random": {"version": version, "internal": internal, "gauss": gauss},
        "numpy": {"name": name, "keys": keys, "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "torch": torch.frombuffer(bytearray(torch_state), dtype=torch.uint8),
        "dataset": dataset_state,
    }


def rng_only(snapshot) -> dict | None:
    """A worker state without its dataset's state."""
    state = plain_worker_state(snapshot)
    return state if state is None or state["dataset"] is None else {**state, "dataset": None}


def restore_worker_rng(state: dict, python=random, numpy=np.random, torch_rng=None) -> None:
    """Set this worker's random, numpy and torch RNGs from a plain worker state
    (or the RNGs given: load_state_dict tries a state on fresh ones)."""
    r, n = state["random"], state["numpy"]
    python.setstate((r["version"], tuple(array("I", r["internal"])), r["gauss"]))
    numpy.set_state(
        (
            n["name"],
            np.frombuffer(n["keys"], dtype=np.uint32).copy(),
            n["pos"],
            n["has_gauss"],
            n["cached"],
        )
    )
    (torch_rng or torch.default_generator).set_state(state["torch"])

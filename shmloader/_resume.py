"""state_dict() / load_state_dict(): where a loader stands in its run.

The main process knows which batches it yielded, so a state needs no round
trip to the workers: it is put together from what was recorded as the
epoch began and as batches were yielded.

    at epoch start   the sampler's own state_dict() where it has one, else
                     the loader generator's state and torch's global RNG
                     state (what RandomSampler and friends draw from);
                     the iterator's base seed (workers' seeds derive from it)
    per batch        which epoch index was yielded; the yielding worker's
                     state after that batch (its random/numpy/torch RNG
                     states, and an IterableDataset's state_dict()), which
                     each worker attaches to every batch it sends

Resuming rebuilds the epoch start, draws (and drops) the indices of the
batches already yielded, and starts each worker from its recorded state, so
batch k + 1 onwards, augmentations included, are the uninterrupted run's.
A new iterator draws a base seed (from the generator, or torch's global RNG
without one); where the uninterrupted run would not have drawn it (mid-epoch,
or persistent workers), the draw is undone.

The state is plain data (ints, floats, bytes, strings, lists, dicts,
tensors): loading one unpickles nothing, so torch.load(weights_only=True)
reads it and a crafted checkpoint cannot run code through it.  Workers'
states travel pickled from worker to main (both the loader's own processes)
and become plain data only when state_dict() is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import random
from array import array

import numpy as np
import torch

from ._next_epoch import attribute, loader_samplers, sampler_generators

# 2: the config names the sampler and batch sampler; 3: batches yielded per worker;
# 4: the states of the generators samplers hold
STATE_VERSION = 4
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


# ---- worker side --------------------------------------------------------------


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


def _rng_only(snapshot) -> dict | None:
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


# ---- main side ----------------------------------------------------------------


def sampler_state(loader):
    """The loader's sampler's own state_dict(), where it has one: taken before
    iter() runs the sampler (a sampler may do its work in __iter__)."""
    stateful = _stateful_sampler(loader)
    return own_state_copy(stateful, "the sampler's") if stateful is not None else None


@dataclasses.dataclass
class Progress:
    """Kept by the loader, updated by its iterators; state_dict() reads it."""

    epoch: int = 0  # seed_per_sample's number of the current epoch
    started: bool = False  # an iterator began this epoch
    finished: bool = False  # ... and ran out
    yielded: int = 0  # epoch indices below this were all yielded
    yielded_beyond: set = dataclasses.field(default_factory=set)  # in_order=False
    # Per worker, which of its batches (and errors) this epoch were yielded, by
    # their number among its tasks: what identifies an IterableDataset's
    # batches (a worker's k-th task gets its k-th), whose epoch positions
    # under in_order=False depend on timing.  (numbers below, set beyond)
    yielded_by_worker: list = dataclasses.field(default_factory=list)
    # Per worker, the task number whose state worker_states holds (IterableDataset).
    state_numbers: list = dataclasses.field(default_factory=list)
    base_seed: int | None = None
    generator_state: torch.Tensor | None = None  # loader.generator at epoch start
    # ... and the generators the samplers hold (see sampler_generators)
    sampler_generator_states: list = dataclasses.field(default_factory=list)
    torch_rng_state: torch.Tensor | None = None  # torch's global RNG at epoch start
    sampler_state: object = None  # the sampler's own state_dict() at epoch start
    # Whether the epoch's sampler drew already (at iter() with workers, which
    # prime their tasks; at the first next() without).
    sampler_started: bool = False
    worker_states: list = dataclasses.field(default_factory=list)  # per worker
    # ... as they were when the epoch began (an epoch replayed from its start
    # restarts persistent workers from these).
    epoch_start_worker_states: list = dataclasses.field(default_factory=list)
    # prefetch_next_epoch: the start of the next epoch, already drawn from.
    next_start: "Progress | None" = None
    # IterableDataset workers that ran out: their states after it (a
    # drop_last partial batch's draws), theirs once the epoch has ended and
    # so every batch they made has been yielded.
    ran_out_states: dict = dataclasses.field(default_factory=dict)

    def epoch_begins(
        self,
        loader,
        epoch: int,
        base_seed: int | None,
        num_workers: int,
        sampler_state,
        *,
        fresh_workers: bool,
        sampler_started: bool = True,
    ) -> None:
        """An epoch begins; fresh_workers: its workers were started for it
        (seeded afresh from base_seed), not kept from the last epoch."""
        self.epoch, self.started, self.finished = epoch, True, False
        self.sampler_started = sampler_started
        self.yielded, self.yielded_beyond = 0, set()
        self.yielded_by_worker = [(0, set()) for _ in range(num_workers)]
        self.state_numbers = [-1] * num_workers
        self.base_seed = base_seed
        self.generator_state = (
            loader.generator.get_state() if loader.generator is not None else None
        )
        self.sampler_generator_states = [g.get_state() for g in sampler_generators(loader)]
        self.torch_rng_state = torch.get_rng_state()
        self.sampler_state = sampler_state
        self.next_start = None
        self.ran_out_states = {}
        # The previous epoch's workers' states are not fresh workers'.
        if len(self.worker_states) != num_workers or fresh_workers:
            self.worker_states = [None] * num_workers
        else:
            # Workers that go on keep their RNGs, but an IterableDataset starts
            # the epoch afresh (a new iter()): its state from the last epoch's
            # end is not where a worker stands before its first batch.
            self.worker_states = [_rng_only(s) for s in self.worker_states]
        self.epoch_start_worker_states = list(self.worker_states)

    def workers_start_from(self, states: list) -> None:
        """The epoch's workers were started in `states` (None: seeded afresh)."""
        self.worker_states = list(states)
        self.epoch_start_worker_states = list(states)

    def begin_like(self, other: "Progress") -> None:
        """Begin the epoch `other` recorded the start of (a prefetched one)."""
        self.epoch, self.started, self.finished = other.epoch, True, False
        self.sampler_started = True
        self.yielded, self.yielded_beyond = 0, set()
        self.yielded_by_worker = [(0, set()) for _ in self.yielded_by_worker]
        self.state_numbers = [-1] * len(self.yielded_by_worker)
        self.epoch_start_worker_states = list(self.worker_states)
        self.base_seed = other.base_seed
        self.generator_state = other.generator_state
        self.sampler_generator_states = other.sampler_generator_states
        self.torch_rng_state = other.torch_rng_state
        self.sampler_state = other.sampler_state
        self.next_start = None
        self.ran_out_states = {}

    def resumed_from(self, resume: "Resume") -> None:
        """The epoch goes on where a loaded state left it."""
        state = resume.state
        self.yielded, self.yielded_beyond = resume.skip, set(resume.skip_beyond)
        saved = resume.yielded_by_worker  # (another num_workers with seed_per_sample)
        if len(saved) == len(self.yielded_by_worker):
            self.yielded_by_worker = [(below, set(beyond)) for below, beyond in saved]
        self.generator_state = state["generator_state"]
        self.sampler_generator_states = state["sampler_generator_states"]
        self.torch_rng_state = state["torch_rng_state"]
        self.sampler_state = state["sampler_state"]
        self.sampler_started = state["sampler_started"]
        # Where each worker stood after its last yielded batch (a replay's
        # workers start from the epoch's start, and get there again).
        saved_states = state["worker_states"]
        self.worker_states = [
            saved_states[i] if i < len(saved_states) else None
            for i in range(len(self.worker_states))
        ]
        self.epoch_start_worker_states = list(state["epoch_start_worker_states"])

    def batch_yielded(self, idx: int, worker_id, worker_state, number=None) -> None:
        """Batch `idx` of the epoch was yielded (or raised): its worker's
        task `number` (IterableDataset only), leaving that worker in
        `worker_state` (None: unchanged)."""
        if number is not None:
            below, beyond = self.yielded_by_worker[worker_id]
            self.yielded_by_worker[worker_id] = (_mark(below, beyond, number), beyond)
            if number < self.state_numbers[worker_id]:
                # Overtaken (in_order=False): the worker's state after a later
                # batch is already kept, and this one is behind it.
                worker_state = None
            else:
                self.state_numbers[worker_id] = number
        if worker_state is not None:
            self.worker_states[worker_id] = worker_state
        if idx < self.yielded:
            # In a replayed IterableDataset's epoch, a position the interrupted
            # run had yielded (positions differ under in_order=False): the
            # batch is known by its worker's number above.
            return
        self.yielded = _mark(self.yielded, self.yielded_beyond, idx)

    def worker_resumed(self, worker_id: int, rng_state) -> None:
        """A persistent worker begins this epoch in `rng_state` (None:
        unchanged): after the last tasks of an epoch broken off, which it
        fetched, drawing from its RNGs, though nobody yielded them."""
        if rng_state is not None:
            self.worker_states[worker_id] = rng_state
            self.epoch_start_worker_states[worker_id] = rng_state

    def worker_ran_out(self, worker_id: int, worker_state) -> None:
        if worker_state is not None:
            self.ran_out_states[worker_id] = worker_state

    def epoch_ended(self) -> None:
        self.finished = True
        for worker_id, worker_state in self.ran_out_states.items():
            self.worker_states[worker_id] = worker_state
        self.ran_out_states = {}


def _mark(below: int, beyond: set, n: int) -> int:
    """Note n as done in (every number below `below`, and those in `beyond`),
    updating `beyond`; returns the new `below`."""
    if n != below:
        beyond.add(n)
        return below
    below += 1
    while below in beyond:
        beyond.discard(below)
        below += 1
    return below


def _stateful_sampler(loader):
    """The sampler whose own state_dict() records where an epoch starts: the
    outermost one (a stateful batch sampler answers for the sampler it holds),
    or one inside a plain BatchSampler."""
    for sampler in [loader.batch_sampler, loader.sampler] + loader_samplers(loader):
        if callable(attribute(sampler, "state_dict")) and callable(
            attribute(sampler, "load_state_dict")
        ):
            return sampler
    return None


def loader_config(loader) -> dict:
    try:
        length = len(loader.dataset)
    except TypeError:
        length = None
    return {
        "dataset_length": length,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "num_workers": loader.num_workers,
        "fetch": loader.fetch,
        "iterable": loader._dataset_kind == 1,
        # shuffle=True's state resumed in order (or the reverse) would be wrong.
        "sampler": type(loader.sampler).__name__,
        "batch_sampler": type(loader.batch_sampler).__name__,
    }


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


# What each field of a state must be: (description, test).
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


def state_dict(loader, progress: Progress) -> dict:
    """A plain dict (see the module's note) that torch.save keeps."""
    finished = progress.finished or not progress.started
    generator = loader.generator
    generator_now = generator.get_state() if generator is not None else None
    sampler_generators_now = [g.get_state() for g in sampler_generators(loader)]
    sampler_now = sampler_state(loader)
    if finished and progress.next_start is not None:
        # The next epoch was prefetched: it starts from where the sampler
        # stood before it was drawn.  (The generators are as the user left
        # them: the prefetch draws on private states of its own.)
        sampler_now = progress.next_start.sampler_state
    state = {
        "version": STATE_VERSION,
        "config": loader_config(loader),
        # A finished epoch resumes with the next one, from the generator and
        # the sampler as they are now (the next iterator starts from them).
        "epoch": progress.epoch + 1 if progress.started and progress.finished else progress.epoch,
        "epoch_finished": finished,
        "batches_yielded": 0 if finished else progress.yielded,
        "batches_yielded_beyond": [] if finished else sorted(progress.yielded_beyond),
        "batches_yielded_by_worker": []
        if finished
        else [[below, sorted(beyond)] for below, beyond in progress.yielded_by_worker],
        "base_seed": progress.base_seed if progress.started else None,
        "generator_state": generator_now if finished else progress.generator_state,
        "sampler_generator_states": sampler_generators_now
        if finished
        else progress.sampler_generator_states,
        "torch_rng_state": None if finished else progress.torch_rng_state,
        "sampler_started": progress.sampler_started and not finished,
        "sampler_state": sampler_now if finished else progress.sampler_state,
        "worker_states": [plain_worker_state(s) for s in progress.worker_states],
        "epoch_start_worker_states": []
        if finished
        else [plain_worker_state(s) for s in progress.epoch_start_worker_states],
        "persistent_workers": loader.persistent_workers,
    }
    parts = [state["sampler_state"]] + [
        worker.get("dataset")
        for key in ("worker_states", "epoch_start_worker_states")
        for worker in state[key]
        if worker is not None
    ]
    unsaved = next((part for part in parts if isinstance(part, UnsavedState)), None)
    if unsaved is not None:
        raise RuntimeError(
            f"shmloader cannot save where this loader stands: {unsaved.reason}. "
            "Give it a state_dict() that works, or remove its state_dict() "
            "method (the loader then saves without that state)."
        )
    return state


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
    stateful = _stateful_sampler(loader)
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


class Resume:
    """A loaded state, consumed by the next iterator."""

    def __init__(self, loader, state: dict):
        self.state = state
        self.finished = state["epoch_finished"]
        self.skip = state["batches_yielded"]
        self.skip_beyond = set(state["batches_yielded_beyond"])
        self.yielded_by_worker = state["batches_yielded_by_worker"]
        # An IterableDataset that cannot say where it was is replayed.
        self.replay = loader._dataset_kind == 1 and not callable(
            attribute(loader.dataset, "load_state_dict")
        )
        if self.finished:
            # The next iterator starts from these (a non-persistent one draws
            # its base seed from the generator first).
            self.restore_generator(loader)
            self.restore_sampler(loader)

    def sampler_ran_out(self, drawn: int) -> ValueError:
        """The error for an epoch whose sampler ended after `drawn` of the
        batches the state says were yielded.  (Not checked by
        load_state_dict: a sampler's length may come from the state it
        restores, or differ from what it yields, as torch allows.)"""
        return ValueError(
            f"the loaded state says {self.skip} batches of this epoch were yielded, but its "
            f"sampler gives only {drawn}: was the state changed after state_dict(), or does "
            "this loader's sampler differ from the one that saved it?"
        )

    def settle_base_seed(self, loader, drawn: int, persistent: bool, rng_before) -> int:
        """The new iterator's base seed.  Where the uninterrupted run drew no
        new one here (mid-epoch, or a persistent iterator), the saved seed
        stands and the new iterator's draw is undone."""
        if self.finished and (not persistent or self.state["base_seed"] is None):
            return drawn
        if loader.generator is not None:
            self.restore_generator(loader)
        elif rng_before is not None:
            torch.set_rng_state(rng_before)
        saved = self.state["base_seed"]
        return drawn if saved is None else saved

    def restore_generator(self, loader) -> None:
        saved = self.state["generator_state"]
        if saved is not None and loader.generator is not None:
            loader.generator.set_state(saved)

    def restore_sampler(self, loader) -> None:
        """The sampler as it stood: its generators' states, and its own
        state_dict() where it has one."""
        generators = sampler_generators(loader)
        saved = self.state["sampler_generator_states"]
        if len(saved) == len(generators):
            for g, state in zip(generators, saved):
                g.set_state(state)
        stateful = _stateful_sampler(loader)
        if stateful is not None and self.state["sampler_state"] is not None:
            stateful.load_state_dict(self.state["sampler_state"])

    def worker_state(self, worker_id: int) -> dict | None:
        """What worker `worker_id` starts from (None: seeded afresh): its RNG
        states, and its dataset's state mid-epoch only (a finished epoch's is
        at its end)."""
        persistent = self.state["persistent_workers"]
        if self.finished:
            states = self.state["worker_states"]
            if not persistent or worker_id >= len(states) or states[worker_id] is None:
                return None
            return {**states[worker_id], "dataset": None}
        # An epoch replayed from its start (a persistent worker went on from
        # the previous epoch's state; a fresh one was seeded afresh).
        states = self.state["epoch_start_worker_states" if self.replay else "worker_states"]
        if worker_id >= len(states) or (self.replay and not persistent):
            return None
        return states[worker_id]

    def main_epoch_start(self) -> dict | None:
        """Without workers: the RNG states of the main process as the
        interrupted epoch began (a stream replayed from its start draws from
        them), or None (a state taken at an epoch's end, or by an older
        shmloader)."""
        states = self.state["epoch_start_worker_states"]
        if (
            self.finished
            or len(states) != 1
            or not isinstance(states[0], dict)
            or "random" not in states[0]
        ):
            return None
        return states[0]

    @property
    def replayed(self) -> int:
        """Batches fetched again and dropped (an IterableDataset without state)."""
        return self.skip + len(self.skip_beyond) if self.replay and not self.finished else 0

    def first_draw(self, draw):
        """Draw the epoch's first indices as at the saved epoch start: with
        torch's global RNG as it was then (RandomSampler without a generator
        seeds itself from it), leaving the caller's RNG as it is, since that
        draw came before the state was taken."""
        saved = self.state["torch_rng_state"]
        if saved is None or not self.state["sampler_started"]:
            return draw()  # it had not drawn yet when the state was taken
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(saved)
            return draw()


def replay_message(skip: int) -> str:
    return (
        f"shmloader: resuming an IterableDataset without state_dict()/load_state_dict(): "
        f"its first {skip} batches of this epoch are fetched again and dropped. Give the "
        "dataset state_dict() and load_state_dict() to resume without replaying."
    )

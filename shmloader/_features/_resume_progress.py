"""Where a loader stands in its run, as its iterators record it (Progress:
the epoch's start, its generators, sampler and workers' states, and which
batches were yielded), and state_dict(), the plain state made of it (its
format: _resume.py, NOTE [resume: state format]).  A loaded state sets the
record again (Progress.resumed_from).  The main process's only.
"""

from __future__ import annotations

import dataclasses

import torch

from .._worker._state import UnsavedState, plain_worker_state, rng_only
from ._next_epoch import sampler_generators
from ._resume import STATE_VERSION, Resume, loader_config, sampler_state


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
            self.worker_states = [rng_only(s) for s in self.worker_states]
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

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

This module holds the state's format (its version, the loader's config it
names) and Resume, a loaded state as the next iterator uses it.  Beside it:
what a worker's state holds (_worker/_state.py, NOTE [resume: the worker's
state]), the record iterators keep as batches are yielded and the
state_dict() made of it (_resume_progress.py), and the checks a state
passes before a loader resumes from it (_resume_check.py).
"""

from __future__ import annotations

import torch

from .._worker._state import own_state_copy
from .._worker._user_objects import attribute
from ._next_epoch import loader_samplers, sampler_generators

# NOTE [resume: state format]
# The fields state_dict() (_resume_progress.py) writes are those
# _resume_check._FIELDS checks on loading, and _foreign_state.py writes them too (from a torchdata state): a
# field added, dropped or changed in meaning changes all three, and
# STATE_VERSION goes up.
# 2: the config names the sampler and batch sampler; 3: batches yielded per worker;
# 4: the states of the generators samplers hold
STATE_VERSION = 4


def sampler_state(loader):
    """The loader's sampler's own state_dict(), where it has one: taken before
    iter() runs the sampler (a sampler may do its work in __iter__)."""
    stateful = stateful_sampler(loader)
    return own_state_copy(stateful, "the sampler's") if stateful is not None else None


def stateful_sampler(loader):
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
        stateful = stateful_sampler(loader)
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

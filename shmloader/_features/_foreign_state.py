"""load_state_dict() of a state torchdata's StatefulDataLoader made.

A StatefulDataLoader (torchdata 0.11) state says how many batches of the
current epoch were yielded and where its samplers stood, but nothing of the
loader that saved it (dataset length, batch size) and no worker RNG states.
It is carried over only where its meaning is sure: a map-style loader
batching with torch's BatchSampler over a SequentialSampler (shuffle=False),
or over a RandomSampler whose generator is a torch.Generator
(shuffle=True with generator=, or a RandomSampler(generator=g)).  torchdata
shuffles with a RandomSampler of its own (stateful) that draws an epoch's
order as torch's does, torch.randperm(n, generator=g), from the generator
state it saves with the epoch: the order is drawn again from that state and
the batches torchdata says were yielded are dropped, as torchdata's own
resume does.  With workers they start from the state's base seed, as
torchdata's do.

Everything else is refused with a ValueError that says what is missing: an
IterableDataset (its position is in its workers' iterators' states, which
shmloader's workers do not take from torchdata's), a dataset state, another
sampler, seed_per_sample (its seeds count epochs, which torchdata does not),
and a shuffled state at an epoch's end (what remains is the next epoch,
whose order torchdata draws otherwise than torch's RandomSampler: torchdata's
does not draw once more as it runs out).  Not loading the state starts the
epoch afresh.
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from ._next_epoch import sampler_generators
from ._resume import STATE_VERSION, loader_config

# torchdata.stateful_dataloader.stateful_dataloader's keys (0.11).
_SINGLE = {"_num_yielded", "_sampler_iter_yielded", "_sampler_iter_state", "_iterator_finished"}
_MULTI = {"_snapshot", "_steps_since_snapshot", "_iterator_finished"}
_MAIN = {"_num_workers", "_sampler_iter_state", "_sampler_iter_yielded", "_base_seed"}

_NOT_LOADING = "Start the epoch afresh instead: do not load this state into the loader."


def _refuse(why: str) -> ValueError:
    return ValueError(
        f"this is a torchdata StatefulDataLoader state, which shmloader cannot carry over: {why}. "
        + _NOT_LOADING
    )


def is_torchdata_state(state: dict) -> bool:
    """Whether `state` has a StatefulDataLoader state's keys (one process, or workers)."""
    return _SINGLE <= state.keys() or (
        _MULTI <= state.keys()
        and isinstance(state["_snapshot"], dict)
        and isinstance(state["_snapshot"].get("_main_snapshot"), dict)
    )


def foreign_state(loader, state: dict) -> dict:
    """A shmloader state (unchecked: check_state checks it next) meaning what
    the torchdata `state` means for `loader`; else a ValueError saying why not."""
    if not is_torchdata_state(state):
        raise ValueError(
            "load_state_dict expects a dict made by shmloader's DataLoader.state_dict() (or by "
            "torchdata's StatefulDataLoader.state_dict()); this dict has no 'version' key and "
            f"is neither (its keys: {sorted(map(str, state))!r:.200})"
        )
    yielded, drawn, main, datasets, finished = _torchdata_fields(state)
    samples, generator_state = _sampler_fields(main["_sampler_iter_state"])
    if loader._dataset_kind == 1:
        raise _refuse(
            "this loader's dataset is an IterableDataset, whose position is in its (and its "
            "workers') iterators' states, which shmloader's workers do not take from torchdata's"
        )
    if any(d is not None for d in datasets):
        raise _refuse(
            "it holds its dataset's own state_dict(), which shmloader does not restore into a "
            "map-style dataset"
        )
    if loader.seed_per_sample:
        raise _refuse(
            "seed_per_sample=True seeds every sample from the epoch's number and the base "
            "seed, and torchdata's state counts no epochs"
        )
    sampler = _reproducible_sampler(loader)
    shuffled = isinstance(sampler, RandomSampler)
    if shuffled != (generator_state is not None):
        raise _refuse(
            "it was saved by a loader that "
            + ("shuffled" if generator_state is not None else "did not shuffle")
            + f", and this loader's sampler is a {type(sampler).__name__}"
        )
    _check_counts(loader, yielded, drawn, samples)
    batches = len(loader)
    if shuffled and (finished or yielded >= batches):
        raise _refuse(
            "it was taken at its epoch's end (every batch yielded), so what remains is the next "
            "epoch, whose order torchdata's RandomSampler draws otherwise than torch's (which "
            "draws once more as it runs out)"
        )
    workers = max(1, loader.num_workers)
    base_seed = main.get("_base_seed")
    if not (isinstance(base_seed, int) and 0 <= base_seed < 1 << 63):
        base_seed = None
    own = sampler_generators(loader)  # a RandomSampler's generator, not the loader's
    return {
        "version": STATE_VERSION,
        "config": loader_config(loader),
        "epoch": 0,
        "epoch_finished": False,
        # Finished (sequential only): every batch yielded, which check_state makes into the
        # epoch's end.
        "batches_yielded": batches if finished else yielded,
        "batches_yielded_beyond": [],
        "batches_yielded_by_worker": [[0, []] for _ in range(workers)],
        "base_seed": base_seed,
        "generator_state": generator_state if shuffled and not own else None,
        "sampler_generator_states": [generator_state] if shuffled and own else [],
        "torch_rng_state": None,
        "sampler_started": True,
        "sampler_state": None,
        "worker_states": [None] * workers,  # seeded afresh from the base seed
        "epoch_start_worker_states": [None] * workers,
        "persistent_workers": loader.persistent_workers,
    }


def _torchdata_fields(state: dict):
    """(batches yielded, batches drawn from the sampler, the state with the
    sampler's fields, the dataset states it holds, whether the epoch ran out)."""
    try:
        if _SINGLE <= state.keys():
            yielded, main = state["_num_yielded"], state
            datasets = [state.get("dataset_state"), state.get("fetcher_state")]
        else:
            snapshot = state["_snapshot"]
            main = snapshot["_main_snapshot"]
            if not _MAIN <= main.keys():
                raise _refuse(f"its '_main_snapshot' lacks {sorted(_MAIN - main.keys())}")
            yielded = snapshot["_snapshot_step"] + state["_steps_since_snapshot"]
            workers = snapshot.get("_worker_snapshots") or {}
            datasets = [
                w.get(key) for w in workers.values() for key in ("dataset_state", "fetcher_state")
            ]
        drawn, finished = main["_sampler_iter_yielded"], state["_iterator_finished"]
    except (KeyError, TypeError, AttributeError) as e:
        raise _refuse(f"it is malformed ({type(e).__name__}: {e})") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (yielded, drawn)):
        raise _refuse(
            f"its counts of batches yielded ({yielded!r:.50}) and drawn ({drawn!r:.50}) should "
            "be ints >= 0"
        )
    return yielded, drawn, main, datasets, bool(finished)


def _sampler_fields(sampler_iter_state):
    """(samples its BatchSampler drew, the shuffling generator's state at the
    epoch's start or None) from torchdata's batch sampler iterator's state."""
    if not (isinstance(sampler_iter_state, dict) and "samples_yielded" in sampler_iter_state):
        raise _refuse(
            "its sampler's state is not that of torchdata's BatchSampler (the loader batched "
            "with a batch_sampler of its own, or batch_size=None)"
        )
    samples = sampler_iter_state["samples_yielded"]
    inner = sampler_iter_state.get("sampler_iter_state")
    if inner is None:
        return samples, None
    generator = inner.get("generator") if isinstance(inner, dict) else None
    if not isinstance(generator, torch.Tensor):
        raise _refuse(
            "its sampler is a stateful sampler other than torchdata's RandomSampler, whose "
            "state means nothing to this loader's"
        )
    return samples, generator


def _reproducible_sampler(loader):
    """The loader's SequentialSampler, or RandomSampler drawing an epoch's
    order as torchdata's does, batched by torch's BatchSampler; else refused."""
    batcher = loader.batch_sampler
    sampler = getattr(batcher, "sampler", None)
    if type(batcher) is not BatchSampler or type(sampler) not in (
        SequentialSampler,
        RandomSampler,
    ):
        raise _refuse(
            "shmloader resumes its order only for a loader batching with torch's BatchSampler "
            "over a SequentialSampler (shuffle=False) or a RandomSampler with a generator "
            f"(shuffle=True, generator=...); this loader's batch_sampler is a "
            f"{type(batcher).__name__} over a {type(sampler).__name__}"
        )
    if type(sampler) is RandomSampler and (
        sampler.replacement
        or sampler.num_samples != len(sampler.data_source)
        or sampler.generator is None
    ):
        raise _refuse(
            "this loader's RandomSampler "
            + (
                "has no generator: it seeds a new one from torch's global RNG every epoch, so "
                "the state's generator cannot be given to it (pass generator= to the loader)"
                if sampler.generator is None
                else "draws with replacement or another num_samples, which torchdata draws "
                "otherwise"
            )
        )
    return sampler


def _check_counts(loader, yielded: int, drawn: int, samples) -> None:
    """The state's counts fit this loader's batching (torchdata saves no batch
    size or dataset length: its counts are all there is to check)."""
    n = len(loader.batch_sampler.sampler)
    full = drawn * loader.batch_size
    fits = isinstance(samples, int) and (
        samples == min(full, n) or loader.drop_last and samples == n and full <= n
    )
    if not fits or yielded > len(loader):
        raise _refuse(
            f"its counts ({yielded} batches yielded, {drawn} drawn, {samples!r:.50} samples "
            f"drawn) do not fit this loader's batch_size={loader.batch_size}, "
            f"drop_last={loader.drop_last} and {n} samples: was it saved over another dataset "
            "or with other batching?"
        )

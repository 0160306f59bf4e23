"""The public exceptions (shmloader/_errors.py, NOTE [errors: one base, old bases kept]): each
is a shmloader.ShmloaderError and still an instance of the class it subclassed before that base
came, so that neither `except shmloader.ShmloaderError` nor a user's older `except
RuntimeError` misses it; the warnings, ShmloaderWarning and RingBypassedWarning under it, stay
UserWarnings and no errors."""

import warnings

import pytest
import torch

import shmloader

# Each public exception, and what it subclassed before ShmloaderError came.
OLD_BASES = {
    "WorkerDied": RuntimeError,
    "SharedMemoryError": RuntimeError,
    "SampleLayoutError": RuntimeError,
}


def _public(kind):
    return sorted(
        name
        for name in shmloader.__all__
        if isinstance(getattr(shmloader, name), type) and issubclass(getattr(shmloader, name), kind)
    )


def test_every_public_error_is_listed_here():
    errors = [
        name for name in _public(BaseException) if not issubclass(getattr(shmloader, name), Warning)
    ]
    assert errors == sorted([*OLD_BASES, "ShmloaderError"])


@pytest.mark.parametrize("name", sorted(OLD_BASES))
def test_error_is_a_shmloader_error_and_its_old_base(name):
    error = getattr(shmloader, name)("message")
    assert isinstance(error, shmloader.ShmloaderError)
    assert isinstance(error, OLD_BASES[name])
    with pytest.raises(OLD_BASES[name], match="^message$"):
        raise error
    with pytest.raises(shmloader.ShmloaderError, match="^message$"):
        raise getattr(shmloader, name)("message")


@pytest.mark.parametrize("name", ["ShmloaderWarning", "RingBypassedWarning"])
def test_the_warnings_stay_user_warnings_and_no_errors(name):
    assert _public(Warning) == ["RingBypassedWarning", "ShmloaderWarning"]
    warning = getattr(shmloader, name)("message")
    assert isinstance(warning, UserWarning)
    assert isinstance(warning, shmloader.ShmloaderWarning)
    assert not isinstance(warning, shmloader.ShmloaderError)
    with pytest.warns(UserWarning, match="^message$"):
        warnings.warn(warning, stacklevel=1)


class _FirstBatchesLarger(torch.utils.data.Dataset):
    """10 batches of 2: the first 2 of 80 KB, the last 8 of 24 KB (too large to be copied
    out of their slots)."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return torch.full((40000 if i < 4 else 12000,), i, dtype=torch.uint8)


def test_one_filter_keeps_shmloaders_warnings_warnings_where_others_are_errors():
    """A project whose tests make warnings errors (pytest -W error) keeps the batches torch's
    loader gives, with a filter on the category of shmloader's warnings alone: the ring full
    (every batch kept) and the spill (batches outgrowing their slots) are warnings still."""

    def every_batch(cls, **options):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("error")
            warnings.filterwarnings("always", category=shmloader.ShmloaderWarning)
            batches = list(cls(_FirstBatchesLarger(), batch_size=2, num_workers=2, **options))
        return [b.tolist() for b in batches], [str(w.message)[:38] for w in seen]

    torchs, _ = every_batch(torch.utils.data.DataLoader)
    kept, warned = every_batch(shmloader.DataLoader, num_slots=6, slot_bytes=32768)
    assert kept == torchs
    assert warned == [
        "shmloader: a batch did not fit its slo",
        "shmloader: all 6 ring slots are in use",
    ]

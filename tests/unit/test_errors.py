"""The public exceptions (shmloader/_errors.py, NOTE [errors: one base, old bases kept]): each
is a shmloader.ShmloaderError and still an instance of the class it subclassed before that base
came, so that neither `except shmloader.ShmloaderError` nor a user's older `except
RuntimeError` misses it; the warning stays a UserWarning and no error."""

import warnings

import pytest

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


def test_the_warning_stays_a_user_warning_and_no_error():
    assert _public(Warning) == ["RingBypassedWarning"]
    warning = shmloader.RingBypassedWarning("message")
    assert isinstance(warning, UserWarning)
    assert not isinstance(warning, shmloader.ShmloaderError)
    with pytest.warns(UserWarning, match="^message$"):
        warnings.warn(warning, stacklevel=1)

"""Scale (docs/reliability.md, "Scale"): many workers, many loaders, a low open-files limit."""

import os
import resource

import pytest

from shmloader._shm._ring import Ring


@pytest.fixture
def nofile_at_least():
    """Raise this process's soft RLIMIT_NOFILE to `n` for the test (poll() refuses more
    fds than it), back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def at_least(n):
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"the hard open-files limit ({hard}) is under {n}")
        if soft != resource.RLIM_INFINITY and soft < n:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))

    yield at_least
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_wait_takes_any_number_of_fds(nofile_at_least):
    """The wait polls the ring's eventfd with every fd it is given, however many: two a
    worker (result pipe, process sentinel), so 600 workers wait on 1,200 fds.  It once
    copied them into a fixed array of 1,025 and refused more with a bare EINVAL."""
    count = 1500
    nofile_at_least(count + 64)
    ring = Ring.create_memfd("shmloader-test", 2, 4096)
    quiet_r, quiet_w = os.pipe()
    fired_r, fired_w = os.pipe()
    quiet = [os.dup(quiet_r) for _ in range(count)]
    try:
        fds = [*quiet[: count // 2], fired_r, *quiet[count // 2 :]]
        assert ring.wait(0, fds) is None  # nothing fired: a timeout
        os.write(fired_w, b"x")
        assert ring.wait(5, fds) == [fired_r]
        os.write(quiet_w, b"x")
        assert ring.wait(5, fds) == fds  # every one's revents comes back
    finally:
        for fd in (*quiet, quiet_r, quiet_w, fired_r, fired_w):
            os.close(fd)

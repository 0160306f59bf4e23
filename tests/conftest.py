import faulthandler
import os
import signal

import pytest
from hypothesis import settings

from shmloader._shm import _layout
from tests.helpers.procs import HANG_TIMEOUT_S, rearm_hang_guard

# A suite started in the background by a non-interactive shell (`pytest ... &`, as a CI
# script or tests/helpers/stress.py may be) inherits SIGINT ignored, and so would every process
# it starts: the tests that interrupt a training process with SIGINT would then wait for
# an exit that never comes.  Python's own handler here makes children start with the
# default disposition again (a handled signal is reset by exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The property tests draw the same examples on every run unless asked not to, so that a
# red CI run is the code's doing and reproducible, not the draw's.  A longer, random
# hunt (the hang guard below must allow it the time): SHMLOADER_HYPOTHESIS_RANDOM=1
# SHMLOADER_FUZZ_EXAMPLES=20000 SHMLOADER_TEST_HANG_TIMEOUT=7200 python -m pytest tests/unit/test_properties.py
settings.register_profile("fixed", derandomize=True)
settings.register_profile("random", derandomize=False)
settings.load_profile("random" if os.environ.get("SHMLOADER_HYPOTHESIS_RANDOM") else "fixed")


# A loader that deadlocks must fail the run, not hang it: dump every thread's stack and exit
# (after HANG_TIMEOUT_S, tests/helpers/procs.py; a long test re-arms it as it makes progress).
@pytest.fixture(autouse=True)
def _hang_guard():
    rearm_hang_guard(HANG_TIMEOUT_S)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def views_only(monkeypatch):
    """Every slot leaf a view, small ones too (none copied out: see _layout's
    SMALL_LEAF_BYTES), for tests of what holding a batch does to its slot, whose small
    test batches would otherwise arrive as copies that hold nothing."""
    monkeypatch.setattr(_layout, "SMALL_LEAF_BYTES", 0)

import faulthandler
import os

import pytest

# A loader that deadlocks must fail the run, not hang it: dump every thread's stack and exit.
HANG_TIMEOUT_S = float(os.environ.get("SHMLOADER_TEST_HANG_TIMEOUT", "240"))


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()

"""The C ring under sanitizers: tests/c/ring_stress.c (with csrc/shmring.c) built three ways
with gcc and run to completion; see the top of ring_stress.c for what it checks.

* plain -O2: the optimised code the extension ships, checked for wrong payloads, lost
  wake-ups, waits that do not wake on a producer's death, and copy_stream against memcpy.
* -fsanitize=thread: ThreadSanitizer keeps a shadow per process and does not track memory
  shared between processes (a write by a producer process and the consumer's read of it are
  invisible to each other), so the multi-process phase only checks the threads inside each
  producer process.  The memory-ordering claims of shmring.h are checked by the program's
  last phase, where producers and a second releasing thread live in the consumer's process
  on one mapping of the ring, so every hand-off is visible to TSan.
* -fsanitize=address,undefined: out-of-bounds access (copy_stream, slot and header
  arithmetic), use after free of handles, leaks (also in the forked producers), and
  undefined behaviour (misaligned access, overflow, bad shifts), all fatal.

A sanitizer is skipped only when gcc cannot build (or the runtime cannot start) a trivial
threaded program with it on this machine; the reason is given in the skip message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import rearm_hang_guard, run_job

# Builds the C ring with gcc sanitizers and stresses it: deselect with -m "not sanitizers".
pytestmark = [pytest.mark.sanitizers, pytest.mark.slow, pytest.mark.one_mode]

SOURCES = [ROOT / "tests" / "c" / "ring_stress.c", ROOT / "csrc" / "shmring.c"]
CC = os.environ.get("CC", "gcc")
# A bound on a hang of a whole ring_stress run (its own checks catch a stall within
# minutes): the ThreadSanitizer build takes ~30 s alone, 10-20 times that on a loaded machine.
TIMEOUT_S = 900
COMMON = ["-std=c11", "-Wall", "-Wextra", "-I", str(ROOT / "csrc"), "-pthread"]

BUILDS = {
    "plain": {
        "flags": ["-O2"],
        "args": ["-r", "50000", "-t", "50000"],
    },
    "tsan": {
        "flags": ["-fsanitize=thread", "-O1", "-g"],
        "args": ["-r", "20000", "-t", "30000", "-p", "3", "-n", "4"],
    },
    "asan-ubsan": {
        "flags": [
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
            "-O1",
            "-g",
        ],
        "args": ["-r", "30000", "-t", "30000"],
    },
}

SANITIZER_ENV = {
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:second_deadlock_stack=1:report_signal_unsafe=1",
    "ASAN_OPTIONS": "halt_on_error=1:abort_on_error=1:detect_leaks=1:"
    "detect_stack_use_after_return=1:strict_string_checks=1:"
    "check_initialization_order=1",
    "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=1",
}

REPORT_MARKERS = (
    "WARNING: ThreadSanitizer",
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "runtime error:",
    "FATAL: ThreadSanitizer",
    "ThreadSanitizer: reported",
)

TRIVIAL = r"""
#include <pthread.h>
#include <stdio.h>
static void *run(void *arg) { return arg; }
int main(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, run, NULL) != 0) return 1;
    pthread_join(t, NULL);
    puts("ok");
    return 0;
}
"""


def _env():
    env = dict(os.environ)
    env.update(SANITIZER_ENV)
    return env


def _run(cmd, timeout):
    """Run cmd in its own session; past `timeout` the whole group is killed (forked
    producers too) and the test fails."""
    done = run_job(cmd, timeout, env=_env())
    return done.returncode, done.stdout


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler ({CC}) on this machine")
    return tmp_path_factory.mktemp("ring_stress")


def _probe(build_dir: Path, name: str, flags: list[str]) -> None:
    """Skip when gcc cannot build, or the sanitizer runtime cannot run, a trivial threaded
    program with these flags."""
    src = build_dir / "trivial.c"
    src.write_text(TRIVIAL)
    exe = build_dir / f"trivial-{name}"
    res = subprocess.run(
        [CC, *flags, "-pthread", str(src), "-o", str(exe)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if res.returncode != 0:
        pytest.skip(f"{CC} cannot build with {' '.join(flags)} here: {res.stderr.strip()[-500:]}")
    rc, out = _run([str(exe)], 60)
    if rc != 0 or out.strip() != "ok":
        pytest.skip(
            f"the {name} runtime cannot run a trivial program here "
            f"(exit {rc}): {out.strip()[-500:]}"
        )


@pytest.mark.parametrize("name", list(BUILDS))
def test_ring_stress(build_dir, name):
    build = BUILDS[name]
    _probe(build_dir, name, build["flags"])
    exe = build_dir / f"ring_stress-{name}"
    res = subprocess.run(
        [CC, *COMMON, *build["flags"], *map(str, SOURCES), "-o", str(exe)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"building ring_stress ({name}) failed:\n{res.stderr}"

    rearm_hang_guard(TIMEOUT_S + 60)  # the run's own bound decides, with its output
    start = time.monotonic()
    rc, out = _run([str(exe), *build["args"]], TIMEOUT_S)
    elapsed = time.monotonic() - start
    reports = [m for m in REPORT_MARKERS if m in out]
    assert rc == 0 and not reports, (
        f"ring_stress ({name}) exited {rc} after {elapsed:.1f} s"
        + (f" with sanitizer reports {reports}" if reports else "")
        + f":\n{out}"
    )
    for phase in ("copy:", "api:", "procs:", "death:", "threads:", "OK"):
        assert f"ring_stress: {phase}" in out, f"phase {phase!r} did not report:\n{out}"


def test_a_late_producer_takes_no_row_of_the_slots_next_batch(build_dir):
    """fetch="sample" with assignment="dynamic": a worker stopped inside row_claim between its
    look at the slot and its CAS, while the batch is completed and the slot begun again for
    the next one, must not take (and fill with its own sample) a row of that next batch.
    tests/c/row_claim_race.c stops it there through the pause shmring.c leaves for it."""
    _probe(build_dir, "plain", ["-O2"])
    exe = build_dir / "row_claim_race"
    res = subprocess.run(
        [
            CC,
            *COMMON,
            "-O2",
            "-DSHMRING_ROW_CAS_PAUSE=row_cas_pause_here",
            str(ROOT / "tests" / "c" / "row_claim_race.c"),
            str(ROOT / "csrc" / "shmring.c"),
            "-o",
            str(exe),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, f"building row_claim_race failed:\n{res.stderr}"
    rc, out = _run([str(exe)], 30)
    assert rc == 0 and "late producer: -ESTALE" in out, out

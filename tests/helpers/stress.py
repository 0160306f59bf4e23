"""Run pytest several times with every core kept busy, and list each test that failed at
least once: the suite's verdicts must not depend on how loaded the machine is (CI runs on a
shared 2-core machine).

    python tests/helpers/stress.py --runs 3                                  # the whole suite
    python tests/helpers/stress.py --runs 10 tests/robustness/test_kill_matrix.py tests/robustness/test_lifecycle.py
    python tests/helpers/stress.py --runs 20 tests/equivalence/test_equivalence.py -- -k shallow_copy

Load comes from `stress-ng --cpu N` where Debian's stress-ng is installed, else from N
busy-loop processes (N = the number of cores unless --load says otherwise).  Each run's
results are read from its JUnit XML; the exit status is 1 if any test failed in any run.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET


def _spin(parent: int):
    # Until the stress run is gone, however it ended (killed, it runs no cleanup).
    while os.getppid() == parent:
        for _ in range(1_000_000):
            pass


def start_load(n: int):
    """Processes that keep `n` cores busy until stop_load()."""
    if shutil.which("stress-ng"):
        # (--timeout: stress-ng outlives a stress run that is killed.)
        return [subprocess.Popen(["stress-ng", "--cpu", str(n), "--quiet", "--timeout", "12h"])]
    procs = [
        multiprocessing.get_context("spawn").Process(target=_spin, args=(os.getpid(),), daemon=True)
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    return procs


def stop_load(procs):
    for p in procs:
        if isinstance(p, subprocess.Popen):
            p.terminate()
            p.wait()
        else:
            p.terminate()
            p.join()


def failed_tests(junit_path: str):
    """(node ids that failed or errored, tests run) from one JUnit XML report."""
    failed, ran = [], 0
    for case in ET.parse(junit_path).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return failed, ran


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="times to run pytest (default 3)")
    parser.add_argument(
        "--load",
        type=int,
        default=os.cpu_count(),
        help="busy processes beside the tests (default: one per core)",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        default=["tests"],
        help="what pytest runs (default: tests); pytest's own options after --",
    )
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = parser.parse_args(argv[:cut]), argv[cut + 1 :]

    failures = collections.Counter()
    # A TERM ends the run through its cleanup (the load stops, pytest is not left behind).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = start_load(args.load) if args.load > 0 else []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(1, args.runs + 1):
                junit = os.path.join(tmp, f"run{run}.xml")
                start = time.monotonic()
                code = subprocess.call(
                    [
                        sys.executable,
                        "-m",
                        "pytest",
                        "-q",
                        "-p",
                        "no:cacheprovider",
                        f"--junitxml={junit}",
                        *args.paths,
                        *pytest_args,
                    ]
                )
                if not os.path.exists(junit):
                    print(f"run {run}: pytest exited {code} without a report", flush=True)
                    return 1
                failed, ran = failed_tests(junit)
                failures.update(failed)
                print(
                    f"run {run}/{args.runs}: {ran} tests, {len(failed)} failed, "
                    f"{time.monotonic() - start:.0f} s, load {args.load}",
                    flush=True,
                )
    finally:
        stop_load(load)
    if not failures:
        print(f"no test failed in {args.runs} runs")
        return 0
    print(f"tests that failed at least once in {args.runs} runs:")
    for name, count in failures.most_common():
        print(f"  {count}/{args.runs}  {name}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""What the tests use and are not tests: the datasets workers import by name (datasets.py),
what they read from /proc (procs.py), the drivers that run a scenario in a process of its own
(*_driver.py, run as `python -m tests.helpers.NAME` from ROOT) and the suite under load
(stress.py)."""

from pathlib import Path

# The repository's root: where a subprocess runs so that `tests.*` imports.
ROOT = Path(__file__).resolve().parents[2]

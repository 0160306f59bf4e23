"""The machine and the versions a record of figures names, so that figures can be traced to
where and with what they were measured."""

import importlib.metadata
import os
import platform
import subprocess
from typing import Any

import numpy
import torch

import shmloader

# Versions recorded beside torch's and numpy's: the bench extra's packages (read from
# their metadata, so that a missing one is None and nothing is imported).
OPTIONAL_PACKAGES = ("psutil", "pillow", "matplotlib")


def machine() -> dict[str, Any]:
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": proc_bytes("/proc/meminfo", "MemTotal"),
        "dev_shm_bytes": _dev_shm_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        **{package: _installed_version(package) for package in OPTIONAL_PACKAGES},
        "shmloader": _installed_version("shmloader"),
        "shmloader_path": os.path.dirname(shmloader.__file__),
        "shmloader_commit": _commit(os.path.dirname(shmloader.__file__)),
    }


def machine_line(m: dict[str, Any], commit: bool = True) -> str:
    """The machine of a record (machine()) in one line. `commit`: with the commit of the
    checkout shmloader ran from, if any; the docs leave it out (that is history, kept in
    CHANGELOG.md)."""
    at = f" at {m['shmloader_commit']}" if commit and m["shmloader_commit"] else ""
    return (
        f"{m['cores']} cores ({m['cpu_model']}), {m['memory_bytes'] / 2**30:.1f} GiB, Python {m['python']}, "
        f"torch {m['torch']}, numpy {m['numpy']}, {m['platform']}, shmloader {m.get('shmloader')}{at}"
    )


def _commit(path: str) -> str | None:
    """The git commit of the checkout that holds `path`, "+" if it has changes; None for
    an installed package."""
    try:
        head = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except OSError:  # no git
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _cpu_model() -> str | None:
    with open("/proc/cpuinfo") as f:
        return next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None
        )


def proc_bytes(path: str, *fields: str) -> int:
    """The sum of `fields` of a /proc file that counts in kB (/proc/meminfo,
    /proc/PID/status, /proc/PID/smaps_rollup), in bytes."""
    total = 0
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                total += int(rest.split()[0])
    return total * 1024


def _dev_shm_bytes() -> int | None:
    try:
        vfs = os.statvfs("/dev/shm")
    except OSError:
        return None
    return vfs.f_blocks * vfs.f_frsize


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None

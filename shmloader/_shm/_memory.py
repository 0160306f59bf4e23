"""How much memory this process can still get: what a new ring is checked
against before it is made, so that a lack of memory is a clear error then,
never an OOM kill or a SIGBUS mid-epoch.

The ring's pages are shared memory (memfd), charged to the memory cgroup of
the process that reserves them, and counted in the machine's MemAvailable
until then.  The room is the smallest of: MemAvailable, and limit less usage
of the process's memory cgroup and of each cgroup above it (v2 memory.max /
memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes).  A
cgroup's usage counts the page cache of the files its processes read (a
dataset's images), which the kernel drops to make room before it kills
anything: that cache (memory.stat's file LRU lists, which hold no shared
memory) counts as room, as it does in MemAvailable."""

from __future__ import annotations

import os
from typing import NamedTuple

CGROUP_ROOT = "/sys/fs/cgroup"


class _Files(NamedTuple):
    """Where a cgroup version keeps what _cgroup_room reads."""

    mount: str  # below CGROUP_ROOT
    limit: str
    usage: str
    cache_lines: tuple[str, ...]  # memory.stat's page cache (this cgroup and those below it)


_FILES = {  # the version, as the controller line in /proc/self/cgroup says it
    "v2": _Files("", "memory.max", "memory.current", ("inactive_file", "active_file")),
    "v1": _Files(
        "memory",
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        ("total_inactive_file", "total_active_file"),
    ),
}


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _page_cache(where: str, version: str) -> int:
    """Bytes of page cache charged to the cgroup at `where`: memory the
    kernel reclaims when a ring's pages need it."""
    wanted = _FILES[version].cache_lines
    total = 0
    try:
        with open(os.path.join(where, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in wanted and value.strip().isdigit():
                    total += int(value)
    except OSError:
        pass
    return total


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_lines() -> list[str]:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _cgroup_dirs():
    """(version, mount, path below it) of this process's memory cgroups."""
    for line in _cgroup_lines():
        _, controllers, path = line.split(":", 2)
        version = (
            "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        )
        if version is None:
            continue
        mount = os.path.join(CGROUP_ROOT, _FILES[version].mount)
        if version == "v2" and not os.path.exists(os.path.join(mount, "cgroup.controllers")):
            mount = os.path.join(CGROUP_ROOT, "unified")  # hybrid hierarchy
        # Inside a cgroup namespace (a container) the path is "/" and the
        # mount is the container's own cgroup.
        yield version, mount, path.lstrip("/")


def _cgroup_room() -> tuple[int, str] | None:
    """(bytes, the cgroup in words) of the tightest memory cgroup limit over
    this process's cgroup and those above it, or None without a limit."""
    best = None
    for version, mount, path in _cgroup_dirs():
        files = _FILES[version]
        parts = path.split("/") if path else []
        for depth in range(len(parts), -1, -1):
            where = os.path.join(mount, *parts[:depth])
            limit = _read_int(os.path.join(where, files.limit))
            usage = _read_int(os.path.join(where, files.usage))
            # v1 writes "no limit" as a huge number, near 2**63.
            if limit is None or usage is None or limit >= 1 << 62:
                continue
            cache = min(usage, _page_cache(where, version))
            room = max(0, limit - usage + cache)
            if best is None or room < best[0]:
                best = (
                    room,
                    f"the memory cgroup {where} has {room} bytes left "
                    f"({usage} of its {limit} in use, {cache} of that page cache)",
                )
    return best


def available() -> tuple[int, str]:
    """(bytes of memory this process can get now, that room in words)."""
    found = []
    free = _mem_available()
    if free is not None:
        found.append((free, f"the machine has {free} bytes available (MemAvailable)"))
    cgroup = _cgroup_room()
    if cgroup is not None:
        found.append(cgroup)
    if not found:
        return 1 << 62, "the memory available cannot be read"
    return min(found)

"""shmloader's own forkservers: workers started with the forkserver or the
spawn method fork from a server that has imported torch and the worker's
code already.

Python's forkserver imports only its preload list (by default the user's
__main__), and spawn imports everything afresh, so each worker imports
torch afresh: about a second of CPU per worker, at every epoch of a
non-persistent loader.  A server of shmloader's is a fresh interpreter
started once per process and start method, on first use, that imports
torch and shmloader's worker loop:
- for forkserver, it also preloads what the user's forkserver would (their
  list as it is then): its workers are what Python's would be, torch
  imported;
- for spawn, it preloads nothing of the user's (not their __main__): each
  worker prepares itself as a spawned one does (sys.path, the working
  directory, the user's main module imported afresh as __mp_main__) after
  it forks, so what a spawned worker runs at its start runs in each.  What
  it shares with its server is what importing torch made, in a process
  that never ran anything of the user's (no CUDA, no threads of theirs);
  its environment is the server's, which is started again when os.environ
  changed (own_server), so it is the one a spawned worker would have.
The user's multiprocessing settings are only read, never changed: their
forkserver (the global one, its preload list) and their start method are as
they left them.  Workers are the server's children, not this process's.

Popen._launch below is Python's popen_forkserver.Popen._launch, the same in
Python 3.10 to 3.13, with its server made this module's.  Where the installed
Python's differs (_SAME_LAUNCH), workers start through Python's own
forkserver or spawn.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import types
import weakref
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, spawn, util

import numpy as np

# What shmloader's server imports before any worker forks from it.
_PRELOAD = ["torch", "shmloader._worker._loop"]

_SAME_LAUNCH = popen_forkserver.Popen._launch.__code__.co_names == (  # type: ignore[attr-defined]
    "spawn",
    "get_preparation_data",
    "_name",
    "io",
    "BytesIO",
    "set_spawning_popen",
    "reduction",
    "dump",
    "forkserver",
    "connect_to_new_process",
    "_fds",
    "sentinel",
    "os",
    "dup",
    "util",
    "Finalize",
    "close_fds",
    "finalizer",
    "open",
    "write",
    "getbuffer",
    "read_signed",
    "pid",
)

_lock = threading.Lock()
# start method -> (its server, for spawn the environment it was started with)
_servers: dict[str, tuple[forkserver.ForkServer, dict[str, str] | None]] = {}
_servers_pid: int | None = None  # the process that owns _servers (not a forked copy)
# Servers replaced by one of a newer environment.  A server gone would read to
# the pools of the workers forked from it as their deaths (their exit codes
# come through it), so each lives on while any of those workers' Popen is
# still held (_forked), and is stopped at the first own_server() after:
# a process whose environment changes every epoch keeps a few servers, each
# a process with torch imported, not one per change.
_replaced: list[forkserver.ForkServer] = []
_forked: weakref.WeakKeyDictionary[forkserver.ForkServer, weakref.WeakSet] = (
    weakref.WeakKeyDictionary()
)


def _connect(popen: _Popen, fds) -> tuple[int, int]:
    """A new worker's (sentinel, data pipe) from its start method's server,
    the worker counted as that server's while `popen` lives (one lock for
    both, so that the server is not stopped in between)."""
    with _lock:
        server = _own_server(popen.method)
        connection = server.connect_to_new_process(fds)
        _forked.setdefault(server, weakref.WeakSet()).add(popen)
        return connection


def _stop(server: forkserver.ForkServer) -> None:
    """End a server that no held worker came from.  Not ForkServer._stop,
    which waits for the server to see its alive pipe closed: processes forked
    from this one since (fork workers of another loader) hold that pipe's
    write end too, and the wait would never end."""
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:  # never started
        return
    os.close(server._forkserver_alive_fd)  # type: ignore[attr-defined]
    try:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):  # killed and reaped by someone else
        pass
    server._forkserver_pid = server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def own_server(method: str = "forkserver") -> forkserver.ForkServer:
    """This process's server for workers of start method `method`, made on
    first use (see the module's docstring for what it preloads); for spawn,
    made again whenever os.environ has changed since, so that a worker has
    the environment a process spawned now would (variables read as a
    process starts, LD_PRELOAD or MALLOC_*, included)."""
    with _lock:
        return _own_server(method)


def _own_server(method: str) -> forkserver.ForkServer:
    global _servers_pid
    if _servers_pid != os.getpid():
        _servers.clear()
        _replaced.clear()
        _servers_pid = os.getpid()
    for server in [s for s in _replaced if not _forked.get(s)]:
        _replaced.remove(server)
        _stop(server)
    environment = dict(os.environ) if method == "spawn" else None
    known = _servers.get(method)
    if known is not None and known[1] == environment:
        return known[0]
    if known is not None:
        _replaced.append(known[0])
    users = (
        getattr(forkserver._forkserver, "_preload_modules", ["__main__"])
        if method == "forkserver"
        else []
    )
    preload = [*users, *(m for m in _PRELOAD if m not in users)]
    if method == "spawn" or not _preloads_torch(users):
        preload.append("shmloader._worker._fresh_torch_generator")
    if method == "spawn" or not _preloads_numpy_random(users):
        preload.append("shmloader._worker._fresh_numpy_generator")
    server = forkserver.ForkServer()
    server.set_forkserver_preload(preload)
    _servers[method] = (server, environment)
    return server


# NOTE [forkserver: fresh generators]
# A process that imports torch starts torch's global generator from fresh
# entropy, and numpy.random's likewise: each of torch's spawned workers has
# its own, where every process forked from a server that imported them starts
# from the server's state, the same in all.  What draws from them before
# torch's worker seeding (a dataset's unpickling, a script's module level)
# would tell shmloader's workers from torch's.  So where a worker stands in
# for a process that imports them afresh (spawn; forkserver where Python's
# server would not have imported them), the server is also made to import
# _worker/_fresh_torch_generator.py and _fresh_numpy_generator.py, which
# reseed each of its children at once after the fork, before anything of the
# user's runs there (a spawned worker's import of the user's main module).
# Python's random reseeds itself after a fork.


def _preloads_torch(users: list[str]) -> bool:
    """Whether Python's own forkserver, with the user's preload list, would
    import torch before its workers fork.  A module named besides __main__ is
    taken to (users preload what their workers need, torch first); __main__
    only where this Python preloads it at all (3.14, and 3.13 since
    gh-126631; until then each worker imports it after its fork) and it is a
    script or module of its own (a training script imports torch)."""
    if any(name != "__main__" for name in users):
        return True
    if "__main__" not in users or not _PRELOADS_MAIN:
        return False
    main = sys.modules.get("__main__")
    return (
        getattr(main, "__file__", None) is not None or getattr(main, "__spec__", None) is not None
    )


def _preloads_numpy_random(users: list[str]) -> bool:
    """Whether Python's own forkserver, with the user's preload list, would
    import numpy.random (its global generator made) before its workers fork:
    where the list names it, or, with a numpy before 2 (which imports it
    with numpy, as torch imports numpy), where it imports numpy or torch."""
    if "numpy.random" in users:
        return True
    return _NUMPY_IMPORTS_RANDOM and ("numpy" in users or _preloads_torch(users))


def _names_in(code) -> set[str]:
    """The strings among a code object's constants, those of its set and
    tuple literals included."""
    names = set()
    for const in code.co_consts:
        if isinstance(const, str):
            names.add(const)
        elif isinstance(const, frozenset | tuple):
            names.update(c for c in const if isinstance(c, str))
    return names


# Whether Python's forkserver preloads __main__ when asked to: until
# gh-126631 it looked for a key ("main_path") that the preparation data no
# longer had, and never did.
_PRELOADS_MAIN = bool(
    {"init_main_from_path", "init_main_from_name"}
    & _names_in(forkserver.ForkServer.ensure_running.__code__)
)


# numpy 2 imports numpy.random at its first use, numpy 1 with numpy.
_NUMPY_IMPORTS_RANDOM = int(np.__version__.split(".")[0]) < 2


class _Popen(popen_forkserver.Popen):
    method = "forkserver"  # whose server the worker forks from

    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)

        self.sentinel, w = _connect(self, self._fds)
        # Keep a duplicate of the data pipe's write end as a sentinel of the
        # parent process used by the child process.
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _SpawnPopen(_Popen):
    method = "spawn"


# Named as Python's own: a process's default name is its class's ("SpawnProcess-3",
# what logging's %(processName)s shows in a worker).
class ForkServerProcess(process.BaseProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class SpawnProcess(process.BaseProcess):
    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj):
        return _SpawnPopen(process_obj)


class _Context(context.ForkServerContext):
    Process = ForkServerProcess  # type: ignore[assignment]


class _SpawnContext(context.SpawnContext):
    Process = SpawnProcess  # type: ignore[assignment]


def _named_as_the_default(cls):
    """`cls`, naming its processes as multiprocessing.Process does ("Process-3"):
    torch starts a loader's workers with it where no multiprocessing_context is
    given, whatever the default start method (forkserver on Python 3.14)."""

    def make(*args, **kwargs):
        process = cls(*args, **kwargs)
        if kwargs.get("name") is None:
            process.name = "Process-" + process.name.partition("-")[2]
        return process

    return staticmethod(make)


class _DefaultContext(_Context):
    Process = _named_as_the_default(ForkServerProcess)  # type: ignore[assignment]


class _DefaultSpawnContext(_SpawnContext):
    Process = _named_as_the_default(SpawnProcess)  # type: ignore[assignment]


_CONTEXTS = {"forkserver": _Context(), "spawn": _SpawnContext()}
_DEFAULT_CONTEXTS = {"forkserver": _DefaultContext(), "spawn": _DefaultSpawnContext()}


def for_workers(ctx):
    """The context to start a loader's workers with: shmloader's server's
    where `ctx` starts processes with a forkserver or spawn, else `ctx`.
    `ctx`: the loader's multiprocessing_context, or the multiprocessing
    module (torch's) where it has none."""
    if _SAME_LAUNCH:
        contexts = _DEFAULT_CONTEXTS if isinstance(ctx, types.ModuleType) else _CONTEXTS
        return contexts.get(ctx.get_start_method(), ctx)
    return ctx


def children_of_a_server(ctx) -> bool:
    """Whether the workers `ctx` starts are a server's children, not this
    process's (which must reap them)."""
    return ctx.get_start_method() == "forkserver" or isinstance(ctx, _SpawnContext)

"""shmloader's own forkserver: workers started with the forkserver method
fork from a server that has imported torch and the worker's code already.

Python's forkserver imports only its preload list (by default the user's
__main__), so each worker imports torch afresh: about a second of CPU per
worker, at every epoch of a non-persistent loader.  A server of shmloader's
own preloads what the user's would, plus torch and shmloader's worker loop,
and is started once per process, on first use.  The user's multiprocessing
settings are only read, never changed: their forkserver (the global one, its
preload list) and their start method are as they left them.

Popen._launch below is Python's popen_forkserver.Popen._launch, the same in
Python 3.10 to 3.13, with its server made this module's.  Where the installed
Python's differs (_SAME_LAUNCH), workers start through Python's own server.
"""

from __future__ import annotations

import io
import os
import threading
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, spawn, util

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
_server: forkserver.ForkServer | None = None
_server_pid: int | None = None  # the process that owns _server (not a forked copy)


def own_server() -> forkserver.ForkServer:
    """This process's server, made on first use with the user's preload list
    as it is now, plus shmloader's."""
    global _server, _server_pid
    with _lock:
        if _server is None or _server_pid != os.getpid():
            users = getattr(forkserver._forkserver, "_preload_modules", ["__main__"])
            _server = forkserver.ForkServer()
            _server.set_forkserver_preload([*users, *(m for m in _PRELOAD if m not in users)])
            _server_pid = os.getpid()
        return _server


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)

        self.sentinel, w = own_server().connect_to_new_process(self._fds)
        # Keep a duplicate of the data pipe's write end as a sentinel of the
        # parent process used by the child process.
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(process.BaseProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(context.ForkServerContext):
    Process = _Process  # type: ignore[assignment]


_CONTEXT = _Context()


def for_workers(ctx):
    """The context to start a loader's workers with: shmloader's forkserver
    where `ctx` starts processes with a forkserver, else `ctx` itself."""
    if _SAME_LAUNCH and ctx.get_start_method() == "forkserver":
        return _CONTEXT
    return ctx

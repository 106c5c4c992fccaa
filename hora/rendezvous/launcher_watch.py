"""Is the launcher that serves this job's rendezvous store still there?

A rank started by a hora launcher (``hora run``, also with ``--data-plane mpi``, ``hora.run()``,
``hora.spark.run``, ``hora.ray``) keeps its connection to the store the launcher serves for as
long as it is initialized. A launcher that is stopped normally (it exits, SIGTERM, Ctrl-C)
stops its ranks first; one that is killed (SIGKILL, the OOM killer) cannot, and its ranks
receive only ``PR_SET_PDEATHSIG``'s SIGTERM, which a training script may handle (to write a
checkpoint) and go on: an orphan that trains for nobody. The kernel closes the killed
launcher's sockets, so the rank's idle store connection reads EOF: :func:`check` looks for that
without blocking or sending anything (the engine calls it with its heartbeats,
:mod:`hora.core.engine.liveness`), and the engine then fails every op with :func:`check`'s message.

Only a store served by a launcher is watched (:func:`owner`): under mpirun, srun or torchrun
without ``hora run``, rank 0 serves the store, and its closing is rank 0 shutting down or
dying, which the engine already tells apart.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping

from hora.rendezvous.env import WorldInfo
from hora.rendezvous.store_client import KVStoreClient

_lock = threading.Lock()
_watched: weakref.WeakKeyDictionary[KVStoreClient, str] = weakref.WeakKeyDictionary()


def owner(info: WorldInfo, environ: Mapping[str, str] | None = None) -> str | None:
    """Who serves ``info``'s store when it is a launcher, for messages ("hora run, pid 42");
    None when this rank serves it or a peer rank does (no hora launcher)."""
    env = os.environ if environ is None else environ
    if info.serve_store or info.store_host is None:
        return None
    launcher = env.get("HORA_LAUNCHER")
    if launcher is None:
        if info.launcher != "hora":  # mpirun / srun / torchrun: rank 0 serves the store
            return None
        launcher = "the launcher"
    pid = env.get("HORA_LAUNCHER_PID", "")
    return f"{launcher}, pid {pid}" if pid.isdigit() else launcher


def watch(client: KVStoreClient, who: str) -> None:
    """Watch ``client``'s connection to the store that ``who`` serves (until it is closed)."""
    with _lock:
        _watched[client] = who


def active() -> bool:
    """Whether some open store connection is watched."""
    with _lock:
        return any(not client.closed for client in _watched)


def check() -> str | None:
    """What is wrong when a watched launcher is gone (its store closed this process's idle
    connection), else None. Never blocks (see :meth:`KVStoreClient.server_closed`)."""
    with _lock:
        watched = list(_watched.items())
    for client, who in watched:
        if client.closed:
            with _lock:
                _watched.pop(client, None)
            continue
        if client.server_closed():
            return (f"the launcher ({who}) is gone: the rendezvous store it served at "
                    f"{client.address} closed this rank's connection, so nothing collects this "
                    "rank's output or result any more; hora fails this rank's ops instead of "
                    "letting it train as an orphan. HINT: the launcher was killed (SIGKILL, the "
                    "OOM killer, a lost session); a launcher that is stopped normally (Ctrl-C, "
                    "SIGTERM) stops its ranks itself")
    return None


__all__ = ["active", "check", "owner", "watch"]

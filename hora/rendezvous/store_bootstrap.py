"""Store bootstrap: from a detected :class:`~hora.rendezvous.env.WorldInfo` to a connected store.

:func:`bootstrap` starts the rendezvous store when this rank serves it (binding an address peers
can reach) and connects this rank's client to it.
"""

from __future__ import annotations

import socket

from hora._util.log import get_logger
from hora._util.net import is_loopback
from hora.errors import RendezvousError
from hora.rendezvous import launcher_watch
from hora.rendezvous.env import WorldInfo
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient

log = get_logger(__name__)


def _bind_address(store_host: str) -> str:
    """Where the serving rank binds: the store address itself, unless it names this host only
    through a loopback alias (Debian's ``127.0.1.1 <hostname>``), which peers could not reach."""
    if is_loopback(store_host):
        return "127.0.0.1" if store_host == "localhost" else store_host
    try:
        resolved = socket.getaddrinfo(store_host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise RendezvousError(f"cannot resolve the rendezvous host {store_host!r}: {exc}") from exc
    if is_loopback(str(resolved)):
        log.info("rendezvous host %s resolves to loopback %s here; the store binds to all "
                 "interfaces (connections are still authenticated)", store_host, resolved)
        return "0.0.0.0"
    return str(resolved)


def bootstrap(info: WorldInfo, timeout: float, *, bind_host: str | None = None
              ) -> tuple[KVStoreClient | None, KVStoreServer | None]:
    """Connect to the job's rendezvous store, starting it first if this rank serves it.

    Args:
        info: from :func:`detect`.
        timeout: seconds to reach the store (it may not be up yet).
        bind_host: address the serving rank binds (default: derived from ``info.store_host``).

    Returns:
        ``(client, server)``: ``(None, None)`` when there is no store (a single process);
        ``server`` is None unless this rank serves the store (the caller closes it last).
        A client of a store that a launcher serves is watched (:mod:`.launcher_watch`).

    Raises:
        RendezvousError: the store could not be started (port in use, address not local) or
            reached in time, with the remedy.
    """
    if info.store_host is None or info.store_port is None or (info.size == 1 and info.serve_store):
        return None, None
    server: KVStoreServer | None = None
    if info.serve_store:
        host = bind_host or _bind_address(info.store_host)
        try:
            server = KVStoreServer(info.secret, host, info.store_port).start()
        except RendezvousError as exc:
            raise RendezvousError(
                f"rank {info.rank} ({info.launcher} launch) must serve the rendezvous store on "
                f"{info.store_host}:{info.store_port} but could not: {exc.__cause__ or exc}. "
                "HINT: export HORA_RENDEZVOUS_PORT=<free port> to every rank (the default is "
                "derived from the job id), and make sure HORA_RENDEZVOUS_ADDR names the host "
                "where rank 0 runs."
            ) from exc
    try:
        client = KVStoreClient(info.store_host, info.store_port, info.secret, timeout)
    except BaseException:
        if server is not None:
            server.close()
        raise
    who = launcher_watch.owner(info)
    if who is not None:  # a killed launcher leaves no one to stop this rank: notice it
        launcher_watch.watch(client, who)
    return client, server


__all__ = ["bootstrap"]

"""``hora.run(func, ...)``: Horovod's Python launcher API (``horovod.run``).

Runner layer: imports only base, rendezvous and runner modules. It starts a job through the same
machinery as ``hora run`` (:class:`~hora.runner.launch.LaunchSpec` ->
:func:`~hora.runner.launch.launch`: local ranks, ranks on other hosts over ssh, output relayed
with rank prefixes, the other ranks stopped when one fails); every rank runs
``python -m hora.runner.run_func``, which calls ``func(*args, **kwargs)``.

How the function and the results travel
---------------------------------------

``(func, args, kwargs)`` are pickled (cloudpickle when installed, so closures and lambdas work)
into a key-value store that :func:`run` serves for the duration of the call: a
:class:`~hora.rendezvous.kvstore.KVStoreServer`, authenticated with a fresh secret, bound to
the address the launcher would choose for its own rendezvous store (loopback when every rank is
on this machine; this machine's address toward the remote hosts, or ``network_interface``'s).
Ranks receive the store's address and secret in their environment (for a rank on another host,
inside the request that travels on ssh's stdin), never on a command line, and each stores its
return value or its exception there. So nothing depends on a shared file system.

It is a store of its own rather than the launcher's rendezvous store because :func:`launch`
creates and closes that store inside the call (before the ranks start, after they end, the
caller has no handle on it); the cost is one more listening port on this machine, which the
remote hosts' pre-start check (a connection back to the same address) already covers.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hora._util.net import interface_names, local_hostname
from hora.config import load
from hora.errors import ConfigError, RankFailedError
from hora.rendezvous.kvstore import KVStoreServer
from hora.rendezvous.store_client import KVStoreClient
from hora.runner import launch as _launch
from hora.runner import run_func as _proto
from hora.runner import ssh
from hora.runner.elastic.driver import run_elastic
from hora.runner.elastic.options import elastic_options
from hora.runner.failures import WorkerFailure, signal_name
from hora.runner.hosts import HostSlots, assign_hosts, parse_hostfile, parse_hosts
from hora.runner.local import CONSOLE, Console

RANK_MODULE = "hora.runner.run_func"
"""The module every rank runs (``python -m``)."""

_ELASTIC_ONLY = ("slots", "reset_limit", "cooldown_range")

class RemoteTraceback(Exception):
    """The traceback of an exception raised in a rank, attached as ``__cause__`` of the
    exception :func:`run` re-raises (as :mod:`concurrent.futures` does).

    Attributes:
        rank: the rank that raised.
        text: the formatted traceback, as the rank printed it.
    """

    def __init__(self, rank: int, text: str) -> None:
        super().__init__(rank, text)
        self.rank = rank
        self.text = text

    def __str__(self) -> str:
        return f"\n\nrank {self.rank}'s traceback:\n\"\"\"\n{self.text.rstrip()}\n\"\"\""



class _WatchingConsole(Console):
    """The launcher's console, also remembering which rank failed first and any interrupt
    (the launcher's structured events)."""

    def __init__(self, parent: Console) -> None:
        super().__init__()
        self._parent = parent
        self.messages: list[str] = []
        self.failure: WorkerFailure | None = None
        self.signum: int | None = None

    def write(self, stream: str, text: str) -> bool:
        return self._parent.write(stream, text)

    def say(self, message: str) -> None:
        self.messages.append(message)
        self._parent.say(message)

    def rank_failed(self, failure: WorkerFailure) -> None:
        if self.failure is None:
            self.failure = failure

    def interrupted(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum


# ---- arguments -> LaunchSpec ------------------------------------------------------------------

def _check_arguments(func: Any, np: Any, elastic: Mapping[str, Any], use_gloo: bool | None,
                     use_mpi: bool | None, hosts: str | None, hostfile: str | None) -> None:
    if not callable(func):
        raise TypeError(f"hora.run: func must be callable, not {type(func).__name__}")
    if isinstance(np, bool) or not isinstance(np, int):
        raise TypeError(f"hora.run: np must be an int, not {type(np).__name__}")
    if np < 1:
        raise ConfigError(f"hora.run: np must be >= 1, not {np}")
    if elastic.get("min_np") is None and elastic.get("host_discovery_script") is None:
        given = [name for name in _ELASTIC_ONLY if elastic.get(name) is not None]
        if given:
            raise ConfigError(f"hora.run: {', '.join(given)} only apply to elastic mode: give "
                              "min_np= or host_discovery_script= too")
    if use_mpi:
        raise ConfigError(
            "hora.run: use_mpi=True is not available: hora.run starts the ranks itself, and "
            "MPI (the mpi data plane) needs ranks started by mpirun. Leave use_mpi unset, or "
            "start a script with `hora run --data-plane mpi -np N python train.py` (it starts "
            "the ranks through mpirun) or `mpirun -np N python train.py`.")
    if use_gloo is False and use_mpi is False:
        raise ConfigError("hora.run: use_gloo=False and use_mpi=False leave no controller; hora "
                          "has one (its own engine, started like Horovod's gloo mode)")
    if hosts is not None and hostfile is not None:
        raise ConfigError("hora.run: give hosts or hostfile, not both")


def _interfaces(network_interface: str | Sequence[str] | None) -> list[str]:
    if network_interface is None:
        return []
    items = ([network_interface] if isinstance(network_interface, str)
             else list(network_interface))
    names = list(dict.fromkeys(n.strip() for item in items for n in item.split(",")
                               if n.strip()))
    known = interface_names()
    for name in names:
        if name not in known:
            raise ConfigError(f"hora.run: network interface {name!r} does not exist on "
                              f"{local_hostname()}; available: {', '.join(known)}")
    return names


def _host_slots(hosts: str | None, hostfile: str | None) -> tuple[HostSlots, ...]:
    if hosts is not None:
        return parse_hosts(hosts)
    if hostfile is not None:
        return parse_hostfile(hostfile)
    return ()


# ---- the store ------------------------------------------------------------------------------

def _store_address(spec: _launch.LaunchSpec, executable: str) -> tuple[str, float]:
    """Where the launcher would put its rendezvous store for ``spec``, and the start timeout.

    Uses the launcher's own choice (:func:`hora.runner.launch.store_address`) so both stores
    sit on the address the remote hosts are checked to reach.

    Raises:
        ConfigError: as :func:`launch` would (bad ``HORA_*`` variable, too few slots, an unknown
            interface, no ssh client for remote hosts).
    """
    environ = _environ()
    base = {**_launch.forwardable_environment(environ),
            **_launch.launcher_variables(spec, environ)}
    config = load(base, strict=True)
    names = assign_hosts(spec.np, spec.hosts)
    remote_hosts = tuple(dict.fromkeys(h for h in names if not _launch.is_local_host(h)))
    if remote_hosts:
        ssh.ssh_program()
    remote = _launch.Remote(
        hosts=remote_hosts,
        options=ssh.SshOptions(spec.ssh_port, spec.ssh_identity_file,
                               connect_timeout=min(10.0, config.start_timeout)),
        python=executable, grace=0.0)
    return _launch.store_address(remote, config).address, config.start_timeout


def _environ() -> dict[str, str]:
    return dict(os.environ)


def read_records(client: KVStoreClient, np: int) -> dict[int, dict[str, Any]]:
    """The ``run_func`` record headers present for ranks ``0..np-1``, by rank (also read by
    :mod:`hora.spark`)."""
    keys = [_proto.record_key(r) for r in range(np)]
    absent = set(client.missing(_proto.SCOPE, keys))
    return {r: _proto.get_header(client, key, 0.0) for r, key in enumerate(keys)
            if key not in absent}


# ---- outcome --------------------------------------------------------------------------------

def raise_stored_error(client: KVStoreClient, record: dict[str, Any], np: int,
                       who: str = "hora.run", where: str = "in the ranks") -> None:
    """Re-raise the exception a rank stored: the same type when it unpickles, else
    :class:`RankFailedError`; the rank's traceback as ``__cause__``. ``who`` names the call
    (``hora.run``, ``hora.spark.run``), ``where`` where the ranks run (for the import hint)."""
    rank = int(record["rank"])
    cause = RemoteTraceback(rank, str(record.get("traceback", "")))
    exc: BaseException | None = None
    why = record.get("unpicklable")
    if not why:
        try:
            loaded = _proto.loads(_proto.get_blob(client, _proto.record_key(rank), record))
        except Exception as err:  # noqa: BLE001 (e.g. the class cannot be imported here)
            why = f"{type(err).__name__}: {err}"
        else:
            if isinstance(loaded, BaseException):
                exc = loaded
            else:
                why = f"the rank stored a {type(loaded).__name__}"
    if exc is None:
        exc = RankFailedError(
            f"{who}: rank {rank} of {np} raised {record.get('type')}: "
            f"{record.get('message')} (the exception could not be re-created here: {why})",
            rank=rank, exit_status=1)
    note = f"(raised in rank {rank} of {np} of {who}; its traceback is above)"
    if record.get("phase") == "load":
        note += (f"\nHINT: rank {rank} could not unpickle func/args/kwargs. A function of an "
                 f"importable module is sent by reference: that module must import {where} "
                 "too (same cwd / PYTHONPATH / install), or register it with "
                 "cloudpickle.register_pickle_by_value(module) to send it by value.")
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    else:  # Python 3.10: no notes; the hint goes with the traceback text
        cause.text += "\n" + note
    raise exc from cause


def _outcome(client: KVStoreClient, np: int, status: int,
             console: _WatchingConsole, recovered: bool = False) -> list[Any]:
    records = read_records(client, np)
    failures = {} if recovered else {
        r: rec for r, rec in records.items() if rec.get("kind") in ("error", "exit")}
    # The root cause: a rank that the launcher saw fail first without storing a record died
    # (a signal, os._exit, could not start): nothing else can have caused that. Otherwise the
    # record stored first: a rank stores its exception (or its sys.exit) before it starts
    # exiting, so what it causes elsewhere (a peer's ShutdownError or PeerLostError) is stored
    # later, even when that peer's process exits first.
    first = console.failure
    if first is not None and first.rank not in failures:
        suffix = "" if first.start_error else " without returning a result"
        raise RankFailedError(f"hora.run: {first.describe()}{suffix}", rank=first.rank,
                              exit_status=first.exit_status)
    if failures:
        earliest = min(failures.values(), key=lambda rec: int(rec.get("seq", 0)))
        if earliest.get("kind") == "error":
            raise_stored_error(client, earliest, np)
        _raise_exit(earliest, np)
    if status != 0:
        if console.signum == signal.SIGINT:
            raise KeyboardInterrupt("hora.run: interrupted; every rank was stopped")
        if console.signum is not None:
            raise RankFailedError(f"hora.run: received {signal_name(console.signum)}; every "
                                  "rank was stopped", exit_status=status)
        last = console.messages[-1] if console.messages else "no message"
        raise RankFailedError(f"hora.run: the job failed with exit status {status} ({last})",
                              exit_status=status)
    results: list[Any] = []
    for rank in range(np):
        record = records.get(rank, {})
        if record.get("kind") != "result":
            raise RankFailedError(f"hora.run: rank {rank} of {np} exited with code 0 without "
                                  "returning a result (os._exit(0)?)", rank=rank, exit_status=0)
        results.append(_proto.loads(_proto.get_blob(client, _proto.record_key(rank), record)))
    return results


def _raise_exit(record: dict[str, Any], np: int) -> None:
    rank, code = int(record["rank"]), int(record.get("code", 0))
    raise RankFailedError(f"hora.run: rank {rank} of {np} called sys.exit({code}) in func "
                          f"instead of returning (exit status {code})", rank=rank,
                          exit_status=code)


# ---- run ------------------------------------------------------------------------------------

def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, np: int = 1,
        min_np: int | None = None, max_np: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[float, float] | None = None,
        hosts: str | None = None, hostfile: str | None = None,
        host_discovery_script: str | None = None,
        start_timeout: float | None = None, ssh_port: int | None = None,
        ssh_identity_file: str | None = None, disable_cache: bool | None = None,
        output_filename: str | None = None, verbose: bool | int | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None,
        mpi_args: str | None = None, network_interface: str | Sequence[str] | None = None,
        executable: str | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` in ``np`` ranks of a new job; return their results.

    Horovod's ``horovod.run`` with the same arguments. The ranks are started as ``hora run``
    starts them (on this machine, or over ssh on ``hosts`` / ``hostfile``), with their output
    relayed to this process's stdout / stderr prefixed ``[<rank>]<stdout>:``. ``func`` usually
    calls ``hora.init()`` (or ``hora.torch.init()``) and trains. ``func``, ``args`` and
    ``kwargs`` are pickled (cloudpickle when installed: closures and lambdas work; a function
    of an importable module is sent by reference, so the module must import in the ranks too)
    and travel through an authenticated store, never on a command line; so do the results.

    Args:
        func: the function every rank calls.
        args: positional arguments for ``func``.
        kwargs: keyword arguments for ``func``.
        np: number of ranks (>= 1).
        min_np, max_np, slots, reset_limit, cooldown_range, host_discovery_script: elastic
            mode, as ``hora run --min-np ... --max-np ... --slots-per-host ... --reset-limit
            ... --blacklist-cooldown-range ... --host-discovery-script ...`` (elastic when
            ``min_np`` or ``host_discovery_script`` is given; see docs/elastic.md). ``func``
            should run ``hora.init()`` and an ``@hvd.elastic.run`` function; the result is the
            list of the return values of ranks ``0..min_np-1`` of the last generation
            (Horovod's rule).
        hosts: ``"host1:2,host2:2"``: hosts and their slots, in rank order (default: ``np`` ranks
            on this machine). Ranks on other hosts start over ssh, as with ``hora run -H``.
        hostfile: a file of ``<host> slots=<n>`` lines, instead of ``hosts``.
        start_timeout: seconds the ranks have to start and meet (``HORA_START_TIMEOUT``).
        ssh_port: the ssh port of the remote hosts.
        ssh_identity_file: the ssh private key for the remote hosts.
        disable_cache: accepted; hora caches nothing (the ssh checks run for every job).
        output_filename: also copy each rank's output to ``DIR/rank.<r>/{stdout,stderr}``.
        verbose: print what is started and with which variables (never a secret).
        use_gloo: accepted (hora's engine is started like Horovod's gloo mode).
        use_mpi: True raises ConfigError: hora.run does not start ranks through mpirun (``hora
            run --data-plane mpi`` does).
        mpi_args: accepted and ignored, with a note (no mpirun mode).
        network_interface: ``"eth1"`` or ``"eth1,eth2"``: the interface the store and the ranks
            use (the first one; ``HORA_GLOO_IFACE``), as ``hora run --network-interface``.
        executable: the Python that runs the ranks (default ``sys.executable``; on remote hosts
            the same path must exist there).

    Returns:
        The return values of ``func``, in rank order (index ``r`` is rank ``r``'s).

    Raises:
        TypeError: ``func`` is not callable, ``np`` is not an int, or ``(func, args, kwargs)``
            cannot be pickled.
        ConfigError: (a ValueError) bad arguments: ``np < 1``, ``use_mpi=True``, hosts and
            hostfile together, a malformed host list, too few slots, an unknown interface, a bad
            ``HORA_*`` variable in the environment. Nothing is started.
        HostCheckError: a remote host cannot run ranks.
        Exception: the exception a rank raised (the rank whose failure ended the job, else the
            first to report one), re-raised with its own type; its ``__cause__`` is a
            :class:`RemoteTraceback` holding the rank number and the rank's traceback text.
            When the exception cannot be pickled back, a :class:`RankFailedError` naming its
            type and message instead.
        RankFailedError: (a RuntimeError) a rank ended without a result: killed by a signal,
            ``os._exit``, ``sys.exit`` inside ``func``, or it could not start; the message names
            the rank and its exit status. The other ranks are stopped, as under ``hora run``.
        KeyboardInterrupt: this process got SIGINT while the job ran (every rank was stopped).
    """
    _check_arguments(func, np, {"min_np": min_np, "slots": slots, "reset_limit": reset_limit,
                                "cooldown_range": cooldown_range,
                                "host_discovery_script": host_discovery_script},
                     use_gloo, use_mpi, hosts, hostfile)
    python = executable if executable is not None else sys.executable
    env: dict[str, str] = {}
    interfaces = _interfaces(network_interface)
    if interfaces:
        env["HORA_GLOO_IFACE"] = interfaces[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(interfaces)
    spec = _launch.LaunchSpec(
        np=np, command=(python, "-m", RANK_MODULE), hosts=_host_slots(hosts, hostfile),
        env=env, output_filename=output_filename, verbose=bool(verbose),
        start_timeout=start_timeout, ssh_port=ssh_port, ssh_identity_file=ssh_identity_file)
    address, timeout = _store_address(spec, python)
    try:
        payload = _proto.dumps((func, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        raise TypeError(f"hora.run: func, args and kwargs must be picklable: {exc}") from exc
    console = _WatchingConsole(CONSOLE)
    if mpi_args is not None:
        console.say("note: mpi_args is ignored: hora starts the ranks itself, not via mpirun.")
    del disable_cache  # accepted for Horovod compatibility; there is no cache

    secret = secrets.token_bytes(32)
    with KVStoreServer(secret, address, 0) as server, \
            KVStoreClient(server.host, server.port, secret, timeout=max(timeout, 5.0)) as client:
        _proto.put_blob(client, _proto.FUNC_KEY, payload, {})
        environ = {**_environ(), _proto.STORE_VAR: f"{server.host}:{server.port}",
                   _proto.SECRET_VAR: secret.hex()}
        if min_np is None and host_discovery_script is None:
            status = _launch.launch(spec, environ=environ, console=console)
            return _outcome(client, np, status, console)
        options = elastic_options(np, min_np=min_np, max_np=max_np, hosts=spec.hosts,
                                  discovery_script=host_discovery_script, slots_per_host=slots,
                                  reset_limit=reset_limit, cooldown_range=cooldown_range)
        status = run_elastic(spec, options, environ=environ, console=console)
        # Elastic: failures the job recovered from are not its outcome; the last generation's
        # ranks 0..min_np-1 stored the results (each under its final rank).
        return _outcome(client, options.min_np, status, console, recovered=status == 0)


__all__ = ["RANK_MODULE", "RankFailedError", "RemoteTraceback", "raise_stored_error",
           "read_records", "run"]

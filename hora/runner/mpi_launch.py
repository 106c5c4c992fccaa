"""``hora run --data-plane mpi`` (or ``--mpi``): the ranks start under Open MPI's ``mpirun``.

The mpi data plane needs the ranks to be one MPI job, which only an MPI launcher can make, so
``hora run`` hands the start to ``mpirun`` and keeps the rest of its job: it serves the
rendezvous store with a per-job secret (hora's control plane still runs over its own
authenticated TCP connections), exports ``HORA_DATA_PLANE=mpi`` and the tunables, and relays
each rank's output with its usual ``[<rank>]<stdout>:`` prefix (from mpirun's
``--tag-output``), copying it to ``--output-filename DIR/rank.<r>/`` when asked. The exit status
is mpirun's.

The mpirun command it runs (``--verbose`` prints it)::

    mpirun -np N [--oversubscribe | -H a:4,b:4] --bind-to none --map-by slot --tag-output
           --mca odls_base_sigkill_timeout 3 -x HORA_* -x HOROVOD_* -x PATH ... COMMAND

* ``--oversubscribe`` on one host, as ``hora run -np N`` starts N ranks whatever the cores;
* ``--bind-to none --map-by slot`` as horovodrun (``--binding-args`` replaces them);
* ``odls_base_sigkill_timeout 3``: when a rank dies, mpirun stops the others (Open MPI's own
  fail-fast) 3 s later instead of 1 s, so that each survivor first reports hora's error naming
  the lost rank (hora notices within a second; mpirun then also waits those 3 s to end);
* ``-x NAME`` forwards variables by name (values, the secret included, never appear in argv);
* ``--mpi-args`` are added as given; ``-p`` / ``-i`` become ``plm_rsh_args``; a
  ``--network-interface`` also restricts MPI's TCP traffic to it.

Running as root, Open MPI wants ``--allow-run-as-root`` (in ``--mpi-args``) or
``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``; its own message says so.
Only Open MPI's mpirun is driven (other MPIs: start the job with their launcher directly and
``HORA_DATA_PLANE=mpi``).
"""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, BinaryIO

from hora.errors import ConfigError
from hora.rendezvous.kvstore import KVStoreServer
from hora.runner.failures import exit_status
from hora.runner.mpi_errors import MpiErrors
from hora.runner.output import CONSOLE, Console, rank_output_dir
from hora.runner.processes import _parent_death_signal

SIGKILL_GRACE_S = 3
"""Seconds mpirun waits, after a rank died, before it stops the others (Open MPI's default: 1)."""

_TAG = re.compile(rb"\[\d+,(\d+)\]<(?:stdout|stderr)>:")
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED",
            "OMP_NUM_THREADS")


def mpirun_program() -> str:
    """The path of Open MPI's mpirun, or ConfigError saying what to install."""
    found = shutil.which("mpirun")
    if found is None:
        raise ConfigError("--data-plane mpi starts the ranks with mpirun, which is not on PATH: "
                          "install Open MPI (apt-get install openmpi-bin) and mpi4py, or choose "
                          "another data plane")
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigError(f"{found} --version failed: {exc}") from None
    if "Open MPI" not in version and "OpenRTE" not in version:
        first = version.strip().splitlines()[0] if version.strip() else "unknown"
        raise ConfigError(f"hora run --data-plane mpi drives Open MPI's mpirun, and {found} is "
                          f"{first!r}: start the job with your MPI's own launcher instead, e.g. "
                          "`HORA_DATA_PLANE=mpi mpiexec -n N python train.py`")
    return found


def mpirun_argv(program: str, np_: int, hosts: str | None, command: tuple[str, ...],
                forward: list[str], *, mpi_args: str | None = None,
                binding_args: str | None = None, ssh_port: int | None = None,
                ssh_identity_file: str | None = None, iface: str = "") -> list[str]:
    """The mpirun command line (see the module docstring); ``forward``: variable names."""
    argv = [program, "-np", str(np_)]
    argv += ["-H", hosts] if hosts else ["--oversubscribe"]
    argv += shlex.split(binding_args) if binding_args else ["--bind-to", "none", "--map-by",
                                                            "slot"]
    argv += ["--tag-output", "--mca", "odls_base_sigkill_timeout", str(SIGKILL_GRACE_S)]
    rsh = ([f"-p {ssh_port}"] if ssh_port else []) + (
        [f"-i {shlex.quote(ssh_identity_file)}"] if ssh_identity_file else [])
    if rsh:
        argv += ["--mca", "plm_rsh_args", " ".join(rsh)]
    if iface:
        argv += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface]
    for name in forward:
        argv += ["-x", name]
    argv += shlex.split(mpi_args) if mpi_args else []
    return [*argv, *command]


def run_mpirun(argv: list[str], env: Mapping[str, str], np_: int, *,
               output_dir: str | None = None, prefix_timestamp: bool = False,
               console: Console = CONSOLE) -> int:
    """Run mpirun, relay its ranks' lines in hora's format; returns its exit status.

    SIGINT / SIGTERM / SIGHUP to the launcher go to mpirun, which stops the ranks.
    """
    try:
        proc = subprocess.Popen(argv, env=dict(env), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                preexec_fn=_parent_death_signal())  # mpirun dies with us
    except OSError as exc:
        console.say(f"could not start {argv[0]}: {exc}")
        return 127
    assert proc.stdout is not None and proc.stderr is not None
    copies = _Copies(output_dir, np_)
    errors = MpiErrors(console.write, console.say)  # one report per failure
    relays = [threading.Thread(target=_relay, args=(pipe, stream, console, copies,
                                                    prefix_timestamp, errors), daemon=True,
                               name=f"hora-mpirun-{stream}")
              for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for relay in relays:
        relay.start()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, lambda s, _f: proc.send_signal(s))
    try:
        code = proc.wait()
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        for relay in relays:
            relay.join(5.0)
        copies.close()
    status = exit_status(code)
    errors.report(status)
    return status


class _Copies:
    """``--output-filename``: each rank's raw lines in ``DIR/rank.<r>/{stdout,stderr}``."""

    def __init__(self, root: str | None, size: int) -> None:
        self._root, self._size = root, size
        self._files: dict[tuple[int, str], BinaryIO] = {}
        self._lock = threading.Lock()

    def write(self, rank: int, stream: str, line: bytes) -> None:
        if self._root is None:
            return
        with self._lock:
            out = self._files.get((rank, stream))
            if out is None:
                folder = rank_output_dir(self._root, rank, self._size)
                folder.mkdir(parents=True, exist_ok=True)
                out = Path(folder, stream).open("ab")  # noqa: SIM115 (closed by close())
                self._files[(rank, stream)] = out
            out.write(line)
            out.flush()

    def close(self) -> None:
        with self._lock:
            for out in self._files.values():
                out.close()


def _relay(pipe: IO[bytes], stream: str, console: Console, copies: _Copies,
           timestamp: bool, errors: MpiErrors | None = None) -> None:
    """mpirun's tagged output as hora's ``[rank]<stream>:`` lines; mpirun's own as it is.

    mpirun tags every chunk a rank writes, at its start and after each newline inside it, so a
    line a rank wrote in pieces (unbuffered ``print``) arrives as several tagged pieces, maybe
    between other ranks' pieces: they are joined per rank before a line is relayed. A rank's
    error block is held by ``errors`` (:mod:`hora.runner.mpi_errors`).
    """
    partial: dict[int, bytes] = {}

    def emit(rank: int, line: bytes) -> bool:
        copies.write(rank, stream, line)
        plain = line.decode("utf-8", "replace")
        text = f"[{rank}]<{stream}>:{plain}"
        text = (time.asctime() + text) if timestamp else text
        held = errors is not None and errors.line(rank, stream, text, plain.rstrip("\r\n"))
        return held or console.write(stream, text)

    ok = True
    for raw in iter(pipe.readline, b""):
        tags = list(_TAG.finditer(raw))
        head = raw[:tags[0].start()] if tags else raw
        if head and ok:  # mpirun's own message
            ok = console.write(stream, head.decode("utf-8", "replace"))
        for k, tag in enumerate(tags):
            rank = int(tag.group(1))
            end = tags[k + 1].start() if k + 1 < len(tags) else len(raw)
            text = partial.pop(rank, b"") + raw[tag.end():end]
            if text.endswith(b"\n"):
                ok = ok and emit(rank, text)
            else:
                partial[rank] = text
    for rank, text in sorted(partial.items()):
        if ok:
            ok = emit(rank, text + b"\n")
    pipe.close()


def launch_mpi(np_: int, command: tuple[str, ...], env: Mapping[str, str], store_host: str,
               *, hosts: str | None = None, mpi_args: str | None = None,
               binding_args: str | None = None, ssh_port: int | None = None,
               ssh_identity_file: str | None = None, output_dir: str | None = None,
               prefix_timestamp: bool = False, verbose: bool = False,
               console: Console = CONSOLE) -> int:
    """Serve the rendezvous store and run the job under mpirun (see the module docstring).

    Args:
        env: every variable the ranks get (the launcher's environment less identity variables,
            the tunables, hora run's defaults); mpirun runs with it too.
        store_host: the address the store binds and the ranks reach.
        hosts: ``-H`` in mpirun's syntax (``a:4,b:4``), or None for this host.

    Raises:
        ConfigError: no Open MPI mpirun.
    """
    program = mpirun_program()
    secret = secrets.token_hex(32)
    server = KVStoreServer(bytes.fromhex(secret), store_host, 0).start()
    try:
        ranks_env = {**env, "HORA_DATA_PLANE": "mpi", "HORA_RENDEZVOUS_ADDR": server.host,
                     "HORA_RENDEZVOUS_PORT": str(server.port), "HORA_JOB_ID": secrets.token_hex(8),
                     "HORA_SECRET_KEY": secret}
        forward = sorted(k for k in ranks_env if k.startswith(("HORA_", "HOROVOD_"))
                         or k in _FORWARD)
        argv = mpirun_argv(program, np_, hosts, command, forward, mpi_args=mpi_args,
                           binding_args=binding_args, ssh_port=ssh_port,
                           ssh_identity_file=ssh_identity_file,
                           iface=ranks_env.get("HORA_GLOO_IFACE", ""))
        if verbose:
            console.say(f"rendezvous store: {server.host}:{server.port} (authenticated with a "
                        "per-job secret passed to ranks in $HORA_SECRET_KEY)\n"
                        f"starting the ranks with: {shlex.join(argv)}")
        return run_mpirun(argv, ranks_env, np_, output_dir=output_dir,
                          prefix_timestamp=prefix_timestamp, console=console)
    finally:
        server.close()


__all__ = ["SIGKILL_GRACE_S", "launch_mpi", "mpirun_argv", "mpirun_program", "run_mpirun"]

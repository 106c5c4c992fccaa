"""How the elastic driver starts and stops its workers: the :class:`Spawner` seam.

Runner layer. The driver (:mod:`hora.runner.elastic.driver`) decides *when* a worker starts, on
which host, with which environment, and what its exit means for the job; a spawner does the
starting and stopping. :class:`ProcessSpawner` is ``hora run``'s: one process per worker, on
this machine or over ssh (:mod:`hora.runner.processes`, :mod:`hora.runner.ssh`). Other
launchers bring their own (``hora.ray``'s starts Ray actors) without the runner knowing them.

A spawner reports every worker's end on the driver's ``exits`` queue as ``(worker id,
status)``: 0 when the worker finished (or left when told to), non-zero when it failed.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hora.config import Config
from hora.rendezvous.topology import Slot
from hora.runner import launch as launch_mod
from hora.runner import processes, ssh
from hora.runner.failures import signal_name
from hora.runner.hosts import is_local_host
from hora.runner.local import remove_shm_segments
from hora.runner.output import Console
from hora.runner.rank_errors import ErrorBlock, HeldErrors


class SameErrorOnce(HeldErrors):
    """A worker's last error block (its stream ended while the relay held it) is written out
    as without holding, except one whose exception a block written before ended with (every
    worker raising the same ``ElasticError``, a crash that recurs in each replacement): that
    becomes one line naming the worker, as ``hora run`` collapses its ranks' same errors."""

    def __init__(self, console: Console) -> None:
        self._console = console
        super().__init__(self._show)
        self._shown: dict[tuple[str, ...], int] = {}  # an exception -> the worker that showed it

    def _show(self, block: ErrorBlock) -> None:
        self._console.write(block.stream, block.text(drop_echoes=True))

    def put(self, block: ErrorBlock) -> None:
        said = tuple(block.exception())
        with self._lock:
            first = self._shown.setdefault(said, block.rank) if said else block.rank
        if first == block.rank:
            self._write(block)
        else:
            self._console.say(f"elastic: worker {block.rank} raised the same error as worker "
                              f"{first} (traceback not shown; --output-filename DIR keeps every "
                              "worker's full output)")


class SpawnError(Exception):
    """A worker could not be started: ``message`` says why, ``status`` is its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Spawner(Protocol):
    """What the elastic driver needs from whatever starts its workers."""

    def open(self, first: Mapping[str, int], config: Config,
             exits: queue.Queue[tuple[int, int]], job_id: str) -> str:
        """Get ready for a job whose discovery first listed ``first``; every worker's end goes
        on ``exits``. Returns the address the driver's rendezvous store binds to (one every
        worker can reach)."""
        ...

    def start(self, wid: int, host: str, env: Mapping[str, str],
              place: tuple[int, int] | None = None) -> Any:
        """Start worker ``wid`` on ``host`` with ``env`` (its whole hora environment: identity,
        store, secret); returns the handle :meth:`stop` and :meth:`close` take. ``place``:
        (slot, slots) on ``host``: bind the worker to that slot's share of the host's cores as
        ``--cpu-binding`` says (a spawner whose workers get their cores otherwise, as Ray's,
        ignores it); None: do not bind it.

        Raises:
            SpawnError: it could not be started (the driver counts it as a failed worker).
        """
        ...

    def describe_exit(self, wid: int, status: int) -> str:
        """How worker ``wid`` ended with ``status``, for the driver's message (``"exited with
        code 1"``, ``"was killed by SIGKILL"``...)."""
        ...

    def stop(self, handle: Any) -> None:
        """Stop one worker now (it was told to leave and did not); may block briefly."""
        ...

    def close(self, handles: Sequence[Any]) -> None:
        """The job is over: stop ``handles`` that still run and clean up after all of them."""
        ...


def exit_text(status: int) -> str:
    """``"exited with code 1"`` / ``"was killed by SIGKILL"`` for a process's status."""
    if status < 0:
        return f"was killed by {signal_name(-status)}"
    if status > 128:
        return f"exited with code {status} ({signal_name(status - 128)})"
    return f"exited with code {status}"


class ProcessSpawner:
    """``hora run``'s workers: a process each, local or over ssh, output relayed with the
    worker id as its prefix.

    Args:
        spec: the job (its command, ssh options, output settings).
        size: the width of the output prefixes (the most workers there will be).
        console: where output and messages go.
    """

    def __init__(self, spec: launch_mod.LaunchSpec, size: int, console: Console) -> None:
        self.spec, self.size, self.console = spec, size, console
        self._exits: queue.Queue[tuple[int, int]] | None = None
        self._job_id = ""
        self._config: Config | None = None
        self._gate: ssh.StartGate | None = None
        self._errors = SameErrorOnce(console)  # the workers' last error blocks

    def open(self, first: Mapping[str, int], config: Config,
             exits: queue.Queue[tuple[int, int]], job_id: str) -> str:
        spec = self.spec
        self._exits, self._job_id, self._config = exits, job_id, config
        self._remote = launch_mod.Remote(
            hosts=tuple(h for h in first if not is_local_host(h)),
            options=ssh.SshOptions(spec.ssh_port, spec.ssh_identity_file,
                                   connect_timeout=min(10.0, config.start_timeout)),
            python=sys.executable, grace=max(0.5, processes.GRACE_PERIOD_S - 1.0))
        self._gate = ssh.StartGate(timeout=self._remote.options.connect_timeout + 5.0)
        return launch_mod.store_address(self._remote, config).address

    def start(self, wid: int, host: str, env: Mapping[str, str],
              place: tuple[int, int] | None = None) -> Any:
        assert self._exits is not None and self._gate is not None, "open() first"
        slot = Slot(rank=wid, size=0, hostname=host, local_rank=0, local_size=0, cross_rank=0,
                    cross_size=0)
        if not is_local_host(host) and host not in self._remote.hosts:
            self._remote = dataclasses.replace(self._remote, hosts=(*self._remote.hosts, host))
        launch = launch_mod.rank_launch(slot, dict(env), self.spec, self._remote, self._gate,
                                        self._config, place=place)
        try:
            return processes.spawn(
                self.spec.command, launch, wid, size=self.size, exits=self._exits,
                console=self.console, output_dir=self.spec.output_filename,
                prefix_timestamp=self.spec.prefix_timestamp, held=self._errors)
        except processes.StartError as exc:
            raise SpawnError(exc.message, exc.failure.returncode) from None

    def describe_exit(self, wid: int, status: int) -> str:
        return exit_text(status)

    def stop(self, handle: Any) -> None:
        processes.stop_workers([handle], self.console, quiet=True)

    def kill(self, handle: Any) -> None:
        """Kill one worker now with its process group: it hangs (SIGSTOP, a debugger), so a
        SIGTERM would wait for it to be continued. (Over ssh the remote side stops it.)"""
        processes.stop_workers([handle], self.console, quiet=True, kill_now=lambda: True)

    def close(self, handles: Sequence[Any]) -> None:
        processes.stop_workers(list(handles), self.console, quiet=True)
        for worker in handles:
            for relay in worker.relays:
                relay.join(2.0)
        if self._gate is not None:
            self._gate.__exit__(None, None, None)
        remove_shm_segments(self._job_id or None)


__all__ = ["ProcessSpawner", "SpawnError", "Spawner", "exit_text"]

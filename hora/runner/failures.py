"""What went wrong in a job: the first worker failure and the root-cause message.

Runner layer. The supervisor (:mod:`hora.runner.local`) records the first rank that exited
non-zero or died by a signal; :meth:`WorkerFailure.report` turns it into the lines the launcher
prints last, so the root cause is not lost under the other ranks' "peer lost" errors.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from dataclasses import dataclass

# Hints for deaths whose cause is not obvious from the signal name alone.
_SIGNAL_HINTS: dict[int, str] = {
    int(signal.SIGKILL): "a kill from outside the job, often the out-of-memory killer "
                         "(check `dmesg` or the memory limit)",
    int(signal.SIGSEGV): "a crash in native code (numpy or a framework extension)",
    int(signal.SIGBUS): "a crash in native code, or /dev/shm ran out of space",
    int(signal.SIGABRT): "an abort in native code (a failed assertion or C++ exception)",
    int(signal.SIGPIPE): "its output was closed early (e.g. `hora run ... | head`)",
}


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_status(returncode: int) -> int:
    """Shell-style exit status for a :class:`subprocess.Popen` return code (signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class WorkerFailure:
    """The first rank of a job that failed.

    Attributes:
        rank: global rank of the worker.
        size: number of ranks in the job.
        hostname: host identity the worker was started with (``HOROVOD_HOSTNAME``).
        returncode: :class:`subprocess.Popen` style: ``>0`` exit code, ``<0`` killed by signal.
        stderr_tail: the last lines the worker wrote to stderr (oldest first).
        start_error: why the worker could not be started, if it could not.
    """

    rank: int
    size: int
    hostname: str
    returncode: int
    stderr_tail: tuple[str, ...] = ()
    start_error: str = ""  # set when the process could not even start (its message)
    command: tuple[str, ...] = ()  # what could not be started (start errors)
    program: str = ""  # the executable the rank ran (local ranks), for the interpreter hint

    @property
    def signal(self) -> int | None:
        """The number of the signal that killed the worker, or None if it exited."""
        return -self.returncode if self.returncode < 0 else None

    @property
    def exit_status(self) -> int:
        """The launcher's exit status for this failure: the exit code, or 128 + signal."""
        return exit_status(self.returncode)

    def describe(self) -> str:
        """One line: ``rank 1 of 4 on localhost exited with code 3``."""
        if self.start_error:
            return self.start_error
        where = f"rank {self.rank} of {self.size} on {self.hostname}"
        sig = self.signal
        if sig is None:
            return f"{where} exited with code {self.returncode}"
        return f"{where} was killed by signal {signal_name(sig)} ({sig})"

    def report(self, stopped: int = 0, first: bool = True) -> list[str]:
        """The root-cause message, one string per line, for the end of the launcher's output.

        Args:
            stopped: how many other ranks the launcher had to stop because of this failure.
            first: this rank's exit was the first failure seen (else another rank exited
                first, with an error that followed from this one).
        """
        lead = "first failure" if first else "the root cause"
        after = f"{lead}; {stopped} other rank(s) were stopped" if stopped else lead
        lines = [f"job failed: {self.describe()} ({after})"]
        hint = _SIGNAL_HINTS.get(self.signal or 0)
        if hint:
            lines.append(f"HINT: {signal_name(self.signal or 0)} usually means {hint}.")
        lines.extend(self.hints())
        error = _exception_lines(self.stderr_tail)
        if error:  # a Python traceback: its frames were relayed above, the error is the point
            lines.append(f"rank {self.rank}'s error (its traceback is above):")
            lines.extend(f"  {line}" for line in error)
        elif self.stderr_tail:
            lines.append(f"last lines of rank {self.rank}'s stderr:")
            lines.extend(f"  {line}" for line in self.stderr_tail)
        else:
            lines.append(f"rank {self.rank} wrote nothing to stderr.")
        return lines


    def hints(self) -> list[str]:
        """What a new user most likely did wrong, read off the failure (may be empty)."""
        if self.start_error and self.command and self.command[0].endswith(".py"):
            return [f"HINT: {self.command[0]} is a Python script: put the interpreter in front, "
                    f"e.g. `hora run -np {self.size} python {' '.join(self.command)}`."]
        missing = next((m.group(1) for line in self.stderr_tail
                        if (m := _NO_MODULE.search(line))), None)
        if missing is None or missing.split(".")[0] not in _OURS:
            return []
        launcher = os.path.abspath(sys.executable)  # (a venv's python is a link: keep its path)
        ran = self.program or "its interpreter"
        if self.program and os.path.abspath(self.program) == launcher:
            return [f"HINT: rank {self.rank} ran {ran}, the interpreter hora runs in, and it "
                    f"has no module {missing!r}: install it there (pip install "
                    f"'hora[{_EXTRA.get(missing.split('.')[0], 'torch')}]')."]
        return [f"HINT: rank {self.rank} ran {ran}, but hora runs in {launcher}: activate that "
                f"environment, or pass its python: `hora run -np {self.size} {launcher} "
                "script.py`."]


def _exception_lines(tail: tuple[str, ...]) -> list[str]:
    """The exception that ends a Python traceback in ``tail`` (its unindented last lines after
    the frames), or [] when the tail does not end with one."""
    end = len(tail)
    start = end
    while start > 0 and tail[start - 1] and not tail[start - 1][0].isspace() \
            and not tail[start - 1].startswith("Traceback (most recent call last)"):
        start -= 1
    has_frames = start > 0 and (tail[start - 1][:1].isspace()
                                or tail[start - 1].startswith("Traceback"))
    return list(tail[start:end]) if has_frames and start < end else []


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
_OURS = frozenset({"hora", "horovod", "numpy", "torch", "tensorflow", "keras", "jax", "optax",
                   "flax"})
_EXTRA = {"tensorflow": "tensorflow", "keras": "tensorflow", "jax": "jax", "optax": "jax",
          "flax": "jax"}


__all__ = ["WorkerFailure", "exit_status", "signal_name"]

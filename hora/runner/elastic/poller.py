"""Host discovery in the background: :class:`DiscoveryPoller`.

Runner layer; used by the elastic driver. The poller runs a :class:`HostDiscovery` every
:data:`POLL_EVERY_S` seconds (Horovod's period) on its own thread. The driver reads the latest
good result in ``hosts`` and the messages to print from :meth:`DiscoveryPoller.messages`:

* a failure after the first poll is reported and retried; the last good host list stays in
  use. Every exception is caught (a :class:`~hora.errors.DiscoveryError` with its message, any
  other, ``MemoryError`` included, with its type): one bad run never ends discovery;
* a failure that repeats is not printed every second: the first is printed at once, the same
  text again never, another text at most every :data:`REPEAT_EVERY_S` seconds, with the count of
  failed runs (a script whose error carries a time stamp would otherwise print one line a
  second for as long as it fails);
* :meth:`DiscoveryPoller.stop` ends the thread and kills a script running at that moment, with
  its process group (``close()`` of the source, when it has one).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from hora._util.log import get_logger
from hora.errors import DiscoveryError
from hora.runner.elastic.discovery import HostDiscovery, describe

log = get_logger(__name__)

POLL_EVERY_S = 1.0
"""How often discovery runs (Horovod's period)."""

REPEAT_EVERY_S = 60.0
"""While discovery keeps failing, a failure with a new text is printed at most this often."""


class DiscoveryPoller(threading.Thread):
    """Runs ``source`` every :data:`POLL_EVERY_S` seconds until :meth:`stop`.

    Args:
        source: the discovery to poll.
        first: the hosts of the first poll (made by the caller, which must succeed).
        clock: monotonic seconds (for the rate limit).

    Attributes:
        hosts: the latest good answer.
        error: the latest failure's text, None after a success.
        failures: failed runs since the last success.
    """

    def __init__(self, source: HostDiscovery, first: dict[str, int], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(daemon=True, name="hora-discovery")
        self._source = source
        self._clock = clock
        self.hosts = first
        self.error: str | None = None
        self.failures = 0
        self._said: str | None = None  # the last failure text printed
        self._said_at = -float("inf")
        self._messages: queue.Queue[tuple[str, bool]] = queue.Queue()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(POLL_EVERY_S):
            self.poll_once()

    def poll_once(self) -> None:
        """Run discovery once and record the outcome (never raises)."""
        try:
            hosts = self._source.find_available_hosts_and_slots()
        except DiscoveryError as exc:
            self._failed(str(exc))
        except Exception as exc:  # noqa: BLE001 (MemoryError, a bug in a source: report, go on)
            log.debug("host discovery raised", exc_info=True)
            self._failed(f"host discovery raised {type(exc).__name__}: {exc}")
        else:
            if self.error is not None:
                self._messages.put((f"host discovery works again after {self.failures} failed "
                                    f"run(s); hosts now: {describe(hosts)}", True))
            self.hosts, self.error, self.failures, self._said = hosts, None, 0, None

    def _failed(self, text: str) -> None:
        if self._stop_event.is_set():
            return  # stop() killed the run in progress: not a failure of discovery
        self.error = text
        self.failures += 1
        now = self._clock()
        if self.failures == 1:
            self._said, self._said_at = text, now
            self._messages.put((f"host discovery failed; keeping the last hosts it listed "
                                f"({describe(self.hosts)}) and retrying every second: {text}",
                                False))
        elif text != self._said and now - self._said_at >= REPEAT_EVERY_S:
            self._said, self._said_at = text, now
            self._messages.put((f"host discovery still fails ({self.failures} failed runs in a "
                                f"row; the same error is not repeated, another at most every "
                                f"{REPEAT_EVERY_S:g} s): {text}", False))

    def messages(self) -> list[tuple[str, bool]]:
        """What to print now, oldest first: ``(text, verbose_only)`` pairs."""
        found = []
        while True:
            try:
                found.append(self._messages.get_nowait())
            except queue.Empty:
                return found

    def stop(self, wait: float = 5.0) -> None:
        """End polling: kill a script running now (with its group), then wait up to ``wait``
        seconds for the thread."""
        self._stop_event.set()
        close = getattr(self._source, "close", None)
        if callable(close):
            close()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(wait)


__all__ = ["POLL_EVERY_S", "REPEAT_EVERY_S", "DiscoveryPoller"]

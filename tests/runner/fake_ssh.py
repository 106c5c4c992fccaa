#!/usr/bin/env python3
"""Stands in for ``ssh`` in launcher tests that need no network: the "remote host" is this one.

Installed as ``ssh`` in a directory put first on the launcher's PATH (see ``fake_ssh_path`` in
test_ssh_launch.py). Like real ssh it parses ssh's options, then runs the remote command with
``sh -c`` in a *separate session* (another host's processes are out of the launcher's reach),
with a login-like environment, its stdin fed from ours (EOF when we die or our stdin closes),
stdout / stderr passed through, and exits with the remote status (255 when the remote command
was killed by a signal, as ssh does). ``ssh -G HOST`` prints ``hostname HOST``.

Environment: ``FAKE_SSH_LOG`` (a file: one JSON argv per call is appended), ``FAKE_SSH_DOWN``
(comma list of hosts that refuse connections: exit 255 with ssh's message).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

_WITH_VALUE = {"-o", "-p", "-i", "-F", "-l", "-E", "-J", "-b", "-c", "-m", "-D", "-L", "-R"}


def main(args: list[str]) -> int:
    log = os.environ.get("FAKE_SSH_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(json.dumps(args) + "\n")
    i, dump = 0, False
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if arg in _WITH_VALUE:
            i += 2
        elif arg.startswith("-"):
            dump = dump or arg == "-G"
            i += 1
        else:
            break
    host, command = args[i], " ".join(args[i + 1:])
    if dump:
        print(f"hostname {host}")
        return 0
    if host in os.environ.get("FAKE_SSH_DOWN", "").split(","):
        sys.stderr.write(f"ssh: connect to host {host} port 22: Connection refused\n")
        return 255
    login = {"HOME": os.environ.get("HOME", "/"), "PATH": "/usr/bin:/bin",
             "FAKE_SSH_HOST": host}
    child = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, env=login,
                             start_new_session=True)
    assert child.stdin is not None
    pipe = child.stdin

    def pump() -> None:
        try:
            while True:
                data = os.read(0, 65536)
                if not data:
                    break
                pipe.write(data)
                pipe.flush()
        except OSError:
            pass
        pipe.close()

    threading.Thread(target=pump, daemon=True).start()
    code = child.wait()
    return 255 if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Separate hosts on one machine, for tests and benchmarks: network namespaces with their own sshd.

Independent of hora (standard library only); used by ``tests/runner/test_multihost.py`` and
``benchmarks/multihost.py``. Needs root, ``ip`` (iproute2), and for ssh the OpenSSH server and
client (``sshd``, ``ssh``, ``ssh-keygen``); ``tc`` to shape links. :func:`unavailable` says what
is missing.

Layout, for the ``K``-th ``Cluster(n)`` started by process ``P`` (names unique per cluster, so
clusters of one process can overlap, e.g. one test file's session-wide cluster and the next
file's)::

    bridge   hb<P>c<K>        in the root namespace, *without an address*: the root namespace's
                              routes never change and no packet can leave the machine
    host i   netns hora-<P>-<K>-<i>, interface ``hora0`` (the same name on every host, so
             ``--network-interface hora0`` works), address 10.77.0.<11+i>/24, ``lo`` up, no
             default route (anything outside 10.77.0.0/24 is unreachable from inside)
    sshd     in each namespace on <address>:2222, host key, authorized key and client key made
             for the cluster in a temporary directory; ``ssh_bin`` holds an ``ssh`` wrapper that
             keeps known-host entries in that directory instead of ~/.ssh

Processes inside the namespaces share the file system and process table with the caller, so the
ranks run the same Python and tests can read their pids. :meth:`Cluster.close` kills what it
started and anything still running in the namespaces, deletes the namespaces and the bridge;
it also runs at interpreter exit, and :func:`remove_stale` deletes leftovers of dead processes.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.77.0"
"""The /24 the namespaces use (no address of it exists outside them)."""
FIRST_HOST = 11
SSH_PORT = 2222
IFACE = "hora0"
_SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/bin/sshd", "/sbin/sshd")
_NAME = re.compile(r"^hora-(\d+)-(?:\d+-)?\d+$")  # (also the older hora-<P>-<i>)
_BRIDGE = re.compile(r"^\d+: hb(\d+)(?:c\d+)?[:@]")
_CLUSTERS = itertools.count()


def _run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def sshd_path() -> str | None:
    """The OpenSSH server binary, or None."""
    return next((p for p in _SSHD_CANDIDATES if os.access(p, os.X_OK)), shutil.which("sshd"))


def unavailable(ssh: bool = True, shaping: bool = False) -> str | None:
    """Why a :class:`Cluster` cannot be made here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip",) + (("tc",) if shaping else ()):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if ssh:
        if sshd_path() is None:
            return "sshd is not installed (apt-get install openssh-server)"
        for tool in ("ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed (apt-get install openssh-client)"
    probe = f"hora-{os.getpid()}-probe"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_stale(min_age_s: float = 600.0) -> None:
    """Delete namespaces and bridges left by processes that died without cleaning up (owner pid
    gone and older than ``min_age_s``, so another session's live cluster is never touched)."""
    owners = set()
    for name in _run("ip", "netns", "list", check=False).stdout.split():
        match = _NAME.match(name)
        if match is None:
            continue
        owner = int(match.group(1))
        try:
            age = time.time() - os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            continue
        if _alive(owner) or age < min_age_s:
            owners.add(owner)
            continue
        _kill_netns_processes(name)
        _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        match = _BRIDGE.match(line)
        if match and int(match.group(1)) not in owners and not _alive(int(match.group(1))):
            _run("ip", "link", "del", line.split(":")[1].strip().split("@")[0], check=False)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child (kept across exec) if the process that made it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def netns_inode(name: str) -> int | None:
    """The inode identifying namespace ``name`` (as /proc/<pid>/ns/net shows it)."""
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def pids_in_netns(name: str) -> list[int]:
    """Pids of the processes whose network namespace is ``name``."""
    inode = netns_inode(name)
    if inode is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.stat(entry / "ns" / "net").st_ino == inode:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _kill_netns_processes(name: str) -> None:
    for pid in pids_in_netns(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Host:
    """One namespace: its name, address and (when started) its sshd."""

    index: int
    netns: str
    address: str
    veth: str
    sshd: subprocess.Popen[bytes] | None = None

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *command]

    def processes(self) -> list[int]:
        """Pids running in this namespace, other than its sshd listener."""
        skip = {self.sshd.pid} if self.sshd is not None else set()
        return [p for p in pids_in_netns(self.netns) if p not in skip]


@dataclass
class Cluster:
    """``n`` namespaces on a private bridge, optionally each with an sshd (see module doc);
    ``mtu`` of the links (1500: Ethernet's)."""

    n: int
    ssh: bool = True
    mtu: int = 1500
    hosts: list[Host] = field(default_factory=list)
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hora-netns-")))
    tag: str = field(default_factory=lambda: f"{os.getpid()}c{next(_CLUSTERS)}")
    _closed: bool = False

    @property
    def bridge(self) -> str:
        """The bridge's name (at most 15 characters, the kernel's limit)."""
        return f"hb{self.tag}"

    @property
    def identity(self) -> str:
        """The client's private key (pass as ``hora run -i``)."""
        return str(self.directory / "id_ed25519")

    @property
    def ssh_bin(self) -> str:
        """A directory to put first on PATH: its ``ssh`` keeps known hosts in the cluster."""
        return str(self.directory / "bin")

    def start(self) -> Cluster:
        """Create everything; on any failure, remove what was made and re-raise."""
        atexit.register(self.close)
        try:
            remove_stale()
            self._make_network()
            if self.ssh:
                self._start_sshd()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_network(self) -> None:
        pid, seq = self.tag.split("c")
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for i in range(self.n):
            host = Host(i, f"hora-{pid}-{seq}-{i}", f"{SUBNET}.{FIRST_HOST + i}",
                        f"hv{self.tag}x{i}")
            self.hosts.append(host)
            _run("ip", "netns", "add", host.netns)
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", IFACE,
                 "netns", host.netns)
            _run("ip", "link", "set", host.veth, "mtu", str(self.mtu), "master", self.bridge,
                 "up")
            inside = ["ip", "-n", host.netns]
            _run(*inside, "addr", "add", f"{host.address}/24", "dev", IFACE)
            _run(*inside, "link", "set", IFACE, "mtu", str(self.mtu), "up")
            _run(*inside, "link", "set", "lo", "up")

    def _start_sshd(self) -> None:
        d = self.directory
        (d / "bin").mkdir()
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_ed25519"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.identity)
        shutil.copy(self.identity + ".pub", d / "authorized_keys")
        wrapper = d / "bin" / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -o UserKnownHostsFile="
                           f"{d}/known_hosts -o GlobalKnownHostsFile=/dev/null \"$@\"\n")
        wrapper.chmod(0o755)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        sshd = sshd_path()
        assert sshd is not None
        for host in self.hosts:
            config = d / f"sshd_config.{host.index}"
            config.write_text("\n".join([
                f"ListenAddress {host.address}:{SSH_PORT}", f"HostKey {d}/host_ed25519",
                f"AuthorizedKeysFile {d}/authorized_keys", f"PidFile {d}/sshd.{host.index}.pid",
                "StrictModes no", "UsePAM no", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes", "X11Forwarding no", "PrintMotd no", "UseDNS no",
                "LogLevel ERROR", ""]))  # MaxStartups stays sshd's default (10)
            with open(d / f"sshd.{host.index}.log", "wb") as log:
                host.sshd = subprocess.Popen(host.argv(sshd, "-D", "-e", "-f", str(config)),
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=log, preexec_fn=_die_with_parent)
        for host in self.hosts:
            self._wait_listening(host)

    def _wait_listening(self, host: Host, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        probe = host.argv(sys.executable, "-c",
                          f"import socket; socket.create_connection(('{host.address}', "
                          f"{SSH_PORT}), 1).close()")
        while True:
            assert host.sshd is not None
            if host.sshd.poll() is not None:
                log = (self.directory / f"sshd.{host.index}.log").read_text()
                raise RuntimeError(f"sshd in {host.netns} exited ({host.sshd.returncode}): {log}")
            if _run(*probe, check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd in {host.netns} is not listening after {timeout} s")
            time.sleep(0.05)

    def shape(self, rate: str, delay: str | None = None, burst: str = "256kb",
              latency: str = "20ms") -> str:
        """Limit every host's outgoing link to ``rate`` (tc units, e.g. ``"1gbit"``), with a
        one-way ``delay`` (e.g. ``"0.2ms"``) when the kernel has ``netem``.

        Uses ``netem rate .. delay ..`` when a delay is asked for and netem exists, otherwise a
        token bucket (``tbf``; some kernels, e.g. minimal VM kernels, have no netem).

        Returns:
            What was applied, for reports (says when the delay could not be).
        """
        note = ""
        for host in self.hosts:
            tc = ["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", IFACE,
                  "root"]
            if delay:
                done = _run(*tc, "netem", "rate", rate, "delay", delay, "limit", "20000",
                            check=False)
                if done.returncode == 0:
                    continue
                if "unknown" not in done.stderr:
                    raise RuntimeError(f"tc netem failed: {done.stderr.strip()}")
                note = f"; no delay: this kernel has no netem qdisc ({delay} not applied)"
            _run(*tc, "tbf", "rate", rate, "burst", burst, "latency", latency)
        if delay and not note:
            return f"netem rate {rate} delay {delay}"
        return f"tbf rate {rate} burst {burst} latency {latency}{note}"

    def leftovers(self) -> dict[str, list[int]]:
        """Processes (other than the sshd listeners) still running in each namespace."""
        return {h.netns: procs for h in self.hosts if (procs := h.processes())}

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridge, remove the keys."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.kill()
                try:
                    host.sshd.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            _kill_netns_processes(host.netns)
            _run("ip", "netns", "del", host.netns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.directory, ignore_errors=True)


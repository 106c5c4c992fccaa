"""Elastic training across separate hosts: network namespaces with their own sshd
(tests/_netns.py). Host 0 runs the driver and one worker; hosts 1-3 are reached over ssh.

Skipped (with the reason) without root, iproute2 or the OpenSSH server.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from runner.helpers import PY, Launcher, clean_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _netns  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKER = str(Path(__file__).with_name("elastic_worker.py"))


@pytest.fixture(scope="module")
def cluster() -> Iterator[_netns.Cluster]:
    reason = _netns.unavailable(ssh=True)
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces and sshd: {reason}")
    with _netns.Cluster(4) as made:
        yield made


def test_lost_host_then_a_new_host_sizes_go_3_2_3(cluster: _netns.Cluster,
                                                   tmp_path: Path) -> None:
    h = [host.address for host in cluster.hosts]
    mark = tmp_path / "killed"
    # hosts 0-2 at first; once the worker on host 2 marked its death, host 2 is gone; 4 s later
    # host 3 appears.
    script = tmp_path / "discover.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"if [ ! -e {mark} ]; then printf '{h[0]}:1\\n{h[1]}:1\\n{h[2]}:1\\n'; exit 0; fi\n"
        f"age=$(( $(date +%s) - $(stat -c %Y {mark}) ))\n"
        f"if [ $age -lt 4 ]; then printf '{h[0]}:1\\n{h[1]}:1\\n'; "
        f"else printf '{h[0]}:1\\n{h[1]}:1\\n{h[3]}:1\\n'; fi\n")
    script.chmod(0o755)
    argv = cluster.hosts[0].argv(
        PY, "-m", "hora.runner", "run", "-p", str(_netns.SSH_PORT), "-i", cluster.identity,
        "-np", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script),
        "--verbose", PY, WORKER)
    env = clean_env(EW_LOG=str(tmp_path), EW_KILL="2:20", EW_MARK=str(mark), EW_STEPS="300",
                    EW_SLEEP="0.05")
    env["PATH"] = f"{cluster.ssh_bin}:{env['PATH']}"
    with Launcher(argv=argv, env=env, cwd=tmp_path) as launcher:
        result = launcher.wait(100)
    assert result.rc == 0, result.err[-4000:]
    done = result.json_lines("wid")
    assert sorted(done) == [0, 1, 3], result.err[-3000:]
    assert len({tuple(d["w"]) for d in done.values()}) == 1
    assert done[0]["sizes"] == [3, 2, 3]
    messages = "\n".join(result.hora_messages())
    # the worker's ssh reports the remote death by signal as 128 + 9
    assert f"worker 2 on {h[2]} exited with code 137 (SIGKILL)" in messages
    assert "generation 2: 2 worker(s) (left: worker 2" in messages
    assert f"joined: worker 3 on {h[3]}" in messages

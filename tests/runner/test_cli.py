"""The ``hora`` command line: usage errors, generated knob flags, help, version, check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hora.config import KNOBS
from hora.errors import ConfigError
from hora.runner.cli import main, spec_from_args
from hora.runner.config_file import config_values
from hora.runner.launch import HostSlots, LaunchSpec, is_local_host, parse_hostfile, parse_hosts
from hora.runner.run_flags import build_run_parser

from .helpers import PY, run_hora, worker


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def spec(*argv: str) -> LaunchSpec:
    return spec_from_args(build_run_parser().parse_args(list(argv)))


# ---- usage errors: exit 2 with a clear message, nothing started ---------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    ((), "-np/--num-proc N is required"),
    (("-np", "2"), "no command given"),
    (("-np", "0", "true"), "argument -np/--num-proc: must be >= 1"),
    (("-np", "2", "--min-np", "3", "true"), "--min-np 3 is more than -np 2"),
    (("-np", "3", "--min-np", "2", "--max-np", "2", "true"), "--max-np 2 is less than -np 3"),
    (("-np", "2", "--reset-limit", "1", "true"), "--reset-limit only apply to elastic mode"),
    (("-np", "2", "--blacklist-cooldown-range", "1", "5", "true"), "elastic mode"),
    (("-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "0", "10", "true"),
     "--blacklist-cooldown-range"),
    (("-np", "2", "--host-discovery-script", "d.sh", "--slots-per-host", "0", "true"),
     "--slots-per-host: must be >= 1"),
    (("-np", "4", "-H", "localhost:2", "true"), "too few slots: -np 4 but the hosts"),
    (("-np", "2", "-H", "localhost:x", "true"), "'localhost:x' is not <hostname>:<slots>"),
    (("-np", "2", "-H", "localhost:2,", "true"), "'' is not <hostname>:<slots>"),
    (("-np", "2", "-H", "localhost:0", "true"), "slots must be a whole number >= 1"),
    (("-np", "2", "--cycle-time-ms", "abc", "true"),
     "argument --cycle-time-ms: --cycle-time-ms='abc' is not a valid value for knob"),
    (("-np", "2", "--fusion-threshold-mb", "-1", "true"), "must be >= 0"),
    (("-np", "2", "--log-level", "loud", "true"), "expected one of trace, debug, info"),
    (("-np", "2", "--allreduce-algorithm", "tree", "true"), "expected one of auto, ring"),
    (("-np", "2", "--mpi", "--data-plane", "torch", "true"),
     "--mpi runs the job under mpirun with the mpi data plane, but --data-plane torch asks"),
    (("-np", "2", "--data-plane", "nccl", "true"), "expected one of builtin, torch, mpi"),
    (("-np", "2", "--min-np", "1", "--data-plane", "mpi", "true"),
     "the mpi data plane cannot follow an elastic job's changing membership"),
    (("-np", "2", "--jsrun", "true"), "no jsrun launcher mode"),
    (("-np", "2", "--gloo", "--mpi", "true"), "not allowed with argument"),
    (("-np", "2", "-H", "localhost:2", "-hostfile", "h", "true"), "not allowed with argument"),
    (("-np", "2", "-x", "1BAD=x", "true"), "'1BAD' is not an environment variable name"),
    (("-np", "2", "-x", "HOROVOD_RANK=3", "true"), "hora run sets HOROVOD_RANK"),
    (("-np", "2", "-x", "HORA_SECRET_KEY=00", "true"), "hora run sets HORA_SECRET_KEY"),
    (("-np", "2", "--network-interface", "nosuch0", "true"),
     "network interface 'nosuch0' does not exist"),
    (("-np", "2", "--autotune-gaussian-process-noise", "2", "true"), "must be <= 1.0"),
    (("-np", "2", "-hostfile", "/nonexistent/hosts", "true"), "cannot read it"),
])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                             message: str) -> None:
    rc, out, err = run_cli(capsys, "run", *argv)
    assert rc == 2
    assert message in err
    assert err.startswith("usage: hora run")
    assert out == ""


def test_unknown_hora_variable_in_the_environment_is_one_clear_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HORA_FUSION_THRESHHOLD", "1")
    rc, _, err = run_cli(capsys, "run", "-np", "2", "true")
    assert rc == 2
    assert "unknown hora setting HORA_FUSION_THRESHHOLD" in err
    assert "did you mean HORA_FUSION_THRESHOLD?" in err


def test_malformed_knob_value_from_x_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "run", "-np", "1", "-x", "HORA_CYCLE_TIME=soon", "true")
    assert rc == 2
    assert "HORA_CYCLE_TIME='soon' is not a valid value" in err


def test_bad_hostfile_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\nlocalhost cores=4\n")
    with pytest.raises(ConfigError, match="line 2: 'localhost cores=4' is not"):
        parse_hostfile(path)
    path.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile(path)


def test_host_parsing() -> None:
    assert parse_hosts("localhost:2,127.0.0.1:4") == (HostSlots("localhost", 2),
                                                       HostSlots("127.0.0.1", 4))
    assert parse_hosts("localhost") == (HostSlots("localhost", 1),)


def test_this_machine_is_local_others_are_not() -> None:
    import socket

    for name in ("localhost", "127.0.0.1", "127.0.1.1", "::1", socket.gethostname()):
        assert is_local_host(name), name
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: documentation only, never this host


# ---- generated knob flags ----------------------------------------------------------------------

def _sample(knob: Any) -> tuple[list[str], str]:
    """A flag value for ``knob`` and the env string it must produce."""
    assert knob.cli is not None
    if knob.type is bool:
        return [knob.cli], "1"
    if knob.type is int:
        return [knob.cli, "3"], str(3 * knob.cli_scale)
    if knob.type is float:
        value = "0.5" if knob.maximum is not None and knob.maximum < 2.5 else "2.5"
        return [knob.cli, value], value
    if knob.choices:
        return [knob.cli, knob.choices[-1].upper()], knob.choices[-1]
    if knob.name == "thread_affinity":  # a comma list of cores
        return [knob.cli, "1,0"], "1,0"
    return [knob.cli, "some-value"], "some-value"


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.cli and not k.unsupported and k.name
                                  not in ("gloo_iface", "start_timeout")], ids=lambda k: k.name)
def test_every_knob_with_a_flag_is_exported_as_its_hora_variable(knob: Any) -> None:
    argv, expected = _sample(knob)
    got = spec("-np", "1", *argv, "true").env
    assert got[knob.env] == expected
    if knob.type is bool:
        assert spec("-np", "1", "--no-" + knob.cli[2:], "true").env[knob.env] == "0"


def test_knobs_not_given_are_not_exported() -> None:
    assert spec("-np", "1", "true").env == {}


def test_start_timeout_and_interfaces() -> None:
    got = spec("-np", "1", "--start-timeout", "12", "--network-interface", "lo", "true")
    assert got.start_timeout == 12.0
    assert got.env == {"HORA_GLOO_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_horovodrun_spellings_are_accepted() -> None:
    got = spec("--num-proc", "2", "--no-stall-check", "--log-with-timestamp",
               "--disable-cache", "-p", "22", "-i", "key", "--gloo", "--", "python", "x.py")
    assert got.command == ("python", "x.py") and got.np == 2
    assert got.env["HORA_STALL_CHECK_DISABLE"] == "1"
    assert got.env["HORA_LOG_HIDE_TIME"] == "0"
    assert (got.ssh_port, got.ssh_identity_file) == (22, "key")


def test_slots_prefix_is_refused_as_elastic(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "run", "-np", "2", "--slots", "2", "true")
    assert rc == 2 and "--slots-per-host only apply to elastic mode" in err


def test_command_keeps_its_own_flags() -> None:
    got = spec("-np", "2", "python", "train.py", "--verbose", "-np", "8")
    assert got.command == ("python", "train.py", "--verbose", "-np", "8")
    assert got.verbose is False


# ---- config file ---------------------------------------------------------------------------------

def test_config_file_sections_map_to_knobs() -> None:
    values, controller = config_values({
        "controller": "gloo",
        "params": {"fusion_threshold_mb": 32, "cycle_time_ms": 2, "hierarchical_allreduce": True},
        "stall_check": {"enabled": False, "warning_time_seconds": 10},
        "logging": {"level": "DEBUG", "with_timestamp": False},
        "autotune": {"enabled": False, "warmup_samples": 3},
        "timeline": {"filename": "t.json"},
        "library_options": {"gloo_timeout_seconds": 20},
    }, "cfg.yaml")
    assert controller == "gloo"
    assert values == {"fusion_threshold": 32, "cycle_time": 2.0, "hierarchical_allreduce": True,
                      "stall_check_disable": True, "stall_check_time_seconds": 10.0,
                      "log_level": "debug", "log_hide_time": True, "autotune": False,
                      "timeline": "t.json", "gloo_timeout_seconds": 20.0,
                      "autotune_warmup_samples": 3}


@pytest.mark.parametrize(("data", "message"), [
    ({"paramz": {}}, "unknown section 'paramz'"),
    ({"params": {"fusion_threshold": 1}}, "unknown key params.fusion_threshold"),
    ({"params": {"cycle_time_ms": "soon"}}, "cfg.yaml: params.cycle_time_ms='soon'"),
    ({"controller": "jsrun"}, "controller must be gloo or mpi"),
    (["params"], "expected a mapping"),
])
def test_config_file_errors(data: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config_values(data, "cfg.yaml")


def test_config_file_needs_pyyaml_or_applies_under_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("params:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 5\n")
    try:
        import yaml  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        rc, _, err = run_cli(capsys, "run", "-np", "1", "--config-file", str(path), "true")
        assert rc == 2 and "pip install pyyaml" in err
        return
    got = spec("-np", "1", "--cycle-time-ms", "1", "--config-file", str(path), "true").env
    assert got["HORA_FUSION_THRESHOLD"] == str(32 * 1024 * 1024)
    assert got["HORA_CYCLE_TIME"] == "1.0"  # the command line wins, wherever it stands


# ---- help, version, check ------------------------------------------------------------------------

def test_run_help_leads_with_the_most_used_options(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "run", "--help")
    assert rc == 0 and out.startswith("usage: hora run [options] -np N command")
    assert len(out.splitlines()) <= 60, len(out.splitlines())
    for flag in ("-np N", "-H HOST:SLOTS", "--hostfile FILE", "--verbose", "--output-filename",
                 "command", "--help-all", "-cb, --check-build"):
        assert flag in out, flag
    assert "--fusion-threshold-mb MB" not in out and "examples:" in out
    assert run_cli(capsys, "run", "-h")[1] == out


def test_run_help_all_is_grouped_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "run", "--help-all")
    assert rc == 0
    for title in ("general:", "tunables", "elastic", "stall check:", "hosts", "controller:"):
        assert title in out
    assert "[default: 128; env HORA_FUSION_THRESHOLD]" in out
    assert "--hierarchical-allreduce, --no-hierarchical-allreduce" in out


def test_top_level(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.startswith("hora ")
    assert run_cli(capsys, "-v")[1] == out
    assert run_cli(capsys, "run", "--version")[1] == out
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0 and "commands:" in out
    rc, _, err = run_cli(capsys)
    assert rc == 2 and "usage: hora" in err
    rc, _, err = run_cli(capsys, "train.py")
    assert rc == 2 and "use: hora run -np N train.py" in err


def test_check_reports_versions_and_the_horovod_checklist(
        capsys: pytest.CaptureFixture[str]) -> None:
    import numpy

    rc, out, _ = run_cli(capsys, "check")
    assert rc == 0
    assert f"numpy     {numpy.__version__}" in out or f"numpy {numpy.__version__}" in out
    assert "Python" in out and "Transports:" in out and "[X] tcp" in out
    assert "Available Frameworks:" in out and "Available Controllers:" in out
    assert "Available Tensor Operations:" in out
    import hora

    # the rows say what hvd.*_built() say (hora has its own engine, listed as such; its data
    # planes run tensor operations on MPI and Gloo where mpi4py / torch are installed)
    ops = out[out.index("Available Tensor Operations:"):]
    assert (f"    [{'X' if hora.gloo_built() else ' '}] Gloo (data plane torch") in ops
    assert (f"    [{'X' if hora.mpi_built() else ' '}] MPI (data plane mpi") in ops
    assert hora.gloo_built()  # torch is installed in the test environment
    controllers = out[out.index("Available Controllers:"):out.index("Available Tensor")]
    assert "    [ ] MPI" in controllers and "    [ ] Gloo" in controllers
    assert (f"    [{'X' if hora.nccl_built() else ' '}] NCCL") in out
    assert "    [X] hora (TCP between hosts, shared memory on a host)" in out
    assert "    [ ] MXNet" in out
    rc, out, _ = run_cli(capsys, "run", "-cb")
    assert rc == 0 and out.startswith("hora v")
    assert run_cli(capsys, "--check-build")[1] == out
    assert run_cli(capsys, "check", "--check-build")[1] == out


def test_hora_check_cb_as_a_command() -> None:
    """`hora check -cb` (horovodrun -cb's flag after `check`, as the migration guide says):
    the checklist first, then the report; a real process with a hard timeout."""
    result = run_hora("check", "-cb", timeout=60)
    assert result.rc == 0, result.err
    assert result.out.startswith("hora v") and "Available Tensor Operations:" in result.out, \
        result.out
    assert result.out.index("Available Frameworks:") < result.out.index("Transports:"), \
        "the checklist comes first"
    assert "unrecognized arguments" not in result.err, result.err


def test_check_says_what_the_code_does(capsys: pytest.CaptureFixture[str]) -> None:
    """`hora check` states shipped capabilities as they are: multi-host launch over ssh exists
    (hora/runner/ssh.py), so does elastic launch; Keras's own version is shown."""
    from importlib.metadata import PackageNotFoundError, version

    from hora.runner.check import hora_has

    rc, out, _ = run_cli(capsys, "check")
    assert rc == 0
    line = next(ln for ln in out.splitlines() if "hora run " in ln and "[X]" in ln)
    assert hora_has("runner.ssh") and "other hosts over ssh" in line
    assert ("elastic: not yet" in line) == (not hora_has("elastic")), line
    try:
        keras = version("keras")
    except PackageNotFoundError:
        return
    keras_line = next(ln for ln in out.splitlines() if ln.strip().startswith(("[X] Keras",
                                                                                 "[ ] Keras")))
    assert keras in keras_line, keras_line


def test_check_imports_no_framework_and_the_runner_no_engine() -> None:
    code = ("import sys, hora; before = set(sys.modules)\n"
            "from hora.runner import check, cli; check.probes()\n"
            "new = set(sys.modules) - before\n"
            "bad = [m for m in new if m.split('.')[0] in ('torch', 'tensorflow', 'jax')\n"
            "       or m.startswith(('hora.core', 'hora.collectives', 'hora.transports'))]\n"
            "print(sorted(bad))\n")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- entry points as installed ----------------------------------------------------------

def test_console_script_and_horovodrun_spelling() -> None:
    script = Path(sys.executable).parent / "hora"
    if not script.exists():
        pytest.skip("hora console script not installed next to this interpreter")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0 and out.stdout.startswith("hora ")
    result = run_hora("-np", "2", *worker("print('hi')"))  # `hora -np 2 ...` without `run`
    assert result.rc == 0 and result.lines() == {0: ["hi"], 1: ["hi"]}


def test_forwarding_an_unset_variable_warns(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HORA_TEST_UNSET_VAR", raising=False)
    got = spec("-np", "1", "-x", "HORA_TEST_UNSET_VAR", "true")
    assert "HORA_TEST_UNSET_VAR" not in got.env
    assert "nothing to forward" in capsys.readouterr().err


def test_capabilities_before_init_say_no_plane_is_enabled() -> None:
    import hora

    assert hora.mpi_enabled() is False and hora.gloo_enabled() is False
    with pytest.raises(ValueError, match="MPI is not enabled.*HORA_DATA_PLANE=mpi"):
        hora.mpi_threads_supported()

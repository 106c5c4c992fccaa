"""Every numeric knob is finite and in its range, or refused naming the knob, where it is set
and the range: from either environment name, a ``hora run`` flag, a config file and
``hora.run()``. Parametrized over the knob table, so a new knob is covered by its row.

Before this, ``value < minimum`` let NaN through (``HORA_HEARTBEAT_TIMEOUT_SECONDS=nan`` and
``HORA_CYCLE_TIME=inf`` spun both ranks at 99% CPU with the first allreduce never returning,
``HORA_TIMEOUT_SECONDS=inf`` crashed the engine with ``OverflowError``), and a timeout of 0
failed every op at once.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner.helpers import clean_env, run_hora, worker

from hora.config import KNOBS, Knob, allowed_text, load, parse_value
from hora.errors import ConfigError
from hora.knobs import MAX_SECONDS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)

NUMERIC = [k for k in KNOBS if k.type in (int, float)]
TIMES = [k for k in NUMERIC if k.type is float and re.search(r"time|second", k.name + k.doc, re.I)]
"""Durations (seconds, or milliseconds for the cycle time), found by name or doc."""


def _zero_allowed(knob: Knob) -> bool:
    return knob.minimum is not None and (knob.minimum < 0 or (
        knob.minimum == 0 and not knob.minimum_excluded))


def bad_values(knob: Knob) -> list[str]:
    """Values every numeric knob must refuse: NaN, both infinities, a negative number, 0 where
    0 means nothing, and a value above the maximum."""
    bad = ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1"]
    if not _zero_allowed(knob):
        bad.append("0")
    if knob.maximum is not None:
        bad.append(repr(knob.maximum * 10))
    return bad


def _cases(knobs: list[Knob]) -> list[tuple[Knob, str]]:
    return [(k, v) for k in knobs for v in bad_values(k)]


def _id(case: object) -> str:
    return case.name if isinstance(case, Knob) else str(case)


def test_the_time_knobs_are_the_ones_expected() -> None:
    """The parametrized lists are built from the table; this guards the filter itself."""
    assert {k.name for k in TIMES} >= {
        "cycle_time", "timeout_seconds", "gloo_timeout_seconds", "stall_check_time_seconds",
        "stall_shutdown_time_seconds", "deadlock_time_seconds", "heartbeat_timeout_seconds",
        "start_timeout", "start_timeout_cap", "elastic_timeout"}


@pytest.mark.parametrize(("knob", "raw"), _cases(NUMERIC), ids=_id)
@pytest.mark.parametrize("which", ["env", "alias"])
def test_a_value_out_of_range_is_refused_from_either_variable(knob: Knob, raw: str,
                                                              which: str) -> None:
    var = knob.env if which == "env" else knob.alias
    if var is None:
        pytest.skip("hora-only knob: no Horovod alias")
    with pytest.raises(ConfigError) as err:
        load({var: raw})
    text = str(err.value)
    assert text.startswith(f"{var}={raw!r}"), text
    assert f"knob '{knob.name}'" in text and allowed_text(knob) in text, text
    assert knob.env in text  # where it is set, even when the alias was used
    if knob.cli:
        assert f"hora run {knob.cli}" in text


@pytest.mark.parametrize("knob", TIMES, ids=_id)
def test_each_time_knob_refuses_nan_inf_and_negative_and_says_what_0_does(knob: Knob) -> None:
    for raw in ("nan", "inf", "-inf", "-0.5"):
        with pytest.raises(ConfigError, match=re.escape(f"{knob.env}={raw!r}: knob "
                                                        f"'{knob.name}' must be")):
            load({knob.env: raw})
    if _zero_allowed(knob):
        assert load({knob.env: "0"}) == load({}).replace(**{knob.name: 0.0})
    else:
        with pytest.raises(ConfigError, match=r"must be > 0; allowed: a number > 0"):
            load({knob.env: "0"})
    assert knob.maximum is not None and knob.maximum <= MAX_SECONDS  # finite, fits the OS
    assert getattr(load({knob.env: str(knob.maximum)}), knob.name) == knob.maximum


@pytest.mark.parametrize("knob", NUMERIC, ids=_id)
def test_where_0_is_allowed_the_table_says_what_it_does(knob: Knob) -> None:
    if not _zero_allowed(knob) or knob.unsupported:
        assert not knob.zero_means
        return
    assert knob.zero_means, f"{knob.name} accepts 0 but does not say what 0 does (zero_means)"
    assert f"(0: {knob.zero_means})" in allowed_text(knob)


@pytest.mark.parametrize("knob", NUMERIC, ids=_id)
def test_every_value_in_range_passes_and_docs_state_the_range(knob: Knob) -> None:
    low = 1 if knob.minimum is None else knob.minimum + (1 if knob.minimum_excluded else 0)
    value = parse_value(knob, str(low), knob.env)
    assert value == low and math.isfinite(value)
    row = next(line for line in (ROOT / "docs" / "config.md").read_text().splitlines()
               if line.startswith(f"| {knob.name} |"))
    assert f"| {allowed_text(knob)} |" in row


def test_whole_numbers_may_be_written_as_floats_but_not_as_fractions() -> None:
    assert load({"HOROVOD_FUSION_THRESHOLD": "1e6"}).fusion_threshold == 1_000_000
    assert load({"HOROVOD_CACHE_CAPACITY": "64.0"}).cache_capacity == 64
    with pytest.raises(ConfigError, match="expected a whole number; allowed: a whole number >= 0"):
        load({"HOROVOD_CACHE_CAPACITY": "6.5"})


def test_the_stall_check_time_refusing_0_says_how_to_turn_it_off() -> None:
    with pytest.raises(ConfigError, match="HOROVOD_STALL_CHECK_DISABLE=1"):
        load({"HOROVOD_STALL_CHECK_TIME_SECONDS": "0"})


# ---- hora run flags, config files, hora.run() -------------------------------------------------

def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from hora.runner.cli import main

    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("knob", "raw"), _cases([k for k in NUMERIC if k.cli]), ids=_id)
def test_hora_run_refuses_the_flag_before_starting_anything(
        capsys: pytest.CaptureFixture[str], knob: Knob, raw: str) -> None:
    assert knob.cli is not None
    elastic = ["--min-np", "1"] if knob.name == "elastic_timeout" else []
    rc, err = _run_cli(capsys, "run", "-np", "1", *elastic, f"{knob.cli}={raw}", "true")
    assert rc == 2, err
    assert re.search(re.escape(f"argument {knob.cli}: {knob.cli}={raw!r}") + "(: | is not a "
                     f"valid value for )knob '{knob.name}'", err), err
    assert allowed_text(knob) in " ".join(err.split()), err


def _config_file_keys() -> list[tuple[str, str, Knob]]:
    from hora.runner.config_file import _CONFIG_FILE

    by_name = {k.name: k for k in NUMERIC}
    return [(section, key, by_name[target[0]]) for section, keys in _CONFIG_FILE.items()
            for key, target in keys.items() if target is not None and target[0] in by_name]


@pytest.mark.parametrize(("section", "key", "knob"), _config_file_keys(),
                         ids=lambda c: _id(c))
def test_a_config_file_value_out_of_range_is_refused(section: str, key: str,
                                                     knob: Knob) -> None:
    from hora.runner.config_file import config_values

    for value in (float("nan"), float("inf"), -1, *([] if _zero_allowed(knob) else [0])):
        with pytest.raises(ConfigError, match=re.escape(
                f"cfg.yaml: {section}.{key}={str(value)!r}") + ".*" + re.escape(knob.name)):
            config_values({section: {key: value}}, "cfg.yaml")


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_hora_run_api_refuses_a_bad_start_timeout_before_starting_anything(
        value: float, monkeypatch: pytest.MonkeyPatch) -> None:
    import hora

    for var in [v for v in os.environ if v.startswith(("HORA_", "HOROVOD_"))]:
        monkeypatch.delenv(var)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"HORA_START_TIMEOUT=.*knob 'start_timeout' must be"):
        hora.run(abs, args=(-1,), np=1, start_timeout=value)
    assert time.monotonic() - started < 10


# ---- real processes ----------------------------------------------------------------------------

@pytest.mark.parametrize(("var", "raw"), [
    ("HORA_HEARTBEAT_TIMEOUT_SECONDS", "nan"), ("HORA_CYCLE_TIME", "inf"),
    ("HOROVOD_GLOO_TIMEOUT_SECONDS", "inf"), ("HORA_TIMEOUT_SECONDS", "0"),
    ("HOROVOD_START_TIMEOUT", "nan")])
def test_a_job_with_a_bad_value_in_its_environment_is_refused_at_once(var: str,
                                                                      raw: str) -> None:
    """The values of the issue: hora run refuses them before any rank starts (rc 2, in
    seconds, instead of spinning or crashing); init() without hora run refuses them too."""
    done = run_hora("run", "-np", "2", *worker("print('STARTED')"),
                    env=clean_env(**{var: raw}), timeout=30)
    assert done.rc == 2 and "STARTED" not in done.out, done.out + done.err
    assert f"{var}={raw!r}: knob " in done.err and "must be" in done.err, done.err
    code = ("import hora\ntry:\n    hora.init()\nexcept hora.errors.ConfigError as exc:\n"
            "    print('REFUSED', exc)\nelse:\n    print('STARTED')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, env=clean_env(**{var: raw}))
    assert out.stdout.startswith(f"REFUSED {var}={raw!r}: knob "), out.stdout + out.stderr

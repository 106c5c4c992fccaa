"""The knob table: parsing, precedence, errors that name the knob, docs in sync."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from hora.config import KNOBS, Config, load
from hora.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_config_fields_match_knob_table() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(Config)}
    assert set(fields) == {k.name for k in KNOBS}
    for k in KNOBS:
        assert fields[k.name] == k.default, k.name


def test_defaults_and_horovod_alias() -> None:
    assert load({}) == Config()
    cfg = load({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "2.5"})
    assert cfg.fusion_threshold == 1024 and cfg.cycle_time == 2.5


def test_hora_wins_over_horovod() -> None:
    cfg = load({"HORA_FUSION_THRESHOLD": "10", "HOROVOD_FUSION_THRESHOLD": "20"})
    assert cfg.fusion_threshold == 10


def test_gloo_timeout_feeds_timeout_seconds() -> None:
    assert load({"HOROVOD_GLOO_TIMEOUT_SECONDS": "7"}).timeout_seconds == 7.0


@pytest.mark.parametrize("env,words", [
    ({"HORA_FUSION_THRESHOLD": "lots"}, "fusion_threshold"),
    ({"HOROVOD_CYCLE_TIME": "-1"}, "must be >= 0"),
    ({"HORA_STALL_CHECK_DISABLE": "maybe"}, "stall_check_disable"),
    ({"HORA_ALLREDUCE_ALGORITHM": "tree"}, "expected one of auto, ring, small, star"),
    ({"HORA_FUSION_THRESOLD": "1"}, "did you mean HORA_FUSION_THRESHOLD"),
])
def test_bad_values_name_the_knob(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(env)


def test_docs_table_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_config_docs.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "config.md").read_text() == gen.render(), (
        "docs/config.md is stale: run python scripts/gen_config_docs.py")


def test_unknown_horovod_names_are_found_with_the_closest_known_one() -> None:
    from hora.config import unknown_horovod_vars

    env = {"HOROVOD_FUSION_THRESHOLDD": "1", "HOROVOD_CYCLE_TIME": "1", "HOROVOD_RANK": "0",
           "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_GPU_ALLREDUCE": "NCCL", "HOROVOD_QXQXQXQXQX": "1",
           "HORA_FUSION_THRESHOLD": "1", "PATH": "/bin"}
    assert unknown_horovod_vars(env) == [("HOROVOD_FUSION_THRESHOLDD", "HOROVOD_FUSION_THRESHOLD"),
                                         ("HOROVOD_QXQXQXQXQX", None)]
    # Still only a warning: the config loads (Horovod tolerates unknown names).
    assert load(env).cycle_time == 1.0

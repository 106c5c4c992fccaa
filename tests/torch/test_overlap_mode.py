"""The torch_overlap knob: whether CPU gradients' hooks start allreduces during backward."""

from __future__ import annotations

import pytest
import torch

from hora._util.cpus import usable_cpus
from hora.config import load
from hora.errors import ConfigError
from hora.torch import optimizer


def test_on_and_off_force_the_mode() -> None:
    assert optimizer.overlaps(64, "on") is True
    assert optimizer.overlaps(1, "off") is False


def test_auto_asks_for_a_core_per_rank_beyond_torchs_threads() -> None:
    threads = torch.get_num_threads()
    cpus = usable_cpus()
    assert optimizer.overlaps(1, "auto") is (cpus >= threads + 1)
    assert optimizer.overlaps(cpus + 1, "auto") is False  # more ranks than cores: never


def test_a_rank_bound_by_hora_run_counts_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # hora run --cpu-binding auto gave this rank its share: the mask is its own, not shared
    monkeypatch.setenv("HORA_BOUND_CPUS", "0")
    threads = torch.get_num_threads()
    assert optimizer.overlaps(64, "auto") is (usable_cpus() >= threads + 1)
    monkeypatch.delenv("HORA_BOUND_CPUS")
    assert optimizer.overlaps(64, "auto") is (usable_cpus() / 64 >= threads + 1)


def test_the_process_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizer, "OVERLAP", True)
    assert optimizer.overlaps(1, "off") is True


def test_the_knob_is_read_and_checked() -> None:
    assert load({"HORA_TORCH_OVERLAP": "off"}).torch_overlap == "off"
    assert load({}).torch_overlap == "auto"
    with pytest.raises(ConfigError, match="HORA_TORCH_OVERLAP"):
        load({"HORA_TORCH_OVERLAP": "sometimes"})

"""examples/torch_sharded.py as a real 2-rank job: it trains (accuracy over 80% after 2
epochs), each rank holds part of the optimizer state, and rank 0's checkpoint holds the full
state. Hard timeout; the job's process group is killed afterwards (test_examples.run)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_examples import ROOT, hora_run

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.integration

SHARDED = ROOT / "examples" / "torch_sharded.py"


def test_sharded_two_ranks(tmp_path: Path) -> None:
    import torch

    checkpoint = tmp_path / "sharded.pt"
    result = hora_run(2, SHARDED, "--epochs", "2", "--checkpoint", str(checkpoint),
                      cwd=tmp_path, timeout=90)
    assert result.rc == 0, result.explain()
    lines = result.rank_lines(0)
    match = re.fullmatch(r"final validation accuracy (\d+\.\d)% \(2 ranks\)", lines[-1])
    assert match, result.explain()
    assert float(match.group(1)) > 80.0, result.explain()
    state = [line for line in lines if line.startswith("optimizer state per rank")]
    assert len(state) == 1, result.explain()
    sizes = [int(x) for x in re.findall(r"rank \d (\d+) KiB", state[0])]
    full = int(re.search(r"unsharded (\d+) KiB", state[0]).group(1))  # type: ignore[union-attr]
    assert len(sizes) == 2 and all(s < 0.6 * full for s in sizes), state[0]
    saved = torch.load(checkpoint, weights_only=True)
    assert len(saved["optimizer"]["state"]) == len(saved["model"])  # every parameter's state

"""Rank-side helpers both frameworks' training functions share: the run's files in the store,
per-epoch logging. No framework and no engine here."""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

from hora._util.log import get_logger

log = get_logger("hora.spark.train")

CHECKPOINT_META = "checkpoint.json"
"""Beside a run's checkpoint: ``{"epoch": epochs done, "history": ...}``."""


def epoch_logger(verbose: int, rank: int) -> logging.Logger:
    """The logger of the per-epoch lines: info level on rank 0 when ``verbose``."""
    if verbose and rank == 0:
        log.setLevel(logging.INFO)
    return log


def save_checkpoint(store: Any, checkpoint_file: str, data: bytes, epoch: int,
                    history: Any, logs_path: str | None) -> None:
    """Write the run's checkpoint, then ``checkpoint.json`` (epochs done, history), then the
    history under the run's logs: a reader that finds ``checkpoint.json`` finds the
    checkpoint it describes."""
    store.write(checkpoint_file, data)
    text = json.dumps({"epoch": epoch, "history": history})
    store.write_text(posixpath.join(posixpath.dirname(checkpoint_file), CHECKPOINT_META), text)
    if logs_path:
        store.write_text(posixpath.join(logs_path, "history.json"), text)


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())

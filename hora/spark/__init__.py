"""``hora.spark``: Horovod's ``horovod.spark`` API: :func:`run` runs a function in one rank per
Spark task (barrier execution mode) and returns the results in rank order.

Launcher layer: importing this package loads neither pyspark nor the engine; :func:`run`
imports pyspark on its first call. See docs/spark.md.
"""

from __future__ import annotations

from hora.spark.outcome import SparkJobError
from hora.spark.runner import run

__all__ = ["SparkJobError", "run"]

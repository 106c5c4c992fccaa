"""Horovod's ``horovod.spark.common``: the pieces the Spark Estimators share: :mod:`.store`
(where data, checkpoints and logs go), :mod:`.backend` (how the ranks run), the parameters, the
data preparation and the rank-side Parquet reader.

Importing this package loads nothing heavy; its modules import pyspark / pyarrow when used.
"""

"""Case group: the framework-neutral collective suite through the TensorFlow factory (eager),
then the TensorFlow-only cases (tf.function, gradients, tape, mismatches). 2 ranks."""

from __future__ import annotations

from typing import Any

import collective_suite
import tf_cases
from tf_factory import TFFactory


def init(hvd: Any) -> None:
    collective_suite.init(hvd)


def cases() -> list[tuple[str, Any]]:
    suite = collective_suite.cases(TFFactory())
    wrapped = [(case_id, lambda hvd, fn=fn: fn(hvd, TFFactory())) for case_id, fn in suite]
    # join must stay last: after it, every rank has left the data loop
    return wrapped[:-1] + tf_cases.cases() + wrapped[-1:]

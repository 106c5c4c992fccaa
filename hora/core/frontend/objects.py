"""Object collectives: any picklable Python object, through two tensor collectives each.

``broadcast_object`` sends the root's pickle (size, then bytes); ``allgather_object`` gathers
every rank's pickle (sizes, then bytes). They are named by their own counters
(``broadcast_object.noname.<n>``, :mod:`hora.core.op.naming`), never by the object's type:
Horovod's type names hang ``broadcast_object(x if root else None)``. cloudpickle is used when
installed (closures, lambdas), plain pickle otherwise.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from hora.core.engine import context
from hora.core.frontend.api import allgather_async, broadcast_async
from hora.core.op.process_set import ProcessSet, global_process_set

try:
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle is optional
    _pickler = pickle


def broadcast_object(obj: Any, root_rank: int = 0, *, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Pickle ``obj`` on ``root_rank`` and return a copy of it on every member of the set."""
    ctx = context.get("broadcast_object")
    base = ctx.engine.names.base("broadcast_object", name, process_set.process_set_id or 0)
    payload = np.frombuffer(_dumps(obj), np.uint8) if ctx.rank == root_rank else None
    size = np.array([0 if payload is None else payload.size], dtype=np.int64)
    size = broadcast_async(size, root_rank, name=f"broadcast_object.{base}.size",
                           process_set=process_set).wait()
    buf = payload if payload is not None else np.empty(int(size[0]), np.uint8)
    data = broadcast_async(buf, root_rank, name=f"broadcast_object.{base}.data",
                           process_set=process_set).wait()
    return obj if ctx.rank == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, *, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Pickle ``obj`` on every rank; return the list of all ranks' objects in rank order."""
    ctx = context.get("allgather_object")
    base = ctx.engine.names.base("allgather_object", name, process_set.process_set_id or 0)
    payload = np.frombuffer(_dumps(obj), np.uint8)
    sizes = allgather_async(np.array([payload.size], np.int64),
                            name=f"allgather_object.{base}.size", process_set=process_set).wait()
    data = allgather_async(payload, name=f"allgather_object.{base}.data",
                           process_set=process_set).wait()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return buf.getvalue()

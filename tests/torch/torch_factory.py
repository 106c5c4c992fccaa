"""The torch tensor factory for the framework-neutral collective suite."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

REDUCE = ["int32", "int64", "float16", "bfloat16", "float32", "float64"]


class TorchFactory:
    """float64 numpy values <-> torch tensors of a named dtype."""

    reduce_dtypes = list(REDUCE)
    move_dtypes = REDUCE + ["uint8", "int8", "int16"]
    rejected = {
        family: ["bool", "uint8", "int8", "int16", "complex64"]
        for family in ("allreduce", "allreduce_", "grouped_allreduce", "reducescatter")
    } | {family: ["bool", "complex64"] for family in ("allgather", "broadcast", "alltoall")}

    def make(self, values: np.ndarray, dtype: str) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=getattr(torch, dtype))

    def values(self, tensor: Any) -> np.ndarray:
        return tensor.detach().cpu().to(torch.float64).numpy()

    def dtype(self, tensor: Any) -> str:
        return str(tensor.dtype).replace("torch.", "")

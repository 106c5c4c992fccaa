"""The function every rank of a :class:`~hora.spark.torch.TorchEstimator` fit runs: Horovod's
recipe with ``hora.torch`` on the rank's shard of the Parquet data in the store.

Per rank: ``hvd.init()``; the model and optimizer (pickled together from the driver, so the
optimizer holds the model's parameters), or the run's last checkpoint when it resumes; rank 0's
state broadcast; ``hvd.DistributedOptimizer``; then ``epochs`` epochs of a fixed number of
steps on every rank, validation after each, metrics averaged over the ranks, and rank 0 writing
the checkpoint and the history to the store after each epoch.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from hora.spark.common.reader import ShardReader, steps
from hora.spark.common.training import epoch_logger, format_metrics, save_checkpoint


def _tensor(values: np.ndarray, shape: list[int] | None = None) -> Any:
    import torch

    if values.dtype == np.float64 or values.dtype == np.bool_:
        values = values.astype(np.float32)
    elif values.dtype.kind in "iu":
        values = values.astype(np.int64)
    tensor = torch.from_numpy(np.require(values, requirements=["C", "W"]))
    return tensor.reshape([int(d) for d in shape]) if shape is not None else tensor


def _loss(spec: dict[str, Any], outputs: list[Any], labels: list[Any],
          weights: Any) -> Any:
    losses = spec["loss"]
    losses = list(losses) if isinstance(losses, (list, tuple)) else [losses] * len(outputs)
    scales = spec["loss_weights"] or [1.0] * len(outputs)
    total = 0
    for fn, scale, out, label in zip(losses, scales, outputs, labels):
        value = fn(out, label)
        if weights is not None:  # a per-row loss (reduction='none'), weighted
            value = (value.reshape(len(weights), -1).mean(dim=1) * weights).sum() / weights.sum()
        total = total + scale * value
    return total


def _batch(spec: dict[str, Any], batch: dict[str, np.ndarray]) -> tuple[Any, Any, Any]:
    if spec["transformation_fn"] is not None:
        batch = spec["transformation_fn"](batch)
    inputs = [_tensor(batch[c], s) for c, s in zip(spec["feature_cols"], spec["input_shapes"])]
    label_shapes = spec["label_shapes"] or [None] * len(spec["label_cols"])
    labels = [_tensor(batch[c], s) for c, s in zip(spec["label_cols"], label_shapes)]
    weight_col = spec["sample_weight_col"]
    weights = _tensor(batch[weight_col]).float() if weight_col else None
    return inputs, labels, weights


def _epoch(spec: dict[str, Any], model: Any, opt: Any, batches: Any, n_steps: int,
           train: bool) -> dict[str, float]:
    import torch

    model.train(train)
    sums: dict[str, float] = {}
    passes = spec["backward_passes_per_step"]
    with torch.set_grad_enabled(train):
        for step in range(n_steps):
            inputs, labels, weights = _batch(spec, next(batches))
            if train and step % passes == 0:
                opt.zero_grad()
            out = model(*inputs)
            outputs = list(out) if isinstance(out, (list, tuple)) else [out]
            loss = _loss(spec, outputs, labels, weights)
            if train:
                loss.backward()
                if (step + 1) % passes == 0:
                    opt.step()
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for metric in spec["metrics"]:
                name = getattr(metric, "__name__", type(metric).__name__)
                value = metric(outputs[0] if len(outputs) == 1 else outputs,
                               labels[0] if len(labels) == 1 else labels)
                sums[name] = sums.get(name, 0.0) + float(value)
    return {k: v / n_steps for k, v in sums.items()}


def _average(values: dict[str, float], name: str) -> dict[str, float]:
    import torch

    import hora.torch as hvd

    if not values:
        return {}
    keys = sorted(values)
    mean = hvd.allreduce(torch.tensor([values[k] for k in keys], dtype=torch.float64),
                         name=name, op=hvd.Average)
    return {k: float(v) for k, v in zip(keys, mean.tolist())}


def _restore(spec: dict[str, Any], model: Any, opt: Any) -> tuple[int, list[Any]]:
    import torch

    checkpoint = spec["checkpoint"]
    if checkpoint is None:
        return 0, []
    data, meta = checkpoint
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return int(meta.get("epoch", 0)), list(meta.get("history", []))


def train(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns ``{'history': [...], 'state': bytes}`` (the final
    model and optimizer state, ``torch.save``'d), the other ranks None."""
    import torch

    import hora.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
    seed = spec["random_seed"]
    if seed is not None:
        torch.manual_seed(seed)
    model, opt = spec["model"], spec["optimizer"]
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for group in opt.param_groups for p in group["params"]):
        raise ValueError("TorchEstimator: the optimizer must be built on the model's "
                         "parameters (optimizer=torch.optim.SGD(model.parameters(), ...))")
    start_epoch, history = _restore(spec, model, opt)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    passes = spec["backward_passes_per_step"]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=spec["gradient_compression"] or
                                   hvd.Compression.none, backward_passes_per_step=passes)
    columns = [*spec["feature_cols"], *spec["label_cols"]]
    if spec["sample_weight_col"]:
        columns.append(spec["sample_weight_col"])
    store, info = spec["store"], spec["info"]
    batch_size = spec["batch_size"]
    reader = ShardReader(store, info.train_data_path, columns, info.metadata, rank, size,
                         batch_size, spec["shuffle"], seed or 0, spec["inmemory_cache_all"])
    train_steps = spec["train_steps_per_epoch"] or steps(info.train_rows, batch_size, size)
    train_steps = -(-train_steps // passes) * passes  # whole optimizer steps
    val_batches, val_steps = None, 0
    if info.val_data_path:
        val_batch = spec["val_batch_size"] or batch_size
        val_reader = ShardReader(store, info.val_data_path, columns, info.metadata, rank,
                                 size, val_batch, False, 0, spec["inmemory_cache_all"])
        val_batches = val_reader.batches()
        val_steps = spec["validation_steps_per_epoch"] or steps(info.val_rows, val_batch, size)
    log = epoch_logger(spec["verbose"], rank)
    callbacks = list(spec["callbacks"] or [])
    for cb in callbacks:
        getattr(cb, "on_train_begin", lambda: None)()
    batches = reader.batches()
    for epoch in range(start_epoch, spec["epochs"]):
        metrics = _average(_epoch(spec, model, opt, batches, train_steps, True),
                           f"hora.spark.train.{epoch}")
        val: dict[str, float] = {}
        if val_batches is not None:
            val = _average(_epoch(spec, model, opt, val_batches, val_steps, False),
                           f"hora.spark.val.{epoch}")
        history.append({"epoch": epoch + 1, "train": metrics, "validation": val})
        log.info("epoch %d/%d (%d steps of %d rows per rank): %s%s", epoch + 1,
                 spec["epochs"], train_steps, batch_size, format_metrics(metrics),
                 (" validation " + format_metrics(val)) if val else "")
        if rank == 0 and spec["checkpoint_file"]:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            save_checkpoint(store, spec["checkpoint_file"], buffer.getvalue(), epoch + 1,
                            history, spec["logs_path"])
        logs = {**metrics, **{f"val_{k}": v for k, v in val.items()}}
        for cb in callbacks:
            getattr(cb, "on_epoch_end", lambda e, logs: None)(epoch, logs)
    for cb in callbacks:
        getattr(cb, "on_train_end", lambda logs: None)(history[-1] if history else {})
    reader.close()
    if rank != 0:
        return None
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    return {"history": history, "state": buffer.getvalue()}

"""Data-parallel training of a real classifier with ``hora.torch`` (Horovod's PyTorch API).

Two ranks train one small MLP on scikit-learn's handwritten digits dataset (1797 8x8 images,
shipped inside the package: no download). Each rank sees its own half of every epoch through a
``DistributedSampler``; ``hvd.DistributedOptimizer`` averages the gradients while backward runs,
so both ranks hold identical weights after every step. This is Horovod's recipe, unchanged:

* rank 0's initial weights and optimizer state are broadcast to everyone (SGD with momentum,
  or Adam with ``--optimizer adam``);
* the learning rate is scaled by ``hvd.size()``, reached by a linear warmup over the first
  epoch(s) (Goyal et al., "Accurate, Large Minibatch SGD");
* metrics are averaged across ranks with ``hvd.allreduce`` (distributed evaluation: each rank
  scores its shard of the validation set, the sums are added up);
* only rank 0 shows a progress bar and writes the checkpoint.

Run it (the README's demo, ``bash scripts/demo.sh``, runs the first line)::

    hora run -np 2 python examples/torch_digits.py
    hora run -np 2 python examples/torch_digits.py --epochs 5 --checkpoint /tmp/digits.pt
    python examples/torch_digits.py          # one process, no launcher (size 1)

It ends with a line like ``final validation accuracy 97.8% (2 ranks)`` (~5 s of training).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hora.torch as hvd

DEFAULT_CHECKPOINT = Path(tempfile.gettempdir()) / "hora_examples" / "torch_digits.pt"


def load_digits_split(seed: int, val_fraction: float
                      ) -> tuple[TensorDataset, TensorDataset, int, int]:
    """Standardized train / validation datasets, identical on every rank (fixed ``seed``).

    Returns:
        (train, validation, number of features, number of classes)
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("this example needs scikit-learn: pip install scikit-learn")
    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=val_fraction, random_state=seed,
                                              stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0)
    std[std == 0] = 1.0  # border pixels that are always blank
    x_tr, x_va = (x_tr - mean) / std, (x_va - mean) / std

    def as_dataset(xs: np.ndarray, ys: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(xs.astype(np.float32)), torch.from_numpy(ys))

    return as_dataset(x_tr, y_tr), as_dataset(x_va, y_va), x.shape[1], int(y.max()) + 1


class MLP(nn.Module):
    """A small multilayer perceptron: in -> hidden -> hidden -> classes, ReLU, dropout."""

    def __init__(self, n_in: int, n_out: int, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, n_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def metric_totals(model: nn.Module, loader: DataLoader) -> torch.Tensor:
    """``[sum of losses, number correct, number of samples]`` over ``loader`` (this rank)."""
    totals = torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), len(y)],
                                   dtype=torch.float64)
    return totals


def global_metrics(totals: torch.Tensor, name: str) -> tuple[float, float]:
    """Mean loss and accuracy over every rank's samples: one Sum-allreduce of the totals."""
    loss_sum, correct, count = hvd.allreduce(totals, op=hvd.Sum, name=name).tolist()
    return loss_sum / max(count, 1.0), correct / max(count, 1.0)


def warmup_lr(base_lr: float, size: int, step: int, warmup_steps: int) -> float:
    """Linear warmup from ``base_lr`` to ``base_lr * size`` over ``warmup_steps`` steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return base_lr * size
    return base_lr * (1 + (size - 1) * step / warmup_steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                        help="SGD with momentum, or Adam (try --lr 0.001)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="epochs of linear learning-rate warmup up to lr * size")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="share of the dataset held out for validation")
    parser.add_argument("--seed", type=int, default=42,
                        help="seed for the split, the initial weights and the shuffling")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="where rank 0 writes the final model and optimizer state")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    if not 0 < args.val_fraction < 1:
        parser.error("--val-fraction must be between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> float:
    """Train, evaluate, checkpoint; return the final validation accuracy (every rank)."""
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)  # two ranks on a small machine: one core each
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)

    train_ds, val_ds, n_in, n_out = load_digits_split(args.seed, args.val_fraction)
    train_sampler: DistributedSampler[int] = DistributedSampler(
        train_ds, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler)
    # Evaluation: every sample exactly once across ranks (DistributedSampler would pad).
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), size)),
                            batch_size=256)

    model = MLP(n_in, n_out)
    optimizer: torch.optim.Optimizer
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size,
                                    momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if rank == 0:
        print(f"digits: {len(train_ds)} train / {len(val_ds)} validation samples, {n_in} "
              f"features, {n_out} classes; {size} rank(s), batch {args.batch_size} per rank, "
              f"{args.optimizer} lr {args.lr} x {size}", flush=True)

    progress = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm
            progress = tqdm
        except ImportError:
            pass

    steps_per_epoch = len(train_loader)
    warmup_steps = int(args.warmup_epochs * steps_per_epoch)
    step = 0
    val_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        model.train()
        batches = train_loader
        bar = None
        if progress is not None:
            bar = progress(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                           file=sys.stdout, ncols=68, mininterval=0.25)
            batches = bar
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y in batches:
            for group in optimizer.param_groups:
                group["lr"] = warmup_lr(args.lr, size, step, warmup_steps)
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()  # waits for the averaged gradients, then steps
            step += 1
            totals += torch.tensor([loss.item() * len(y), (out.argmax(1) == y).sum().item(),
                                    len(y)], dtype=torch.float64)
            if bar is not None:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if bar is not None:
            bar.close()
        train_loss, train_acc = global_metrics(totals, f"train_metrics.{epoch}")
        val_loss, val_acc = global_metrics(metric_totals(model, val_loader),
                                           f"val_metrics.{epoch}")
        if rank == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}  lr {optimizer.param_groups[0]['lr']:.3f}"
                  f"  train loss {train_loss:.4f} acc {100 * train_acc:5.1f}%"
                  f"  val loss {val_loss:.4f} acc {100 * val_acc:5.1f}%", flush=True)

    if rank == 0:
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.checkpoint.with_name(args.checkpoint.name + ".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epochs": args.epochs, "val_accuracy": val_acc,
                    "args": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()}}, tmp)
        os.replace(tmp, args.checkpoint)  # never a half-written checkpoint
        print(f"trained in {time.perf_counter() - started:.1f} s; checkpoint written to "
              f"{args.checkpoint}")
        print(f"final validation accuracy {100 * val_acc:.1f}% "
              f"({size} rank{'s' if size > 1 else ''})", flush=True)
    hvd.shutdown()
    return val_acc


if __name__ == "__main__":
    main()

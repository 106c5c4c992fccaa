"""Data-parallel training with sharded optimizer state: ``hora.torch.ShardedOptimizer``
(hora-only; ZeRO stage 1 behind Horovod's ``DistributedOptimizer`` API).

The data and metrics are those of ``torch_digits.py`` (scikit-learn's digits, shipped with the
package: no download), the model a deeper MLP. The one change is the wrapper::

    optimizer = hvd.ShardedOptimizer(torch.optim.Adam(...), named_parameters=...)

Each parameter's Adam moments now live on one rank only (the ranks split them by bytes), so
every rank holds about ``1/size`` of the optimizer state; gradients are reduce-scattered to
their owners, each rank steps its own parameters, and the new values are allgathered: the
weights stay identical on every rank, and training is the same as with
``DistributedOptimizer``. ``optimizer.state_dict()`` is collective and returns the *full* state
(every rank calls it, rank 0 writes it), so the checkpoint loads at any number of ranks, or
into a plain ``torch.optim.Adam``.

Run it::

    hora run -np 2 python examples/torch_sharded.py
    hora run -np 2 python examples/torch_sharded.py --epochs 5 --checkpoint /tmp/sharded.pt

It ends with a line like ``final validation accuracy 97.5% (2 ranks)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch import nn  # noqa: E402
from torch_digits import global_metrics, load_digits_split, metric_totals  # noqa: E402

import hora.torch as hvd  # noqa: E402

DEFAULT_CHECKPOINT = Path(tempfile.gettempdir()) / "hora_examples" / "torch_sharded.pt"


def make_model(n_in: int, n_out: int, hidden: int, depth: int) -> nn.Module:
    """An MLP with ``depth`` hidden layers of ``hidden`` units (ReLU, dropout): the hidden x
    hidden matrices carry most of the state, and the ranks share them out whole."""
    layers: list[nn.Module] = [nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(0.1)]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(hidden, n_out))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (this rank's shard)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if torch.is_tensor(v))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per rank")
    parser.add_argument("--lr", type=float, default=0.001,
                        help="Adam learning rate for one rank; scaled by the number of ranks")
    parser.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    parser.add_argument("--depth", type=int, default=5, help="hidden layers")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="where rank 0 writes the model and the full optimizer state")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> float:
    """Train, evaluate, checkpoint, reload; return the final validation accuracy."""
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)

    train_ds, val_ds, n_in, n_out = load_digits_split(args.seed, 0.2)
    sampler: DistributedSampler[int] = DistributedSampler(train_ds, num_replicas=size,
                                                          rank=rank, shuffle=True,
                                                          seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), size)),
                            batch_size=256)

    model = make_model(n_in, n_out, args.hidden, args.depth)
    optimizer = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr * size),
                                     named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if rank == 0:
        print(f"digits: {len(train_ds)} train / {len(val_ds)} validation samples; {size} "
              f"rank(s), Adam lr {args.lr} x {size}, optimizer state sharded", flush=True)

    val_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3, dtype=torch.float64)
        for x, y in train_loader:
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()  # reduce-scatter, step this rank's shard, allgather
            totals += torch.tensor([loss.item() * len(y), (out.argmax(1) == y).sum().item(),
                                    len(y)], dtype=torch.float64)
        train_loss, train_acc = global_metrics(totals, f"train_metrics.{epoch}")
        val_loss, val_acc = global_metrics(metric_totals(model, val_loader),
                                           f"val_metrics.{epoch}")
        if rank == 0:
            print(f"epoch {epoch + 1:2d}/{args.epochs}  train loss {train_loss:.4f} acc "
                  f"{100 * train_acc:5.1f}%  val loss {val_loss:.4f} acc "
                  f"{100 * val_acc:5.1f}%", flush=True)

    mine = state_bytes(optimizer)
    everyone = hvd.allgather_object(mine)
    full_state = optimizer.state_dict()  # collective: every rank calls it
    unsharded = sum(v.numel() * v.element_size() for s in full_state["state"].values()
                    for v in s.values() if torch.is_tensor(v))
    if rank == 0:
        print("optimizer state per rank: " + ", ".join(
            f"rank {r} {b / 1024:.0f} KiB" for r, b in enumerate(everyone))
            + f" (unsharded {unsharded / 1024:.0f} KiB)", flush=True)
        args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.checkpoint.with_name(args.checkpoint.name + ".tmp")
        torch.save({"model": model.state_dict(), "optimizer": full_state,
                    "val_accuracy": val_acc}, tmp)
        os.replace(tmp, args.checkpoint)
    hvd.barrier()
    # The checkpoint holds the full state: a plain Adam (any number of ranks) takes it.
    saved = torch.load(args.checkpoint, weights_only=True)
    plain = torch.optim.Adam(make_model(n_in, n_out, args.hidden, args.depth).parameters())
    plain.load_state_dict(saved["optimizer"])
    assert state_bytes(plain) == unsharded
    if rank == 0:
        print(f"trained in {time.perf_counter() - started:.1f} s; checkpoint (full state) "
              f"written to {args.checkpoint}")
        print(f"final validation accuracy {100 * val_acc:.1f}% "
              f"({size} rank{'s' if size > 1 else ''})", flush=True)
    hvd.shutdown()
    return val_acc


if __name__ == "__main__":
    main()

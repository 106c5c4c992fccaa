"""Elastic training of the digits classifier with ``hora.torch`` (Horovod's ``hvd.elastic``).

The model, data and metrics of ``examples/torch_digits.py``, written so that workers may die or
join while the job runs and training goes on with whoever is there (docs/elastic.md):

* ``hvd.elastic.TorchState`` holds what must survive a membership change: the model, the
  optimizer, the ``ElasticSampler`` and the position in the data (``epoch``, ``batch``);
* ``state.commit()`` every ``--commit-every`` batches snapshots it in memory. When a worker
  dies, the survivors roll back to the last commit and go on without it; a worker that joins
  (a replacement) gets the committed state from rank 0 at a commit;
* the ``ElasticSampler`` splits only the samples of the epoch not processed yet among the
  workers of the moment (``record_batch`` after each step, ``set_epoch`` at the END of an epoch);
* a reset callback rescales the learning rate to the new number of workers;
* no collective between ``hvd.init()`` and ``train(state)``: a newcomer runs this script from
  the top while the survivors wait inside ``train``; ``state.sync()`` does the broadcasts. The
  slow set-up comes before ``hvd.init()``, so that the survivors do not wait for it;
* ``--checkpoint PATH``: commits live in memory only; rank 0 also writes a file every epoch,
  from which a new job resumes if every worker was lost.

Run it (``--verbose`` makes ``hora run`` print every membership change)::

    hora run -np 3 --min-np 2 --max-np 3 python examples/torch_elastic.py
    hora run -np 3 --min-np 2 --max-np 3 --verbose python examples/torch_elastic.py \\
        --kill-worker-at-epoch 2 --step-delay 0.05

``--kill-worker-at-epoch E`` is a demo: worker 1 (the ``[1]`` prefix of its output lines, see
``--kill-worker``) SIGKILLs itself halfway through epoch E. The other two roll back to the last
commit and train on as 2 workers; ``hora run`` starts a replacement (worker 3) at once, which
joins at a later commit. It happens once: the replacement has another worker id. An epoch takes
~0.1 s here, less than the replacement needs to start (importing torch), so ``--step-delay``
slows the steps down enough to see it join. The job ends with a line like
``final validation accuracy 97.5% (3 worker(s))``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch_digits import MLP, load_digits_split, metric_totals  # examples/torch_digits.py

import hora.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step, per worker")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="learning rate for one worker; scaled by the number of workers")
    parser.add_argument("--commit-every", type=int, default=5,
                        help="batches between commits (what a failure rolls back at most)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="rank 0 writes it at every epoch's end; a new job resumes from it")
    parser.add_argument("--kill-worker-at-epoch", type=int, default=None, metavar="E",
                        help="demo: a worker SIGKILLs itself halfway through epoch E (1-based)")
    parser.add_argument("--kill-worker", type=int, default=1, metavar="ID",
                        help="the worker id (output prefix) that --kill-worker-at-epoch kills")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="demo: sleep after every step, so that a replacement (a few "
                             "seconds to start) joins before training ends")
    parser.add_argument("--seed", type=int, default=42, help="split, weights and shuffling")
    return parser.parse_args()


def evaluate(model: torch.nn.Module, val_ds: TensorDataset, name: str) -> tuple[float, float]:
    """Validation loss and accuracy over every sample, split among the workers of the moment."""
    shard = Subset(val_ds, range(hvd.rank(), len(val_ds), hvd.size()))
    totals = metric_totals(model, DataLoader(shard, batch_size=256))
    loss_sum, correct, count = hvd.allreduce(totals, op=hvd.Sum, name=name).tolist()
    return loss_sum / count, correct / count


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    # The slow set-up (seconds: scikit-learn, torch.optim's first use) comes before init():
    # from a newcomer's init() on, the running workers wait for it in their state.sync().
    train_ds, val_ds, n_in, n_out = load_digits_split(args.seed, val_fraction=0.2)
    model = MLP(n_in, n_out)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    epoch, accuracy = 0, 0.0
    if args.checkpoint is not None and args.checkpoint.exists():  # every worker had died
        saved = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        epoch, accuracy = saved["epoch"], saved["accuracy"]
    hvd.init()  # a newcomer waits here until the running workers reach a commit
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_ds, shuffle=True, seed=args.seed)
    sampler.set_epoch(epoch)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler)

    def rescale_lr() -> None:  # after every membership change, before training goes on
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    rescale_lr()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=epoch, batch=0,
                                   accuracy=accuracy)
    state.register_reset_callbacks([rescale_lr])
    worker_id = int(os.environ.get("HORA_ELASTIC_WORKER_ID", "-1"))  # set by `hora run`

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        # Entered once per membership change: state.sync() has just given every worker rank
        # 0's last commit, and the loader iterates over what is left of the epoch.
        while state.epoch < args.epochs:
            model.train()
            offset = state.batch  # batches of this epoch done before the last change
            for i, (x, y) in enumerate(loader):
                state.batch = offset + i
                if state.batch % args.commit_every == 0:
                    state.commit()  # newcomers join here; a failure rolls back to here
                if (worker_id == args.kill_worker and state.epoch + 1 == args.kill_worker_at_epoch
                        and i == len(loader) // 2):
                    os.kill(os.getpid(), signal.SIGKILL)  # demo: die without a word
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()  # a dead peer makes this raise; hvd.elastic.run recovers
                sampler.record_batch(i, args.batch_size)
                time.sleep(args.step_delay)
            loss, state.accuracy = evaluate(model, val_ds, f"val.{state.epoch}")
            if hvd.rank() == 0:
                print(f"epoch {state.epoch + 1:2d}/{args.epochs}  {hvd.size()} worker(s)  lr "
                      f"{optimizer.param_groups[0]['lr']:.3f}  val loss {loss:.4f} acc "
                      f"{100 * state.accuracy:5.1f}%  ({time.perf_counter() - started:.1f} s)",
                      flush=True)
            state.epoch, state.batch = state.epoch + 1, 0
            sampler.set_epoch(state.epoch)  # at the END of an epoch: reshuffle, nothing done
            if hvd.rank() == 0 and args.checkpoint is not None:  # survives losing every worker
                args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
                tmp = args.checkpoint.with_name(args.checkpoint.name + ".tmp")
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": state.epoch, "accuracy": state.accuracy}, tmp)
                os.replace(tmp, args.checkpoint)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(f"final validation accuracy {100 * state.accuracy:.1f}% ({hvd.size()} worker(s))",
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

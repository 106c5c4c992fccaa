"""``ElasticSampler``: a ``DistributedSampler`` that survives membership changes.

It partitions the indices of the current epoch that have **not** been processed yet among the
ranks of the current world. Put it in a :class:`~hora.torch.elastic.TorchState` so that its
progress (``epoch``, ``processed_num``) is committed, restored and synced with the rest::

    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            for batch_idx, batch in enumerate(loader):   # only the unprocessed samples
                ...                                      # forward, backward, step
                state.sampler.record_batch(batch_idx, 32)
                state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)         # at the END of the epoch
            state.commit()

Ranks are assumed to progress in lock-step (``record_batch`` counts ``batch_size * size()``
samples per call), as with Horovod's sampler.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch.utils.data

from hora._basics import rank, size


def partition(remaining: list[int], num_replicas: int, rank: int) -> list[int]:
    """This rank's share of ``remaining``: padded by wrapping around to a multiple of
    ``num_replicas`` (every rank gets ``ceil(len(remaining) / num_replicas)`` indices; nothing is
    dropped), then every ``num_replicas``-th index starting at ``rank``.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas)``.
    """
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"partition: need num_replicas >= 1 and 0 <= rank < num_replicas, got "
                         f"num_replicas={num_replicas}, rank={rank}")
    if not remaining:
        return []
    total = math.ceil(len(remaining) / num_replicas) * num_replicas
    repeats = math.ceil(total / len(remaining))
    padded = (remaining * repeats)[:total]
    return padded[rank:total:num_replicas]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Sampler that partitions a dataset across ranks and repartitions after resets
    (Horovod's ``horovod.torch.elastic.ElasticSampler``).

    Args:
        dataset: the dataset to sample (only ``len(dataset)`` is used; its size must not change).
        shuffle: shuffle the indices every epoch with ``random.Random(seed + epoch)``.
        seed: shuffling seed; must be the same on every rank.

    ``hora.torch.init()`` must have been called: the sampler reads ``size()`` and ``rank()``
    on construction and in every :meth:`reset`.

    Attributes (read them, do not set them): ``epoch``, ``processed_num`` (samples of this epoch
    already processed by the whole world), ``num_replicas`` and ``rank`` (as of the last reset),
    ``remaining_indices`` (unprocessed indices of this epoch, in shuffled order),
    ``num_samples`` (this rank's share, ``len(self)``) and ``total_size``
    (``num_samples * num_replicas``).
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: forget the processed count and reshuffle.

        Call it at the **end** of an epoch (``set_epoch(epoch + 1)``), not at the start: calling
        it at the start of a resumed epoch would forget the samples already processed."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one processed batch of ``batch_size`` samples on every rank (adds
        ``batch_size * num_replicas``; ``batch_idx`` is unused, as in Horovod)."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        """``{'epoch': ..., 'processed_num': ...}``: all a sampler needs to resume."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take ``epoch`` and ``processed_num`` from ``state_dict``, then :meth:`reset`."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Re-read ``size()`` / ``rank()`` and recompute this rank's share of the indices of
        the current epoch that are not processed yet (the first ``processed_num`` of the
        shuffled order)."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self.indices = partition(self.remaining_indices, self.num_replicas, self.rank)
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["ElasticSampler", "partition"]

"""hora.torch.elastic: TorchState's save / restore / commit / sync per handler, the handler
registry, ElasticSampler's partitioning, and ``hvd.elastic.run`` in a 1-rank world; then one
real 2-rank ``hora run`` job checks that ``sync()`` makes rank 1 equal to rank 0.

This module is also the job's case group (``init`` / ``cases`` below, run by torch_worker.py).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import CaseJob, run_cases
from torch import nn

import hora.torch as hvd
from hora.errors import HorovodInternalError, HostsUpdatedInterrupt
from hora.torch.elastic import sampler as sampler_mod
from hora.torch.elastic import state as state_mod
from hora.torch.elastic.sampler import ElasticSampler, partition
from hora.torch.elastic.state import StateHandler, TorchState

NP = 2


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture(autouse=True)
def _world(request: pytest.FixtureRequest) -> None:
    if "job" not in request.fixturenames:  # the job tests run in other processes
        request.getfixturevalue("one_rank")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 3, generator=gen)).pow(2).sum().backward()
        opt.step()


def _sd_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_sd_equal(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_sd_equal(x, y) for x, y in zip(a, b)))
    return bool(a == b)


def _storages(tree: Any) -> set[int]:
    if isinstance(tree, torch.Tensor):
        return {tree.untyped_storage().data_ptr()} if tree.numel() else set()
    if isinstance(tree, dict):
        return set().union(*(_storages(v) for v in tree.values())) if tree else set()
    if isinstance(tree, (list, tuple)):
        return set().union(*(_storages(v) for v in tree)) if tree else set()
    return set()


# --- TorchState, one rank ------------------------------------------------------------------

@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
], ids=["sgd_momentum", "adam"])
def test_restore_rolls_back_model_optimizer_and_attrs(make_opt: Any) -> None:
    model = _model()
    opt = make_opt(model.parameters())
    _train(model, opt, 2, seed=1)
    state = TorchState(model, opt, epoch=3, seen=[1, 2])
    committed = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    for _ in range(2):  # the second round checks that the first restore left no alias
        _train(model, opt, 3, seed=2)
        opt.param_groups[0]["lr"] = 0.5
        state.epoch = 9
        state.seen.append(3)
        assert not _sd_equal(model.state_dict(), committed[0])
        state.restore()
        assert _sd_equal(model.state_dict(), committed[0])
        assert _sd_equal(opt.state_dict(), committed[1])
        assert state.epoch == 3 and state.seen == [1, 2]
        assert state.model is model and state.optimizer is opt


def test_restore_then_retrain_reproduces_the_same_steps() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=1)
    state = TorchState(model, opt)
    _train(model, opt, 3, seed=7)
    want = copy.deepcopy(model.state_dict())
    state.restore()
    _train(model, opt, 3, seed=7)
    assert _sd_equal(model.state_dict(), want)


def test_commit_moves_the_restore_point() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, opt, batch=0)
    _train(model, opt, 2, seed=1)
    state.batch = 2
    state.commit()
    committed = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    _train(model, opt, 2, seed=2)
    state.batch = 4
    state.restore()
    assert _sd_equal(model.state_dict(), committed[0])
    assert _sd_equal(opt.state_dict(), committed[1])
    assert state.batch == 2


def test_restore_to_a_commit_before_the_first_step_empties_optimizer_state() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TorchState(model, opt)
    fresh = copy.deepcopy(model.state_dict())
    _train(model, opt, 2, seed=1)
    state.restore()
    assert not any(opt.state.values())
    assert _sd_equal(model.state_dict(), fresh)


def test_snapshot_shares_no_memory_with_live_objects() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 1, seed=1)
    state = TorchState(model, opt, box={"t": torch.ones(2)})
    for _ in range(2):
        live = (_storages(model.state_dict()) | _storages(opt.state_dict())
                | _storages(state.box))
        saved = (_storages(state._handlers["model"]._saved)  # type: ignore[attr-defined]
                 | _storages(state._handlers["optimizer"]._saved)  # type: ignore[attr-defined]
                 | _storages(state._saved_state))
        assert live and saved and not live & saved
        state.restore()
    state.box["t"].add_(5)
    state.restore()
    assert torch.equal(state.box["t"], torch.ones(2))


def test_commit_reuses_its_buffers() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 1, seed=1)
    state = TorchState(model, opt)
    before = _storages(state._handlers["optimizer"]._saved)  # type: ignore[attr-defined]
    _train(model, opt, 1, seed=2)
    state.commit()
    assert _storages(state._handlers["optimizer"]._saved) == before  # type: ignore[attr-defined]
    _train(model, opt, 1, seed=3)
    want = copy.deepcopy(opt.state_dict())
    state.commit()
    _train(model, opt, 1, seed=4)
    state.restore()
    assert _sd_equal(opt.state_dict(), want)


def test_module_state_dict_metadata_survives() -> None:
    model = _model()
    state = TorchState(model)
    saved = state._handlers["model"]._saved  # type: ignore[attr-defined]
    metadata = getattr(model.state_dict(), "_metadata", None)
    assert metadata and saved._metadata == metadata


def test_setattr_swaps_the_handled_object_and_saves_it() -> None:
    old, new = _model(0), _model(1)
    state = TorchState(old)
    new_values = copy.deepcopy(new.state_dict())
    state.model = new
    assert state.model is new and state._handlers["model"].value is new
    with torch.no_grad():
        next(new.parameters()).add_(1.0)
        next(old.parameters()).add_(1.0)
    old_values = copy.deepcopy(old.state_dict())
    state.restore()
    assert _sd_equal(new.state_dict(), new_values)
    assert _sd_equal(old.state_dict(), old_values)  # no longer tracked


def test_setattr_rejects_an_unhandled_type_for_a_handled_attribute() -> None:
    state = TorchState(_model())
    with pytest.raises(TypeError, match=r"TorchState\.model is tracked by ModelStateHandler"):
        state.model = None


def test_plain_attribute_given_a_model_moves_to_its_handler() -> None:
    state = TorchState(model=None, optimizer=None, epoch=0)
    model = _model()
    state.model = model
    assert "model" in state._handlers and "model" not in state._saved_state
    values = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        next(model.parameters()).mul_(2)
    state.restore()
    assert state.model is model and _sd_equal(model.state_dict(), values)


def test_lr_scheduler_is_tracked_without_copying_its_optimizer() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TorchState(model, opt, scheduler=sched)
    for _ in range(3):
        opt.step()
        sched.step()
    state.restore()
    assert state.scheduler is sched and sched.optimizer is opt
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == 1.0


class Counter:
    def __init__(self) -> None:
        self.n = 0


class CounterHandler(StateHandler):
    calls: list[str] = []

    def __init__(self, value: Counter) -> None:
        super().__init__(value)
        self.saved = value.n

    def save(self) -> None:
        CounterHandler.calls.append("save")
        self.saved = self.value.n

    def restore(self) -> None:
        CounterHandler.calls.append("restore")
        self.value.n = self.saved

    def sync(self) -> None:
        CounterHandler.calls.append("sync")
        self.value.n = hvd.broadcast_object(self.value.n, root_rank=0)


@pytest.fixture
def registry() -> Iterator[list[tuple[type, type]]]:
    before = list(state_mod.get_handler_registry())
    yield before
    state_mod.set_handler_registry(before)


def test_custom_handler_from_the_registry(registry: list[tuple[type, type]]) -> None:
    state_mod.set_handler_registry([(Counter, CounterHandler), *registry])
    counter = Counter()
    state = TorchState(counter=counter, epoch=0)
    assert isinstance(state._handlers["counter"], CounterHandler)
    CounterHandler.calls.clear()
    counter.n = 5
    state.commit()
    counter.n = 9
    state.restore()
    state.sync()
    assert counter.n == 5 and CounterHandler.calls == ["save", "restore", "sync"]
    assert TorchState(counter=Counter())._handlers.keys() == {"counter"}


def test_set_handler_registry_checks_its_entries(registry: list[tuple[type, type]]) -> None:
    with pytest.raises(TypeError, match="set_handler_registry: each entry"):
        state_mod.set_handler_registry([Counter])  # type: ignore[list-item]
    assert state_mod.get_handler_registry() == registry


def test_handlers_run_before_plain_attributes(registry: list[tuple[type, type]]) -> None:
    order: list[str] = []

    class Probe(CounterHandler):
        def save(self) -> None:
            order.append("handler")

    class Plain:
        def __deepcopy__(self, memo: Any) -> Plain:
            order.append("plain")
            return Plain()

    state_mod.set_handler_registry([(Counter, Probe), *registry])
    state = TorchState(counter=Counter(), thing=Plain())
    order.clear()
    state.save()
    assert order == ["handler", "plain"]


def test_sync_on_one_rank_keeps_the_values() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 2, seed=1)
    sampler = ElasticSampler(list(range(10)))
    sampler.record_batch(0, 2)
    state = TorchState(model, opt, sampler=sampler, epoch=4)
    want = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    state.sync()
    assert _sd_equal(model.state_dict(), want[0]) and _sd_equal(opt.state_dict(), want[1])
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 2} and state.epoch == 4


def test_sampler_progress_is_committed_and_restored() -> None:
    sampler = ElasticSampler(list(range(20)), seed=3)
    state = TorchState(sampler=sampler)
    sampler.record_batch(0, 4)
    state.commit()
    sampler.record_batch(1, 4)
    sampler.set_epoch(1)
    state.restore()
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    assert len(sampler) == 16 and len(list(sampler)) == 16


# --- ElasticSampler partitioning -----------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 12, 13])
def test_partition_covers_every_index_evenly(size: int, n: int) -> None:
    remaining = [10 * i for i in range(n)]
    shares = [partition(remaining, size, r) for r in range(size)]
    per_rank = math.ceil(n / size)
    assert all(len(s) == per_rank for s in shares)
    assert sorted(i for s in shares for i in s) == sorted(
        (remaining * size)[:per_rank * size])  # the padding wraps to the front
    if n % size == 0:
        assert sorted(i for s in shares for i in s) == remaining


def test_partition_strides_by_rank_and_pads_from_the_front() -> None:
    assert partition([5, 6, 7, 8, 9], 3, 0) == [5, 8]
    assert partition([5, 6, 7, 8, 9], 3, 1) == [6, 9]
    assert partition([5, 6, 7, 8, 9], 3, 2) == [7, 5]
    with pytest.raises(ValueError, match="0 <= rank < num_replicas"):
        partition([1], 2, 2)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``world(size, rank)``: what the sampler's next reset() reads as size() / rank()."""
    def set_world(size: int, rank: int) -> None:
        monkeypatch.setattr(sampler_mod, "size", lambda: size)
        monkeypatch.setattr(sampler_mod, "rank", lambda: rank)
    return set_world


def _shares(world: Any, size: int, state: dict[str, int], n: int = 23, shuffle: bool = True
            ) -> list[list[int]]:
    out = []
    for r in range(size):
        world(size, r)
        s = ElasticSampler(list(range(n)), shuffle=shuffle, seed=5)
        s.load_state_dict(state)
        assert (s.num_replicas, s.rank) == (size, r)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("processed", [0, 6, 20, 23, 30])
def test_sampler_splits_the_unprocessed_indices(world: Any, size: int, processed: int) -> None:
    order = list(range(23))
    random.Random(5 + 2).shuffle(order)
    remaining = order[processed:]
    shares = _shares(world, size, {"epoch": 2, "processed_num": processed})
    assert shares == [partition(remaining, size, r) for r in range(size)]
    assert {i for s in shares for i in s} == set(remaining)
    assert all(len(s) == math.ceil(len(remaining) / size) for s in shares)


def test_sampler_resumes_in_a_smaller_world(world: Any) -> None:
    world(4, 1)
    s = ElasticSampler(list(range(40)), shuffle=False)
    assert list(s) == list(range(1, 40, 4))
    s.record_batch(0, 3)  # every rank did 3 samples: 12 done
    world(3, 2)
    s.reset()
    # 28 left over 3 ranks: 30 with the first two repeated; rank 2 takes every third from 14
    assert s.processed_num == 12 and list(s) == list(range(14, 40, 3)) + [13]
    s.set_epoch(1)
    assert s.processed_num == 0 and len(s) == math.ceil(40 / 3)
    assert list(s) == list(range(2, 40, 3)) + [1]


def test_set_epoch_reshuffles_with_seed_plus_epoch(world: Any) -> None:
    world(1, 0)
    s = ElasticSampler(list(range(30)), seed=11)
    want = list(range(30))
    random.Random(11).shuffle(want)
    assert list(s) == want
    s.set_epoch(4)
    want = list(range(30))
    random.Random(15).shuffle(want)
    assert list(s) == want and s.state_dict() == {"epoch": 4, "processed_num": 0}


def test_sampler_in_a_data_loader() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    sampler = ElasticSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    assert [b.tolist() for (b,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# --- hvd.elastic ---------------------------------------------------------------------------

def test_hvd_elastic_exports_horovods_names() -> None:
    assert hvd.elastic.__all__ == ["TorchState", "ElasticSampler", "run"]
    assert hvd.elastic.TorchState is TorchState and hvd.elastic.ElasticSampler is ElasticSampler


def test_run_restores_resets_and_retries_after_a_failed_collective() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TorchState(model, opt, epoch=0)
    committed = copy.deepcopy(model.state_dict())
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    attempts: list[int] = []

    @hvd.elastic.run
    def train(state: TorchState, fail: int) -> str:
        attempts.append(state.epoch)
        if len(attempts) <= fail:
            _train(state.model, state.optimizer, 1, seed=len(attempts))
            state.epoch += 1
            raise HorovodInternalError("peer lost (test)")
        return "done"

    assert train(state, fail=2) == "done"
    assert attempts == [0, 0, 0] and resets == [1, 1] and hvd.is_initialized()
    assert _sd_equal(model.state_dict(), committed)


def test_run_skips_sync_after_removals_and_resets_samplers(world: Any) -> None:
    world(2, 1)
    sampler = ElasticSampler(list(range(8)), shuffle=False)
    state = TorchState(sampler=sampler)
    calls: list[str] = []
    state.sync = lambda: calls.append("sync")  # type: ignore[method-assign]

    @hvd.elastic.run
    def train(state: TorchState) -> list[int]:
        if not calls.count("raised"):
            calls.append("raised")
            world(1, 0)
            raise HostsUpdatedInterrupt(skip_sync=True)
        return list(state.sampler)

    assert train(state) == list(range(8)) and calls == ["sync", "raised"]


def test_run_rejects_a_non_state() -> None:
    with pytest.raises(TypeError, match="must be an elastic State"):
        hvd.elastic.run(lambda s: s)(object())


# --- real 2-rank job: sync makes rank 1 equal to rank 0 ---------------------------------------

def init(hvd: Any) -> None:
    hvd.init()


def _job_state(hvd: Any, trained: bool) -> TorchState:
    r = hvd.rank()
    model = _model(seed=r)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if trained:
        _train(model, opt, 2 + r, seed=r)
    sampler = ElasticSampler(list(range(11)), seed=1)
    sampler.record_batch(0, 1 + r)
    if r:
        sampler.set_epoch(3)
    return TorchState(model, opt, sampler=sampler, epoch=r, notes={"rank": r})


def _assert_all_equal_rank0(hvd: Any, state: TorchState) -> None:
    mine = (state.model.state_dict(), state.optimizer.state_dict(), state.sampler.state_dict(),
            state.epoch, state.notes)
    everyone = hvd.allgather_object(mine)
    parts = ["model", "optimizer", "sampler", "epoch", "notes"]
    different = [p for p, a, b in zip(parts, everyone[0], everyone[1]) if not _sd_equal(a, b)]
    assert not different, f"rank 1 differs from rank 0 after sync in: {different}"
    assert state.epoch == 0 and state.notes == {"rank": 0}


def _sync_case(hvd: Any, _factory: Any) -> None:
    state = _job_state(hvd, trained=True)
    state.sync()
    _assert_all_equal_rank0(hvd, state)
    remaining = state.sampler.remaining_indices  # rank 0's: 2 of 11 processed in epoch 0
    assert len(remaining) == 9 and state.sampler.num_replicas == 2
    shares = hvd.allgather_object(list(state.sampler))
    assert shares == [partition(remaining, 2, 0), partition(remaining, 2, 1)]
    state.commit()


def _newcomer_case(hvd: Any, _factory: Any) -> None:
    state = _job_state(hvd, trained=hvd.rank() == 0)  # rank 1 joins with a fresh optimizer
    state.sync()
    _assert_all_equal_rank0(hvd, state)
    _train(state.model, state.optimizer, 1, seed=9)  # same data: they stay equal
    _assert_all_equal_rank0(hvd, state)


def cases() -> list[tuple[str, Any]]:
    return [("sync_trained", _sync_case), ("sync_newcomer", _newcomer_case)]


@pytest.fixture(scope="module")
def job() -> CaseJob:
    return run_cases(NP, "test_elastic_state")


@pytest.mark.integration
@pytest.mark.parametrize("case_id", [case_id for case_id, _ in cases()])
def test_two_rank_case(job: CaseJob, case_id: str) -> None:
    job.assert_ok(case_id)


@pytest.mark.integration
def test_two_rank_job_finished_cleanly(job: CaseJob) -> None:
    assert job.returncode == 0, job.stderr[-4000:]

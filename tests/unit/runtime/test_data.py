"""The elastic data order: exact coverage, uneven splits, weights, cursors, bad input."""

from __future__ import annotations

import math

import pytest

from phalanx.runtime.data import ElasticOrder, cursor_steps, evened, micro_batches, split


def test_steps_per_epoch_with_and_without_the_partial_batch() -> None:
    assert ElasticOrder(10, 4).steps_per_epoch == 3
    assert ElasticOrder(10, 4, drop_last=True).steps_per_epoch == 2
    assert ElasticOrder(8, 4).steps_per_epoch == 2


def test_an_epoch_is_a_seeded_permutation_the_same_on_every_rank() -> None:
    order = ElasticOrder(100, 8, seed=7)
    assert sorted(order.epoch_order(0)) == list(range(100))
    assert order.epoch_order(0) == ElasticOrder(100, 8, seed=7).epoch_order(0)
    assert order.epoch_order(0) != order.epoch_order(1)
    assert order.epoch_order(0) != ElasticOrder(100, 8, seed=8).epoch_order(0)


def test_uneven_split_sizes_differ_by_at_most_one_and_keep_order() -> None:
    shares = split(list(range(10)), 3)
    assert [len(s) for s in shares] == [4, 3, 3]
    assert [i for share in shares for i in share] == list(range(10))
    assert split([1, 2], 4) == [[1], [2], [], []]


def test_micro_batch_weights_make_the_global_mean() -> None:
    values = [float(v) for v in range(1, 65)]  # per-sample losses of a 64-sample batch
    total = 0.0
    for share in split(list(range(64)), 3):  # 22, 21, 21 samples
        for micro in micro_batches(share, 5, 64):
            assert len(micro.indices) <= 5
            mean = sum(values[i] for i in micro.indices) / len(micro.indices)
            total += micro.weight * mean
    assert math.isclose(total, sum(values) / 64)


def test_plan_for_one_rank_is_its_share_of_the_step() -> None:
    order = ElasticOrder(64, 16, seed=1)
    batch = order.batch(0, 2)
    plans = [order.plan(0, 2, 3, r, micro_batch_size=4) for r in range(3)]
    assert [i for p in plans for m in p for i in m.indices] == batch
    assert math.isclose(sum(m.weight for p in plans for m in p), 1.0)


def test_cursor_runs_across_epoch_boundaries() -> None:
    order = ElasticOrder(10, 4)  # 3 steps per epoch
    steps = cursor_steps(order, 0, 1)
    assert [next(steps) for _ in range(5)] == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dataset_size": 0, "global_batch": 4}, "dataset_size must be >= 1"),
    ({"dataset_size": 4, "global_batch": 0}, "global_batch must be >= 1"),
    ({"dataset_size": 4, "global_batch": 8, "drop_last": True}, "exceeds dataset_size"),
])
def test_invalid_orders_are_refused_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ElasticOrder(**kwargs)


def test_out_of_range_steps_and_sizes_are_refused() -> None:
    order = ElasticOrder(10, 4)
    with pytest.raises(IndexError, match="outside the epoch's 3 steps"):
        order.batch(0, 3)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        split([1], 0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        micro_batches([1], 0, 1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 7])
def test_weighted_micro_batches_give_the_full_batch_gradient_in_torch(world_size: int) -> None:
    """Summing each rank's weighted micro-batch gradients equals the global batch's gradient."""
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 8, generator=generator)
    targets = torch.randn(64, 2, generator=generator)
    model = torch.nn.Linear(8, 2)
    order = ElasticOrder(64, 64, seed=3)

    def grads(weighted: list[tuple[list[int], float]]) -> list:
        model.zero_grad()
        for indices, weight in weighted:
            loss = torch.nn.functional.mse_loss(model(inputs[indices]), targets[indices])
            (loss * weight).backward()  # the sum across ranks is what all-reduce(SUM) does
        return [p.grad.clone() for p in model.parameters()]

    full = grads([(order.batch(0, 0), 1.0)])
    elastic = grads([(list(m.indices), m.weight) for r in range(world_size)
                     for m in order.plan(0, 0, world_size, r, micro_batch_size=5)])
    for a, b in zip(full, elastic, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_evened_plans_give_every_rank_the_most_micro_batches_and_the_same_samples(
        world_size: int) -> None:
    """SyncBatchNorm's rounds: 49 samples on 3 ranks are shares of 17, 16 and 16, two
    micro-batches of 16 on rank 0 and one on the others, who get a filler each. Fillers
    weigh nothing and cover no sample: the step's samples and weights are unchanged."""
    order = ElasticOrder(98, 49, seed=3)
    rounds = order.rounds(0, 1, world_size, 16)
    plans = [order.plan(0, 1, world_size, rank, 16) for rank in range(world_size)]
    assert rounds == max(len(plan) for plan in plans)
    last = order.batch(0, 1)[-1]
    for plan in plans:
        even = evened(plan, rounds, last)
        assert len(even) == rounds and even[:len(plan)] == plan
        assert all(mb.weight == 0.0 and len(mb.indices) == 1 for mb in even[len(plan):])
        assert {i for mb in even for i in mb.indices} <= set(order.batch(0, 1))
    assert evened([], 2, last)[0].indices == (last,)  # a rank with no sample this step
    if world_size == 3:
        assert [len(plan) for plan in plans] == [2, 1, 1]

"""Bucketed all-reduce over two real gloo ranks (threads): sums, order, tail, kept gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from gloo_pair import on_two_ranks

from phalanx.runtime.reduce import BucketedReduce, bucket_plan


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same parameters on both ranks
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torch.manual_seed(seed)  # different data per rank
    net(torch.randn(5, 8)).pow(2).sum().backward()
    return net


def wait(work: dist.Work) -> None:
    work.wait()


def test_buckets_cover_every_parameter_once_last_first() -> None:
    params = list(model(0).parameters())
    plan = bucket_plan(params, bucket_bytes=16 * 4 * 8)
    assert sorted(i for b in plan for i in b) == list(range(len(params)))
    assert plan[0][0] == len(params) - 1 and len(plan) > 1


def test_the_sum_is_the_plain_sum_whatever_order_the_hooks_fire_in() -> None:
    expected = [a.grad + b.grad for a, b in zip(model(1).parameters(), model(2).parameters(),
                                                strict=True)]

    models = [model(1), model(2)]  # built here: threads would race on the global RNG

    def body(rank: int, pg: dist.ProcessGroup) -> tuple[list[torch.Tensor], list[float]]:
        params = list(models[rank].parameters())
        plan = bucket_plan(params, bucket_bytes=16 * 4 * 8)
        reduce = BucketedReduce(pg, params, plan, None,
                                lambda: torch.tensor([0.25 * (rank + 1), float(rank)]))
        hooks = range(len(params)) if rank == 0 else reversed(range(len(params)))
        for i in list(hooks)[:2]:  # some gradients are ready during "backward"...
            reduce.gradient_ready(i)
        tail = reduce.finish(wait)  # ...the rest at commit
        return [p.grad.clone() for p in params], tail.tolist()

    (grads0, tail0), (grads1, tail1) = on_two_ranks(body)
    assert tail0 == tail1 == [0.75, 1.0]  # the tail (metrics, flag) is summed too
    for got0, got1, want in zip(grads0, grads1, expected, strict=True):
        torch.testing.assert_close(got0, want)
        assert torch.equal(got0, got1)


def test_a_kept_gradient_is_added_to_this_ranks_share() -> None:
    models = [model(1), model(1)]

    def body(rank: int, pg: dist.ProcessGroup) -> list[torch.Tensor]:
        params = list(models[rank].parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        total = sum(p.numel() for p in params)
        kept = torch.full((total,), float(rank + 1))
        reduce = BucketedReduce(pg, params, bucket_plan(params), kept,
                                lambda: torch.zeros(1))
        assert torch.equal(reduce.local_gradient(), kept)
        reduce.finish(wait)
        return [p.grad.clone() for p in params]

    for grad in on_two_ranks(body)[0]:
        assert torch.equal(grad, torch.full_like(grad, 3.0))


Step = tuple[BucketedReduce, BucketedReduce, list[torch.Tensor], list[torch.Tensor]]


def two_steps(between: Callable[[list[torch.nn.Parameter], list[torch.Tensor]], None]
              ) -> list[Step]:
    """Two steps of the same gradients on two ranks, ``between`` giving the parameters the
    second step's gradients (the originals) after the first's sums; checks the second's
    sums. Per rank: both reduces, the gradients after the first, and the originals."""
    models = [model(1), model(2)]
    expected = [a.grad + b.grad for a, b in zip(models[0].parameters(), models[1].parameters(),
                                                strict=True)]
    originals = [[p.grad.clone() for p in m.parameters()] for m in models]

    def body(rank: int, pg: dist.ProcessGroup) -> tuple[Step, list[torch.Tensor], list[float]]:
        params = list(models[rank].parameters())
        plan = bucket_plan(params, bucket_bytes=16 * 4 * 8)
        first = BucketedReduce(pg, params, plan, None, lambda: torch.ones(1))
        first.finish(wait)
        views = [p.grad for p in params]
        between(params, originals[rank])
        second = BucketedReduce(pg, params, plan, None, lambda: torch.ones(1), first.flats)
        tail = second.finish(wait)
        return (first, second, views, originals[rank]), [p.grad.clone() for p in params], \
            tail.tolist()

    (step0, grads0, tail0), (step1, grads1, tail1) = on_two_ranks(body)
    assert tail0 == tail1 == [2.0]
    for got0, got1, want in zip(grads0, grads1, expected, strict=True):
        torch.testing.assert_close(got0, want)  # no leftover of the first sum
        assert torch.equal(got0, got1)
    return [step0, step1]


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_the_sums_come_back_as_views_of_the_buckets_which_the_next_step_reuses() -> None:
    def set_to_none(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()  # zero_grad set them to None, the backward made new ones

    for first, second, views, _ in two_steps(set_to_none):
        assert {storage(v) for v in views} == {storage(flat) for flat in first.flats}
        assert all(a is b for a, b in zip(first.flats, second.flats, strict=True))


def test_gradients_kept_across_steps_are_never_summed_in_place() -> None:
    """A script that zeroes its gradients keeps the views: the next all-reduce goes into
    new buckets, so the gradients stay this rank's own until every bucket is summed (what
    an aborted step keeps)."""
    def zeroed(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        for p, grad in zip(params, grads, strict=True):
            p.grad.zero_().add_(grad)  # zero_grad(set_to_none=False), then the backward

    for first, second, views, originals in two_steps(zeroed):
        assert all(torch.equal(v, g) for v, g in zip(views, originals, strict=True))
        assert not any(a is b for a, b in zip(first.flats, second.flats, strict=True))

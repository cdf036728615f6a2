"""Whatever the membership does step by step, every sample of an epoch is used exactly once."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime.data import ElasticOrder, MicroBatch, group_plan

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=200)


@st.composite
def runs(draw: st.DrawFn) -> tuple[ElasticOrder, list[int], int]:
    size = draw(st.integers(1, 300))
    batch = draw(st.integers(1, 64))
    drop_last = draw(st.booleans()) and batch <= size
    order = ElasticOrder(size, batch, seed=draw(st.integers(0, 10)), drop_last=drop_last)
    worlds = draw(st.lists(st.integers(1, 9), min_size=order.steps_per_epoch,
                           max_size=order.steps_per_epoch))
    return order, worlds, draw(st.integers(1, 16))


@SETTINGS
@given(runs(), st.integers(0, 3), st.booleans())
def test_every_sample_once_per_epoch_under_changing_membership(run, epoch: int,
                                                               aligned: bool) -> None:
    order, worlds, micro = run
    permutation = order.epoch_order(epoch)
    seen: Counter[int] = Counter()
    for step, world in enumerate(worlds):  # a new world size at every step
        batch = order.batch(epoch, step, permutation)
        weights = 0.0
        sizes = []
        for rank in range(world):
            plan = order.plan(epoch, step, world, rank, micro, permutation, aligned=aligned)
            sizes.append(len(plan) if aligned else sum(len(m.indices) for m in plan))
            for m in plan:
                assert 1 <= len(m.indices) <= micro
                assert math.isclose(m.weight, len(m.indices) / len(batch))
                weights += m.weight
                seen.update(m.indices)
        assert max(sizes) - min(sizes) <= 1  # as even as possible (in micro-batches if aligned)
        assert math.isclose(weights, 1.0)  # the global batch's mean, whatever the split
    expected = len(worlds) * order.global_batch if order.drop_last else order.dataset_size
    assert set(seen.values()) <= {1}  # never twice
    assert sum(seen.values()) == min(expected, order.dataset_size)  # never lost


@SETTINGS
@given(runs())
def test_what_a_step_trains_on_does_not_depend_on_the_world_size(run) -> None:
    order, worlds, micro = run
    for step, world in enumerate(worlds):
        one = [i for m in order.plan(0, step, 1, 0, micro) for i in m.indices]
        many = [i for r in range(world) for m in order.plan(0, step, world, r, micro)
                for i in m.indices]
        assert one == many == order.batch(0, step)
        aligned = [m for r in range(world)
                   for m in order.plan(0, step, world, r, micro, aligned=True)]
        assert aligned == order.plan(0, step, 1, 0, micro, aligned=True)  # the same micro-batches


def _counts(order: ElasticOrder, shares: list[list[MicroBatch]]) -> list[int]:
    """The members' kept counts summed, as the repair's all-reduce sums them."""
    rows = [order.kept_counts(0, 0, [i for m in share for i in m.indices])
            for share in shares]
    return [sum(column) for column in zip(*rows, strict=True)]


@SETTINGS
@given(runs(), st.integers(1, 9), st.data(), st.booleans())
def test_repairs_cover_the_batch_once_however_the_attempts_dealt_it(
        run, old_world: int, data, aligned: bool) -> None:
    """The attempt sat some members out (a join's copy), then each repair may itself be
    aborted by more deaths: the kept shares plus the repairs are still the batch once."""
    order, _, micro = run
    computing = data.draw(st.lists(st.integers(0, old_world - 1), unique=True,
                                   min_size=1).map(sorted))
    shares = [order.plan(0, 0, len(computing), computing.index(r), micro, aligned=aligned)
              if r in computing else [] for r in range(old_world)]
    for _ in range(data.draw(st.integers(1, 3))):  # repairs, each aborted but the last
        dead = data.draw(st.sets(st.integers(0, len(shares) - 1), max_size=len(shares) - 1))
        kept = [share for r, share in enumerate(shares) if r not in dead]
        world = len(kept) + data.draw(st.integers(0, 3))  # joiners keep nothing
        counts = _counts(order, kept)
        parts = [order.repair_plan(0, 0, counts, world, r, micro, aligned=aligned)
                 for r in range(world)]
        assert all(part is not None for part in parts)
        shares = [(kept[r] if r < len(kept) else []) + (parts[r] or []) for r in range(world)]
    used = [m for share in shares for m in share]
    assert sorted(i for m in used for i in m.indices) == sorted(order.batch(0, 0))
    assert math.isclose(sum(m.weight for m in used), 1.0)
    if aligned:  # the same micro-batches as a fault-free step: bitwise reproducible
        assert sorted(m.indices for m in used) == sorted(
            m.indices for m in order.plan(0, 0, 1, 0, micro, aligned=True))


@SETTINGS
@given(runs(), st.integers(2, 9), st.booleans())
def test_kept_shares_that_overlap_are_refused(run, world: int, aligned: bool) -> None:
    order, _, micro = run
    share = order.plan(0, 0, world, 0, micro, aligned=aligned)
    if share:  # the same share kept by two members would train its samples twice
        assert order.repair_plan(0, 0, _counts(order, [share, share]), world, 0, micro,
                                 aligned=aligned) is None
    stray = order.kept_counts(0, 0, [order.dataset_size + 1])  # not a sample of the batch
    assert order.repair_plan(0, 0, stray, world, 0, micro, aligned=aligned) is None


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60, unique=True),
       st.integers(1, 5), st.integers(1, 4), st.integers(1, 7), st.booleans())
def test_a_groups_ranks_run_alike_and_the_groups_cover_the_batch_once(
        batch: list[int], groups: int, group_size: int, micro: int, aligned: bool) -> None:
    """Every rank of a group gets as many micro-batches as its peers (they run their
    sharded model's collectives together), fillers weigh nothing, and the groups' real
    micro-batches are the batch, each sample once, weighted by its share of it."""
    plans = {(g, r): group_plan(batch, groups, g, micro, group_size, r, aligned=aligned)
             for g in range(groups) for r in range(group_size)}
    for g in range(groups):
        assert len({len(plans[g, r]) for r in range(group_size)}) == 1
    real = [mb for plan in plans.values() for mb in plan if mb.weight]
    assert Counter(i for mb in real for i in mb.indices) == Counter(batch)
    assert all(mb.weight == len(mb.indices) / len(batch) for mb in real)
    assert all(len(mb.indices) <= micro for mb in real)
    assert all(len(mb.indices) == 1 for plan in plans.values() for mb in plan if not mb.weight)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=60, unique=True),
       st.integers(1, 5), st.integers(1, 5), st.integers(1, 4), st.integers(1, 7))
def test_aligned_a_groups_micro_steps_are_the_same_whatever_the_number_of_groups(
        batch: list[int], before: int, after: int, group_size: int, micro: int) -> None:
    """What a group's ranks sum at each micro-step (one micro-batch each) is one tuple of
    the global batch's cut whatever the number of groups: a bitwise R-invariant sum."""
    def micro_steps(groups: int) -> set[tuple[tuple[int, ...], ...]]:
        plans = [[group_plan(batch, groups, g, micro, group_size, r, aligned=True)
                  for r in range(group_size)] for g in range(groups)]
        return {tuple(plan[j].indices if plan[j].weight else () for plan in ranks)
                for ranks in plans for j in range(len(ranks[0]))}
    assert micro_steps(before) == micro_steps(after)

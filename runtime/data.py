"""Elastic data order: every sample of an epoch exactly once, whatever the membership does.

The order of an epoch is a permutation of the dataset fixed by ``(seed,
epoch)`` alone. Global step ``s`` of the epoch consumes the slice
``order[s * B : (s + 1) * B]`` (``B`` = the global batch), so what a step
trains on depends on the epoch and the step, never on how many ranks there
are. A step's batch is split over the ranks of the current membership in
contiguous, as-even-as-possible shares (sizes differ by at most one when ``W``
does not divide ``B``), and each share into micro-batches of at most
``micro_batch_size``. Each micro-batch carries its weight ``len / B``: a rank
scales its micro-batch's *mean* loss by that weight and the gradients are
*summed* across ranks, which yields exactly the gradient of the mean loss over
the global batch, for any world size and any uneven split. So the global
batch and the learning rate stay the same when ranks come and go.

The data cursor is ``(epoch, step)``: a rank that joins, or resumes after a
membership change, continues at any world size from the cursor alone. The
last, partial batch of an epoch is kept (``drop_last=False``) or dropped.
Pure: no torch, no I/O; the permutation comes from a seeded
:class:`random.Random`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Sample indices to run forward/backward on, and the weight of their mean loss."""

    indices: tuple[int, ...]
    weight: float


@dataclasses.dataclass(frozen=True)
class ElasticOrder:
    """The sample order of a dataset for elastic data-parallel training.

    Args:
        dataset_size: number of samples (map-style dataset indices 0..n-1).
        global_batch: samples per optimizer step, across all ranks.
        seed: fixes every epoch's permutation.
        drop_last: drop an epoch's last, partial batch.
    """

    dataset_size: int
    global_batch: int
    seed: int = 0
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.dataset_size < 1:
            raise ValueError(f"dataset_size must be >= 1, got {self.dataset_size}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.drop_last and self.global_batch > self.dataset_size:
            raise ValueError(f"global_batch {self.global_batch} exceeds dataset_size "
                             f"{self.dataset_size}: with drop_last no step would run")

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_size, self.global_batch)
        return full if self.drop_last or not rest else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of the dataset for ``epoch`` (the same on every rank)."""
        return list(_permutation(self.seed, epoch, self.dataset_size))

    def batch(self, epoch: int, step: int, order: Sequence[int] | None = None) -> list[int]:
        """Global step ``step``'s samples (pass ``order`` to reuse an epoch's permutation).

        Raises:
            IndexError: ``step`` is not a step of the epoch.
        """
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} is outside the epoch's {self.steps_per_epoch} steps")
        order = _permutation(self.seed, epoch, self.dataset_size) if order is None else order
        return list(order[step * self.global_batch:(step + 1) * self.global_batch])

    def plan(self, epoch: int, step: int, world_size: int, rank: int,
             micro_batch_size: int, order: Sequence[int] | None = None, *,
             aligned: bool = False, group_size: int = 1,
             group_rank: int = 0) -> list[MicroBatch]:
        """This rank's micro-batches of global step ``step`` in a ``world_size`` membership.

        ``aligned``: cut the *global* batch into micro-batches first and deal whole
        micro-batches to the ranks, so every micro-batch is the same whatever the world
        size (what a bitwise world-size-invariant reduction needs); shares are then even
        to a micro-batch rather than to a sample.

        ``group_size``: each member is a group of that many ranks (a model sharded inside
        it), of which this is ``group_rank``: see :func:`group_plan`.
        """
        batch = self.batch(epoch, step, order)
        if group_size > 1:
            return group_plan(batch, world_size, rank, micro_batch_size, group_size,
                              group_rank, aligned=aligned)
        if aligned:
            return split(micro_batches(batch, micro_batch_size, len(batch)), world_size)[rank]
        share = split(batch, world_size)[rank]
        return micro_batches(share, micro_batch_size, len(batch))

    def rounds(self, epoch: int, step: int, world_size: int, micro_batch_size: int) -> int:
        """The most micro-batches :meth:`plan` (not aligned, one rank a member) gives any
        rank of a ``world_size`` membership in step ``step``: the largest share's."""
        largest = -(-len(self.batch(epoch, step)) // world_size)
        return -(-largest // micro_batch_size)

    def kept_counts(self, epoch: int, step: int, indices: Iterable[int]) -> list[int]:
        """How often each sample of step ``step``'s batch is among ``indices`` (a kept
        gradient's samples), in batch order, then how many of ``indices`` are not in
        the batch: the layout the members sum for :meth:`repair_plan`."""
        batch = self.batch(epoch, step)
        position = {index: i for i, index in enumerate(batch)}
        counts = [0] * (len(batch) + 1)
        for index in indices:
            counts[position.get(index, len(batch))] += 1
        return counts

    def repair_plan(self, epoch: int, step: int, kept: Sequence[int], world_size: int,
                    rank: int, micro_batch_size: int, *,
                    aligned: bool = False) -> list[MicroBatch] | None:
        """This rank's part of re-running a step whose all-reduce was aborted.

        ``kept`` is the survivors' :meth:`kept_counts` summed: the samples their kept
        gradients cover. Only the samples nobody kept are computed again, dealt over
        the ``world_size`` ranks of the new membership as :meth:`plan` deals a batch
        (``aligned``: whole micro-batches of the global batch's cut). Kept shares plus
        these parts are the step's batch, each sample once.

        Returns None if the kept gradients cannot be completed that way: a sample kept
        twice, one not in the batch, or (``aligned``) a micro-batch kept in part. The
        step must then run whole, every kept gradient dropped.
        """
        order = self.epoch_order(epoch)
        batch = self.batch(epoch, step, order)
        if len(kept) != len(batch) + 1 or kept[-1] or any(count > 1 for count in kept):
            return None
        if aligned:
            cut = micro_batches(batch, micro_batch_size, len(batch))
            covered = dict(zip(batch, kept, strict=False))
            states = [{covered[i] for i in mb.indices} for mb in cut]
            if any(len(state) > 1 for state in states):
                return None
            lost = [mb for mb, state in zip(cut, states, strict=True) if state == {0}]
            return split(lost, world_size)[rank]
        missing = [index for index, count in zip(batch, kept, strict=False) if not count]
        share = split(missing, world_size)[rank]
        return micro_batches(share, micro_batch_size, len(batch))


@functools.lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, size: int) -> tuple[int, ...]:
    """Epoch ``epoch``'s permutation, kept: every step's plan needs it, and shuffling it
    anew took 26 ms per plan for the GPT example's 17,428 windows (measured alone on the
    loaded 2-core VM; 2-3 % of the example's step on 4 ranks), 0.4 ms with the cache."""
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)


def split(batch: Sequence[T], world_size: int) -> list[list[T]]:
    """Contiguous shares of ``batch`` for ranks 0..world_size-1; sizes differ by at most 1.

    Raises:
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(len(batch), world_size)
    shares, start = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        shares.append(list(batch[start:start + size]))
        start += size
    return shares


def micro_batches(share: Sequence[int], micro_batch_size: int,
                  batch_size: int) -> list[MicroBatch]:
    """``share`` in chunks of at most ``micro_batch_size``, each weighted ``len / batch_size``.

    A rank whose share is empty (more ranks than samples) gets no micro-batch and
    contributes a zero gradient.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [MicroBatch(tuple(share[i:i + micro_batch_size]),
                       len(share[i:i + micro_batch_size]) / batch_size)
            for i in range(0, len(share), micro_batch_size)]


def evened(plan: Sequence[MicroBatch], rounds: int, sample: int) -> list[MicroBatch]:
    """``plan`` with fillers up to ``rounds`` micro-batches, so that every member runs as
    many forwards as the others (their ``SyncBatchNorm`` collectives meet): each a sample
    of the plan's, or ``sample`` where the plan has none (the step's last: never its
    first, whose holder's buffers the step keeps, where the step has two or more)."""
    beside = plan[0] if plan else MicroBatch((sample,), 0.0)
    return [*plan, *[_filler(beside)] * (rounds - len(plan))]


def group_plan(batch: Sequence[int], groups: int, group: int, micro_batch_size: int,
               group_size: int, group_rank: int, *, aligned: bool = False) -> list[MicroBatch]:
    """Rank ``group_rank`` of member ``group``'s micro-batches of ``batch``, every member
    being a group of ``group_size`` ranks that shard one model.

    The ranks of a group run their forward and backward passes together (the sharded
    model's collectives), so each gets the same number of micro-batches: where one has
    none left, a *filler* (a sample of its group's share, weight 0: a zero gradient,
    counted as no sample) keeps it in step. ``aligned``: the global batch is cut into
    micro-batches and those into tuples of ``group_size``, dealt whole to the groups;
    rank ``r`` takes micro-batch ``r`` of each of its group's tuples, so what a group's
    collectives sum at each micro-step is the same whatever the number of groups.
    Otherwise the group's share is split over its ranks, and each part into as many
    micro-batches of at most ``micro_batch_size`` as the largest part needs.
    """
    total = len(batch)
    if aligned:
        cut = micro_batches(batch, micro_batch_size, total)
        tuples = [cut[i:i + group_size] for i in range(0, len(cut), group_size)]
        return [found[group_rank] if group_rank < len(found) else _filler(found[0])
                for found in split(tuples, groups)[group]]
    share = split(batch, groups)[group]
    if not share:
        return []
    parts = split(share, group_size)
    passes = -(-len(parts[0]) // micro_batch_size)  # parts[0] is the largest
    return [MicroBatch(tuple(piece), len(piece) / total) if piece
            else _filler(MicroBatch((share[0],), 0.0))
            for piece in split(parts[group_rank], passes)]


def _filler(beside: MicroBatch) -> MicroBatch:
    """A micro-batch that keeps a rank in step with its peers (a group's, or the members'
    ``SyncBatchNorm`` rounds) and trains on nothing: one sample, weight 0."""
    return MicroBatch(beside.indices[:1], 0.0)


def cursor_steps(order: ElasticOrder, epoch: int, step: int) -> Iterator[tuple[int, int]]:
    """``(epoch, step)`` from a cursor onwards, across epoch boundaries (endless)."""
    while True:
        while step < order.steps_per_epoch:
            yield epoch, step
            step += 1
        epoch, step = epoch + 1, 0

"""SyncBatchNorm under the session (runtime/sync_batchnorm.py), on two real gloo ranks: a
round of the members' micro-batches trains as BatchNorm over their union, a filler counts
nothing, the group is the membership's at each call, an abort poisons the step instead of
raising or hanging; alone it is BatchNorm; deterministic mode refuses it by name."""

from __future__ import annotations

import copy
import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from gloo_pair import on_two_ranks
from torch.nn import functional as F

from phalanx.runtime.elastic import ElasticSession
from phalanx.runtime.group import Aborted, GroupWork, Waits
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.sync_batchnorm import SessionSyncBatchNorm, SyncRounds, adopt

pytestmark = pytest.mark.usefixtures("no_default_group")

BATCH = 8


def _made() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2))


_MODEL = _made()


def conv_model() -> torch.nn.Module:
    """A fresh copy of one model (copied, not seeded: the ranks are threads, and one
    generator is all of theirs)."""
    return copy.deepcopy(_MODEL)


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=generator), torch.randn(n, 2, generator=generator)


class Members:
    """A membership of one gloo group: waits as the session's do (abortably, on an inbox
    a dying peer wakes) and gives the group up as it does."""

    def __init__(self, pg: dist.ProcessGroup | None, dead: threading.Event | None = None,
                 inbox: Inbox | None = None) -> None:
        self.pg = pg
        self.dead = dead or threading.Event()
        self.waits = Waits(inbox or Inbox("r0-0"), lambda: None)
        self.given_up: list[tuple[int, str]] = []

    def wait(self, work: GroupWork) -> None:
        self.waits.work(work, self.dead.is_set)

    def give_up(self, step: int, why: Aborted, kept: object = None) -> None:
        self.given_up.append((step, str(why)))
        self.pg = None


def synced(members: Members) -> tuple[torch.nn.Module, SyncRounds]:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(conv_model())
    return model, SyncRounds(members, adopt(model, deterministic=False, grouped=False))


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


@pytest.mark.parametrize("hooks_weight", [False, True])
def test_a_round_trains_as_batchnorm_over_the_members_micro_batches(
        hooks_weight: bool) -> None:
    """Shares of 5 and 3 images, each mean loss weighted by its share: the summed gradients
    and the statistics are BatchNorm's over the 8 together, whether the loss is weighted
    (step.backward) or the session's hooks weight the gradients (a plain loss.backward())."""
    x, y = images(BATCH, 1)
    reference = conv_model()
    F.mse_loss(reference(x), y).backward()
    shares = [(x[:5], y[:5]), (x[5:], y[5:])]

    def member(rank: int, pg: dist.ProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor,
                                                          torch.Tensor]:
        model, rounds = synced(Members(pg))
        rounds.hooks_weight = hooks_weight
        rounds.start(0)
        share_x, share_y = shares[rank]
        weight = len(share_x) / BATCH
        rounds.handing(weight)
        loss = F.mse_loss(model(share_x), share_y)
        (loss if hooks_weight else loss * weight).backward()
        assert not rounds.end()
        scale = weight if hooks_weight else 1.0  # what the hooks would do
        norm = model[1]
        return [g * scale for g in grads(model)], norm.running_mean, norm.running_var

    got = on_two_ranks(member)
    for n, want in enumerate(grads(reference)):
        torch.testing.assert_close(got[0][0][n] + got[1][0][n], want, atol=1e-6, rtol=1e-5)
    for rank in range(2):
        torch.testing.assert_close(got[rank][1], reference[1].running_mean, atol=1e-7, rtol=0)
        torch.testing.assert_close(got[rank][2], reference[1].running_var, atol=1e-7, rtol=0)


def test_a_filler_counts_no_sample_and_gets_no_gradient() -> None:
    """Rank 0 runs micro-batches of 3 and 2 images, rank 1 one of 3 and a filler: the
    second round is BatchNorm over rank 0's 2 alone; the filler's gradient is zero."""
    x, y = images(BATCH, 2)
    rounds_of = [[(x[0:3], y[0:3], 3 / BATCH), (x[3:5], y[3:5], 2 / BATCH)],
                 [(x[5:8], y[5:8], 3 / BATCH), (x[5:6], y[5:6], 0.0)]]
    reference = conv_model()
    for together in ([0, 1, 2, 5, 6, 7], [3, 4]):  # what each round normalises over
        (F.mse_loss(reference(x[together]), y[together]) * len(together) / BATCH).backward()

    def member(rank: int, pg: dist.ProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor,
                                                          list[torch.Tensor]]:
        model, rounds = synced(Members(pg))
        rounds.start(0)
        before: list[torch.Tensor] = []
        for share_x, share_y, weight in rounds_of[rank]:
            rounds.handing(weight)
            before = grads(model)
            (F.mse_loss(model(share_x), share_y) * weight).backward()
        assert not rounds.end()
        added = [after - was for after, was in zip(grads(model), before, strict=True)]
        return grads(model), model[1].running_mean, added

    got = on_two_ranks(member)
    for n, want in enumerate(grads(reference)):
        torch.testing.assert_close(got[0][0][n] + got[1][0][n], want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1][1], reference[1].running_mean, atol=1e-7, rtol=0)
    assert all(bool((g == 0).all()) for g in got[1][2])  # the filler's round added nothing


def test_the_rounds_use_the_memberships_group_at_each_call() -> None:
    """Without a group (a generation of one, or given up) a forward is BatchNorm over its
    own micro-batch; with one, over the members': the group is read at every forward,
    never kept from an earlier one."""
    x, _ = images(4, 3)

    def member(rank: int, pg: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        members = Members(None)
        model, rounds = synced(members)
        rounds.start(0)
        rounds.handing(0.5)
        alone = model(x[2 * rank:2 * rank + 2])
        members.pg = pg  # the next generation's group
        together = model(x[2 * rank:2 * rank + 2])
        rounds.end()
        return alone, together

    got = on_two_ranks(member)
    plain = conv_model()
    for rank in range(2):
        torch.testing.assert_close(got[rank][0], plain(x[2 * rank:2 * rank + 2]))
    torch.testing.assert_close(torch.cat([got[0][1], got[1][1]]), plain(x))


def test_a_member_dying_in_a_rounds_all_reduce_poisons_the_step_and_gives_it_up() -> None:
    """Rank 1 dies before its forward: rank 0, waiting in the statistics' all-reduce, is
    woken, gives the generation up, finishes the step's forward and backward alone (no
    exception through the script's loop, no hang), and the step reports itself aborted."""
    dead, given_up, inbox = threading.Event(), threading.Event(), Inbox("r0-0")
    x, y = images(4, 4)

    def member(rank: int, pg: dist.ProcessGroup) -> tuple[bool, list[tuple[int, str]]]:
        if rank == 1:
            dead.set()  # the fault, as the bus brings it: it wakes the peer's wait
            inbox.wake.set()
            # Then the abandoned all-reduce is completed, so that no gloo work outlives
            # the test (a dead rank's peers leave theirs to gloo's timeout).
            assert given_up.wait(10)
            pg.allreduce([torch.zeros(2 * 4 + 1, dtype=torch.float64)]).wait()
            return False, []
        members = Members(pg, dead, inbox)
        model, rounds = synced(members)
        rounds.start(7)
        rounds.handing(0.5)
        try:
            loss = F.mse_loss(model(x), y)
        finally:
            given_up.set()
        loss.backward()
        assert torch.isfinite(loss)
        assert members.pg is None and not rounds.live()
        return rounds.end(), members.given_up

    (aborted, gave_up), _ = on_two_ranks(member)
    assert aborted
    assert gave_up == [(7, "a member failed")]


def test_alone_a_sync_batchnorm_trains_as_batchnorm() -> None:
    """A session alone: each micro-batch normalised by itself, as torch's SyncBatchNorm is
    in a world of one, and its statistics under the buffers rule."""
    data = list(zip(*images(16, 5), strict=True))
    models = [conv_model(), torch.nn.SyncBatchNorm.convert_sync_batchnorm(conv_model())]
    for model in models:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session = ElasticSession(model, optimizer, data, global_batch=BATCH,
                                 micro_batch_size=4)
        for step in session.steps(2):
            for x, y in step:
                step.backward(F.mse_loss(model(x), y))
            assert step.commit()
        session.close()
    assert isinstance(models[1][1], SessionSyncBatchNorm)
    for (name, want), got in zip(models[0].state_dict().items(),
                                 models[1].state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_deterministic_mode_refuses_a_sync_batchnorm_naming_why_and_the_alternative() -> None:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(conv_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SyncBatchNorm \(1\) in deterministic mode: .*"
                                         r"which run together follows the membership.*"
                                         r"bitwise.*Use BatchNorm.*Buffers alike"):
        ElasticSession(model, optimizer, list(zip(*images(16, 6), strict=True)),
                       global_batch=BATCH, deterministic=True)
    assert not isinstance(model[1], SessionSyncBatchNorm)  # left as it was


def test_a_sync_batchnorm_with_its_own_group_is_refused_by_name() -> None:
    model = conv_model()
    own = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    model[1] = torch.nn.SyncBatchNorm(4, process_group=own)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SyncBatchNorm \(1\) with a process_group"):
        ElasticSession(model, optimizer, list(zip(*images(16, 6), strict=True)),
                       global_batch=BATCH)

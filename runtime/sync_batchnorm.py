"""``SyncBatchNorm`` under the session: statistics over the micro-batches the members run
at once, as under DDP, over each generation's abortable group.

torch's ``SyncBatchNorm`` all-gathers each training forward's statistics and
all-reduces each backward's over a process group (the default one unless given),
blocking, and only for CUDA tensors. Under the session the default group only says
who a rank is (:mod:`.default_group`), the membership changes, and a collective
blocked on a dead peer would hang the step. So the session takes each
``SyncBatchNorm`` of its model over (:func:`adopt`: its class becomes
:class:`SessionSyncBatchNorm`, still a ``SyncBatchNorm``), and :class:`SyncRounds`
runs its collectives:

* **The generation's group.** Each training forward in a step all-reduces, in
  float64, every channel's sample count, sum and sum of squares over the members'
  current group (``Membership.pg``, never a stale one), waited for as the step's
  gradient all-reduce is; its backward all-reduces the sums of the gradient and of
  the gradient times the centred input. The math is torch's (the mean and biased
  variance over every member's samples normalise, the unbiased variance moves the
  running statistics), on any device: gloo on the CPU too.
* **Rounds.** A forward's all-reduce meets the forwards the other members run at
  the same point, so every member runs as many a step. A step's shares differ by
  at most a sample, which can be a micro-batch more on some members: the others
  are handed *fillers* (one sample of their share, weight 0) up to the step's most
  (:meth:`.data.ElasticOrder.rounds`). A filler counts no sample in the statistics,
  adds nothing to the backward's sums and gets no gradient; it is normalised by the
  round's statistics, and its loss weighs nothing.
* **Weights.** A member's micro-batch loss is weighted by its share of the global
  batch, and shares differ, so the backward's sums are of the weighted gradient:
  where the script back-propagates the plain loss and the session's hooks weight
  the parameters' gradients (``loss.backward()`` in the DDP-shaped loop,
  :mod:`.epochs`), the sums are weighted here and the gradient passed on unweighted.
* **Aborts.** A member that dies while its peers are in one of these all-reduces
  aborts the wait as the step's would abort: the generation is given up and the
  step *poisoned*. Its remaining forwards and backwards normalise alone (their
  results are dropped), the step's reduce returns False without a collective, and
  the step runs again whole in the next generation: no gradient is kept for a
  repair (its statistics were the old membership's rounds).
* **Alone**, in a generation of one, outside a step and in evaluation it is
  ``BatchNorm``, as torch's is in a world of one.

Deterministic mode refuses it (:func:`adopt`): a step's statistics would be over the
micro-batches that run together, which follows the membership (alone, one at a
time), so the model could not be bitwise the same at any membership. So does a
replica group (its ranks' rounds are the sharded model's), and a ``SyncBatchNorm``
given its own ``process_group`` (the session's group is the generation's).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from phalanx.runtime.group import Aborted, Group, GroupWork


class Members(Protocol):
    """What the rounds use of the session's membership (:class:`.membership.Membership`)."""

    pg: Group | None

    def wait(self, work: GroupWork) -> None: ...

    def give_up(self, step: int, why: Aborted, kept: Any = None) -> None: ...


#: Each adopted norm's rounds (weakly: a copy of the model, an EMA's, has none).
_rounds: weakref.WeakKeyDictionary[torch.nn.Module, SyncRounds] = \
    weakref.WeakKeyDictionary()


class SyncRounds:
    """The statistics' collectives of one session's ``SyncBatchNorm`` layers, step by step.

    Args:
        members: the session's membership: its group, waits and giving up.
        norms: the adopted layers (:func:`adopt`).
    """

    def __init__(self, members: Members, norms: Sequence[torch.nn.Module]) -> None:
        self.members = members
        for norm in norms:
            _rounds[norm] = self
        self._index: int | None = None  # the step in progress (None: between steps)
        self._aborted = False  # a statistics all-reduce of this step was aborted
        #: The handed micro-batch's weight (0: a filler).
        self.weight = 1.0
        #: The script back-propagates the plain loss and the session's hooks weight the
        #: parameters' gradients (:mod:`.epochs`): the backward's sums are weighted here.
        self.hooks_weight = False

    def start(self, index: int) -> None:
        """Step ``index`` starts (or runs again): its forwards synchronise."""
        self._index, self._aborted, self.weight = index, False, 1.0

    def handing(self, weight: float) -> None:
        """The step's next micro-batch is handed to the script (``weight`` 0: a filler)."""
        self.weight = weight

    def end(self) -> bool:
        """The step's forwards and backwards are over: whether one of its all-reduces was
        aborted (the generation is given up already, the step must not commit)."""
        aborted = self._aborted
        self._index, self._aborted = None, False
        return aborted

    def live(self) -> bool:
        """Whether a forward now synchronises: in a step not aborted, with a group."""
        return self._index is not None and not self._aborted and self.members.pg is not None

    def reduce(self, values: torch.Tensor) -> torch.Tensor | None:
        """``values`` summed over the members, in place; None where nothing is summed (not
        :meth:`live`, or the all-reduce was aborted: then the step is poisoned)."""
        pg = self.members.pg
        if not self.live() or pg is None:
            return None
        try:
            self.members.wait(pg.allreduce([values]))
        except Aborted as exc:
            assert self._index is not None
            self._aborted = True
            self.members.give_up(self._index, exc)
            return None
        return values


class SessionSyncBatchNorm(torch.nn.SyncBatchNorm):
    """A ``SyncBatchNorm`` whose training forwards in a step synchronise over the session's
    group (:class:`SyncRounds`); elsewhere it is ``BatchNorm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        rounds = _rounds.get(self)
        if not self.training or rounds is None or not rounds.live():
            batch_statistics = self.training or (self.running_mean is None
                                                 and self.running_var is None)
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                batch_statistics, factor, self.eps)
        out: torch.Tensor = _Statistics.apply(  # type: ignore[no-untyped-call]
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, rounds)
        return out


def _working(input: torch.Tensor) -> torch.dtype:
    """The dtype the elementwise work is done in: the input's, at least float32 (the
    sums that cross the members are float64)."""
    return torch.promote_types(input.dtype, torch.float32)


def _channels(input: torch.Tensor) -> tuple[list[int], list[int]]:
    """The dimensions a channel's statistics sum over, and a channel vector's shape that
    broadcasts against ``input``."""
    return [0, *range(2, input.dim())], [1, input.size(1), *[1] * (input.dim() - 2)]


class _Statistics(torch.autograd.Function):
    """Batch normalisation over the samples every member runs in this round."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, factor: float,
                rounds: SyncRounds) -> torch.Tensor:
        dims, _ = _channels(input)
        work = _working(input)
        x = input.detach().to(work)
        count = input.numel() // input.size(1)
        local = torch.cat([x.sum(dims, dtype=torch.float64),
                           (x * x).sum(dims, dtype=torch.float64),
                           torch.full((1,), float(count), dtype=torch.float64,
                                      device=input.device)])
        filler = rounds.weight == 0.0
        summed = rounds.reduce(torch.zeros_like(local) if filler else local.clone())
        if summed is None:  # alone, or the step is poisoned (its results are dropped)
            summed = local
        channels = input.size(1)
        total = float(summed[-1])
        mean = summed[:channels] / total
        var = (summed[channels:2 * channels] / total - mean * mean).clamp_min(0.0)
        if running_mean is not None:
            running_mean.mul_(1.0 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        if running_var is not None:
            unbiased = var * (total / (total - 1.0)) if total > 1.0 else var
            running_var.mul_(1.0 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + eps)
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.filler, ctx.rounds = total, filler, rounds
        ctx.scale = rounds.weight  # the backward's sums are of gradients weighted by it
        # The elementwise part is BatchNorm's with the members' statistics: its own kernel.
        normed = F.batch_norm(x, mean.to(work), var.to(work), weight, bias, False, 0.0, eps)
        return normed.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[
            torch.Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        rounds: SyncRounds = ctx.rounds
        dims, shape = _channels(input)
        work = _working(input)
        dy = grad_output.to(work)
        centred = input.to(work) - mean.to(work).view(shape)
        sum_dy = dy.sum(dims, dtype=torch.float64)
        sum_dy_xmu = (dy * centred).sum(dims, dtype=torch.float64)
        # The hooks weight the parameters' gradients: this member's part of the sums is
        # weighted here, and what flows on is the unweighted gradient.
        scale = ctx.scale if rounds.hooks_weight else 1.0
        grad_input = None
        if ctx.needs_input_grad[0]:  # the same on every member: the same model
            local = torch.cat([sum_dy, sum_dy_xmu])
            shared = torch.zeros_like(local) if ctx.filler else local * scale
            summed = rounds.reduce(shared)
            if summed is None:
                summed = local * scale
            if ctx.filler or scale == 0.0:
                grad_input = torch.zeros_like(input)  # in no statistic, no loss
            else:
                channels = input.size(1)
                mean_dy = (summed[:channels] / (ctx.total * scale)).to(work).view(shape)
                mean_dy_xmu = (summed[channels:] / (ctx.total * scale)).to(work).view(shape)
                gain = invstd if weight is None else invstd * weight.to(torch.float64)
                grad_input = ((dy - mean_dy - centred * (invstd * invstd).to(work).view(shape)
                               * mean_dy_xmu) * gain.to(work).view(shape)).to(input.dtype)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight) if ctx.filler \
                else (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = torch.zeros_like(sum_dy) if ctx.filler else sum_dy
            grad_bias = grad_bias.to(input.dtype if weight is None else weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def adopt(model: torch.nn.Module, *, deterministic: bool,
          grouped: bool) -> list[SessionSyncBatchNorm]:
    """Take ``model``'s ``SyncBatchNorm`` layers over (see the module docstring); the
    session's :class:`SyncRounds` then runs their collectives.

    Raises:
        ValueError: a ``SyncBatchNorm`` in deterministic mode, in a replica group, or with
            a ``process_group`` of its own; each error names the reason and the fix.
    """
    norms = [(name or "model", module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.SyncBatchNorm)]
    if not norms:
        return []
    name = norms[0][0]
    if deterministic:
        raise ValueError(
            f"SyncBatchNorm ({name}) in deterministic mode: it normalises over the "
            "micro-batches the members run at once, and which run together follows the "
            "membership (alone, one at a time), so the model could not be bitwise the same "
            "at any membership. Use BatchNorm (drop convert_sync_batchnorm): its "
            "statistics are each micro-batch's at any membership, and the step's buffers "
            "follow the session's rule (docs/runtime.md, Buffers alike); a larger "
            "micro_batch_size gives it more samples. Or train without deterministic mode")
    if grouped:
        raise ValueError(f"SyncBatchNorm ({name}) in a replica group (ranks_per_replica > "
                         "1): not supported; use BatchNorm")
    for name, module in norms:
        if module.process_group is not None:
            raise ValueError(
                f"SyncBatchNorm ({name}) with a process_group of its own: under a phalanx "
                "session its statistics are over each generation's members (drop the "
                "process_group of convert_sync_batchnorm)")
    adopted = []
    for _, module in norms:
        module.__class__ = SessionSyncBatchNorm
        assert isinstance(module, SessionSyncBatchNorm)
        adopted.append(module)
    return adopted

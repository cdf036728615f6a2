"""The model's buffers (BatchNorm's running statistics) kept alike on every rank.

DDP broadcasts rank 0's buffers before each forward (``broadcast_buffers``,
its default), so its ranks evaluate and save the same statistics. The session
never lets DDP communicate, so it takes that rule's place, in a form that does
not depend on the world size: **a step's buffers are those the forward of the
micro-batch holding the step's first sample leaves**, starting from the step's
buffers before it. Every training forward of the step has its buffer updates
undone (within a step every member holds the step's buffers, so a state copied
out of an aborted step holds them as committed); the member that ran that
forward keeps what it left aside and adds it to the step's all-reduce (the
others add zeros), so once the step is reduced every member holds that one
copy. Snapshots and durable checkpoints then save one
rank's consistent buffers, never a mix, and the script run alone (which runs
every micro-batch) ends with the same buffers as any membership: in
deterministic mode that micro-batch is the same at any world size, so the
buffers are bitwise the same too.

Without gradient accumulation that is DDP's rule exactly (rank 0 holds the
step's first sample). With it, DDP's rank 0 would update the statistics on each
of its micro-batches, a number that depends on the world size; here it is
always one a step. A script that asks DDP for ``broadcast_buffers=False`` keeps
per-rank buffers (and is told that its snapshots hold one rank's share of
them). Only the persistent buffers (those in the ``state_dict``) are carried;
forwards in eval mode, without gradients or outside a step are left alone.

``SyncBatchNorm`` is refused at its first forward that would synchronise
(:func:`refuse_sync_batchnorm`), naming the fix. It normalises each forward
over the batches every rank runs at that moment, and under the session which
micro-batches run together follows the membership: the step's micro-batches
are the same at any world size, but dealt anew over its ranks (alone, one
runs at a time; on 4 ranks, four; on 3, three, then two). The model would
then depend on the membership, which the session exists to hide, and the
script alone (the reference) could never train what any larger membership
does. Its all-gather would also go to the default group, whose collectives
the session refuses (it cannot be aborted when a peer dies). Statistics over
a fixed set of micro-batches, whatever the world size, would need those
micro-batches' forwards to meet in one collective, which one rank running
them one after another cannot do. ``BatchNorm`` normalises over each
micro-batch at any membership, alone included; a larger ``micro_batch_size``
gives it more samples.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("phalanx.runtime")


class StepBuffers:
    """The buffers rule over ``model``'s persistent buffers (none: inactive).

    Args:
        model: the module the session trains (its forward hooks do the undoing).
        alike: False: the script asked DDP for ``broadcast_buffers=False``; each rank
            keeps its own.
    """

    def __init__(self, model: torch.nn.Module, alike: bool = True) -> None:
        persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
        self.buffers = [b for b in model.buffers() if id(b) in persistent]
        if self.buffers and not alike:
            log.warning("broadcast_buffers=False: each rank keeps its own buffers, and a "
                        "snapshot holds a mix of them (each rank saves its share of the "
                        "state)")
            self.buffers = []
        self.numel = sum(b.numel() for b in self.buffers)
        self._index: int | None = None  # the step in progress (None: between steps)
        self._first: int | None = None  # this rank's micro-batch with the step's first sample
        self._current: int | None = None  # the micro-batch handed out, until its forward
        self._before: list[torch.Tensor] | None = None  # the buffers before this forward
        #: ``(step, buffers)`` after the forward of the step's first sample, on its holder.
        self._designated: tuple[int, list[torch.Tensor]] | None = None
        if self.buffers:
            model.register_forward_pre_hook(self._pre_forward)
            model.register_forward_hook(self._post_forward)

    def start(self, index: int, first: int | None, kept_first: bool) -> None:
        """Step ``index`` starts (or runs again): this rank's micro-batch number ``first``
        (None: none) holds the step's first sample; ``kept_first``: a gradient kept from an
        aborted try of this step covers that sample already."""
        if not kept_first or (self._designated is not None and self._designated[0] != index):
            self._designated = None
        self._index, self._first, self._current = index, first, None

    def handing(self, micro_batch: int) -> None:
        """The step's micro-batch number ``micro_batch`` is handed to the script: the next
        training forward is its."""
        self._current = micro_batch

    def end(self) -> None:
        """Between steps: forwards change the buffers as they will."""
        self._index, self._before = None, None

    def _pre_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._index is None or not module.training or not torch.is_grad_enabled():
            return
        self._before = [b.detach().clone() for b in self.buffers]

    def _post_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        current, self._current = self._current, None  # a second forward of it is undone
        if current is not None and current == self._first and self._index is not None:
            self._designated = (self._index, [b.detach().clone() for b in self.buffers])
        # Every forward's update is undone, that one's too (it is kept aside): within a
        # step the buffers stay the step's, so a state copied out of an aborted step (to a
        # joiner, or to a try run whole again) holds them as committed. Through .data: the
        # forward's graph holds the buffers (BatchNorm's backward takes them, but reads
        # them only in eval mode), and an in-place write it can see would fail it.
        for buffer, value in zip(self.buffers, before, strict=True):
            buffer.data.copy_(value)

    def tail(self) -> torch.Tensor:
        """This rank's part of the step's all-reduce: the designated buffers (float64,
        flat) and a 1 where it holds them; zeros elsewhere."""
        out = torch.zeros(self.numel + 1, dtype=torch.float64) if self.buffers \
            else torch.zeros(0, dtype=torch.float64)
        if self.buffers and self._designated is not None and self._designated[0] == self._index:
            out[:-1] = torch.cat([b.reshape(-1).to("cpu", torch.float64)
                                  for b in self._designated[1]])
            out[-1] = 1.0
        return out

    def alone(self) -> None:
        """No all-reduce (a world of one): this rank ran the step's first sample; its
        buffers become what that forward left."""
        if self._designated is not None and self._designated[0] == self._index:
            for buffer, value in zip(self.buffers, self._designated[1], strict=True):
                buffer.data.copy_(value)

    def settle(self, summed: torch.Tensor) -> None:
        """The step's buffers from the reduced ``tail``s: every member's become the one
        copy (left as they were before the step if not exactly one member held it)."""
        if not self.buffers:
            return
        holders = float(summed[-1])
        if holders != 1.0:
            log.error("step %s: %s members held the buffers of its first sample; the "
                      "buffers stay as they were before it", self._index, holders)
            return
        offset = 0
        for buffer in self.buffers:
            n = buffer.numel()
            buffer.data.copy_(summed[offset:offset + n].view_as(buffer))
            offset += n


def refuse_sync_batchnorm(model: torch.nn.Module) -> None:
    """Make each ``SyncBatchNorm`` of ``model`` refuse its forwards that would synchronise
    (in training mode), naming the fix (see the module docstring); evaluation is left
    alone."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.SyncBatchNorm):
            module.register_forward_pre_hook(functools.partial(_refuse_sync, name or "model"))


def _refuse_sync(name: str, module: torch.nn.Module, args: object) -> None:
    if module.training:
        raise RuntimeError(
            f"SyncBatchNorm ({name}) under a phalanx session: it normalises over the "
            "micro-batches every rank runs at once, and which run together changes with the "
            "membership (alone, one at a time), so the model would depend on it, and its "
            "all-gather goes to the default group, whose collectives the session refuses. "
            "Use BatchNorm (drop convert_sync_batchnorm): it normalises over each "
            "micro-batch at any membership, and a larger micro_batch_size gives it more "
            "samples (docs/runtime.md, What else a DDP script carries over)")

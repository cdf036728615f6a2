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
of its micro-batches, a number that depends on the world size. Here they move
once a step; or, in deterministic mode, where a step's cut into micro-batches
is the same at any world size, BatchNorm's statistics move once per
micro-batch of the cut, in its order, as the script alone moves them
(:class:`MicroBatchStatistics`; other buffers keep the first micro-batch's
rule). Outside deterministic mode the cut follows the members' shares, so a
step's micro-batches, and what they would move, depend on the world size. A
script that asks DDP for ``broadcast_buffers=False`` keeps
per-rank buffers (and is told that its snapshots hold one rank's share of
them). Only the persistent buffers (those in the ``state_dict``) are carried;
forwards in eval mode, without gradients or outside a step are left alone.

``SyncBatchNorm``'s statistics are the same on every member after each of its
forwards (:mod:`.sync_batchnorm`), and follow the same rule.
"""

from __future__ import annotations

import functools
import hashlib
import logging

import torch

log = logging.getLogger("phalanx.runtime")


class StepBuffers:
    """The buffers rule over ``model``'s persistent buffers (none: inactive).

    Args:
        model: the module the session trains (its forward hooks do the undoing).
        alike: False: the script asked DDP for ``broadcast_buffers=False``; each rank
            keeps its own.
        slots: the micro-batches of a step's canonical cut (deterministic mode, one rank
            a replica): its BatchNorm statistics then move once per micro-batch
            (:class:`MicroBatchStatistics`); None: once a step.
    """

    def __init__(self, model: torch.nn.Module, alike: bool = True,
                 slots: int | None = None) -> None:
        persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
        self.buffers = [b for b in model.buffers() if id(b) in persistent]
        if self.buffers and not alike:
            log.warning("broadcast_buffers=False: each rank keeps its own buffers, and a "
                        "snapshot holds a mix of them (each rank saves its share of the "
                        "state)")
            self.buffers = []
        self.statistics = MicroBatchStatistics(model, slots) \
            if self.buffers and slots is not None and slots > 1 else None
        self.numel = sum(b.numel() for b in self.buffers)
        self._index: int | None = None  # the step in progress (None: between steps)
        self._first: int | None = None  # this rank's micro-batch with the step's first sample
        self._current: int | None = None  # the micro-batch handed out, until its forward
        self._slot: int | None = None  # its place in the step's canonical cut, if known
        self._before: list[torch.Tensor] | None = None  # the buffers before this forward
        #: ``(step, buffers)`` after the forward of the step's first sample, on its holder.
        self._designated: tuple[int, list[torch.Tensor]] | None = None
        if self.buffers:
            model.register_forward_pre_hook(self._pre_forward)
            model.register_forward_hook(self._post_forward)

    @property
    def slots(self) -> int | None:
        """The micro-batches of a step's cut whose statistics move one by one (None:
        the statistics move once a step)."""
        return None if self.statistics is None else self.statistics.slots

    def start(self, index: int, first: int | None, kept_first: bool,
              kept_slots: frozenset[int] = frozenset()) -> None:
        """Step ``index`` starts (or runs again): this rank's micro-batch number ``first``
        (None: none) holds the step's first sample; ``kept_first``: a gradient kept from an
        aborted try of this step covers that sample already; ``kept_slots``: the
        micro-batches of the cut it covers."""
        if not kept_first or (self._designated is not None and self._designated[0] != index):
            self._designated = None
        if self.statistics is not None:
            self.statistics.start(index, kept_slots)
        self._index, self._first, self._current, self._slot = index, first, None, None

    def handing(self, micro_batch: int, slot: int | None = None) -> None:
        """The step's micro-batch number ``micro_batch`` is handed to the script: the next
        training forward is its (``slot``: its place in the step's cut; None: it trains on
        nothing, or the statistics move once a step)."""
        self._current, self._slot = micro_batch, slot

    def end(self) -> None:
        """Between steps: forwards change the buffers as they will."""
        self._index, self._before = None, None

    def _pre_forward(self, module: torch.nn.Module, args: object) -> None:
        if self._index is None or not module.training or not torch.is_grad_enabled():
            return
        self._before = [b.detach().clone() for b in self.buffers]
        if self.statistics is not None:
            self.statistics.forward_of(self._slot)

    def _post_forward(self, module: torch.nn.Module, args: object, output: object) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        if self.statistics is not None:
            self.statistics.forward_of(None)
        current, self._current, self._slot = self._current, None, None  # a second is undone
        if current is not None and current == self._first and self._index is not None:
            self._designated = (self._index, [b.detach().clone() for b in self.buffers])
        # Every forward's update is undone, that one's too (it is kept aside): within a
        # step the buffers stay the step's, so a state copied out of an aborted step (to a
        # joiner, or to a try run whole again) holds them as committed. Through .data: the
        # forward's graph holds the buffers (BatchNorm's backward takes them, but reads
        # them only in eval mode), and an in-place write it can see would fail it.
        for buffer, value in zip(self.buffers, before, strict=True):
            buffer.data.copy_(value)

    def digest(self) -> str | None:
        """A digest of the buffers the rule keeps alike (None: none), for the record: equal
        digests on every member after a step are equal buffers."""
        if not self.buffers:
            return None
        hashed = hashlib.blake2b(digest_size=8)
        for buffer in self.buffers:
            hashed.update(buffer.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return hashed.hexdigest()

    def tail(self) -> torch.Tensor:
        """This rank's part of the step's all-reduce: the designated buffers (float64,
        flat) and a 1 where it holds them, zeros elsewhere; then the statistics' slots."""
        if not self.buffers:
            return torch.zeros(0, dtype=torch.float64)
        out = torch.zeros(self.numel + 1, dtype=torch.float64)
        if self._designated is not None and self._designated[0] == self._index:
            out[:-1] = torch.cat([b.reshape(-1).to("cpu", torch.float64)
                                  for b in self._designated[1]])
            out[-1] = 1.0
        if self.statistics is None:
            return out
        return torch.cat([out, self.statistics.tail()])

    def alone(self) -> None:
        """No all-reduce (a world of one): this rank ran the step's first sample; its
        buffers become what that forward left (then its statistics move once per
        micro-batch, where they do)."""
        if self._designated is not None and self._designated[0] == self._index:
            for buffer, value in zip(self.buffers, self._designated[1], strict=True):
                buffer.data.copy_(value)
        if self.statistics is not None:
            self.statistics.replay(self.statistics.tail(), self._index)

    def settle(self, summed: torch.Tensor) -> None:
        """The step's buffers from the reduced ``tail``s: every member's become the one
        copy (left as they were before the step if not exactly one member held it), then
        the statistics move once per micro-batch, where they do."""
        if not self.buffers:
            return
        holders = float(summed[self.numel])
        if holders != 1.0:
            log.error("step %s: %s members held the buffers of its first sample; the "
                      "buffers stay as they were before it", self._index, holders)
        else:
            offset = 0
            for buffer in self.buffers:
                n = buffer.numel()
                buffer.data.copy_(summed[offset:offset + n].view_as(buffer))
                offset += n
        if self.statistics is not None:
            self.statistics.replay(summed[self.numel + 1:], self._index)


class MicroBatchStatistics:
    """BatchNorm's running statistics moved once per micro-batch of a step, in the order
    of the step's cut, whatever the membership (deterministic mode, where the cut is the
    same at any world size).

    A BatchNorm's update is affine in its running statistics, and its training forward
    never reads them. So each forward of a step's micro-batch runs from zeroed statistics
    (and ``num_batches_tracked`` at the step's count plus the micro-batch's place, for
    ``momentum=None``), which leaves the update's own part, ``factor * batch statistic``;
    that is kept aside in the micro-batch's *slot* and the statistics are put back. The
    slots ride in the step's all-reduce, each from the one member that ran it (zeros from
    the others: exact), with a 1 where a BatchNorm moved. Every member then replays them
    in the cut's order, ``r = (1 - factor) * r + update``, as the script alone replays its
    own: the statistics and ``num_batches_tracked`` move once per micro-batch, the same
    at any world size (bitwise; not bitwise the same as BatchNorm's own sequential
    update, which rounds otherwise). A BatchNorm run twice in one forward moves once.

    Args:
        model: the module the session trains.
        slots: the micro-batches of a step's cut.
    """

    def __init__(self, model: torch.nn.Module, slots: int) -> None:
        self.slots = slots
        self.norms = [m for m in model.modules()
                      if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      and m.running_mean is not None and m.running_var is not None
                      and m.num_batches_tracked is not None]
        #: Each norm's place in a slot: its mean, its variance, then a 1 where it moved.
        self._offsets: list[int] = []
        width = 0
        for norm in self.norms:
            self._offsets.append(width)
            width += 2 * _statistic(norm, "running_mean").numel() + 1
        self.width = width
        self._index: int | None = None  # the step whose slots this rank holds
        #: slot -> the updates its forward left, by norm (on the model's device: read
        #: off it once a step, in :meth:`tail`).
        self._held: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._slot: int | None = None  # the slot of the forward under way
        #: A norm's statistics and count before its forward (by its place in ``norms``).
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for n, norm in enumerate(self.norms):
            norm.register_forward_pre_hook(functools.partial(self._norm_before, n))
            norm.register_forward_hook(functools.partial(self._norm_after, n))

    def start(self, index: int, kept: frozenset[int]) -> None:
        """Step ``index`` starts (or runs again): the slots a kept gradient covers stay."""
        self._held = {slot: value for slot, value in self._held.items()
                      if self._index == index and slot in kept}
        self._index = index

    def forward_of(self, slot: int | None) -> None:
        """A training forward of the step starts with the micro-batch in ``slot`` (None: a
        forward that trains on nothing, or the forward's end)."""
        self._slot = slot
        if slot is not None:
            self._held[slot] = {}

    def _norm_before(self, n: int, module: torch.nn.Module, args: object) -> None:
        if self._slot is None or not module.training:
            return
        mean, var = _statistic(module, "running_mean"), _statistic(module, "running_var")
        count = _statistic(module, "num_batches_tracked")
        self._saved[n] = (mean.detach().clone(), var.detach().clone(),
                          count.detach().clone())
        mean.data.zero_()
        var.data.zero_()
        count.data.add_(self._slot)

    def _norm_after(self, n: int, module: torch.nn.Module, args: object,
                    output: object) -> None:
        saved = self._saved.pop(n, None)
        if saved is None or self._slot is None:
            return
        mean, var = _statistic(module, "running_mean"), _statistic(module, "running_var")
        self._held[self._slot][n] = (mean.detach().clone(), var.detach().clone())
        for buffer, value in zip((mean, var, _statistic(module, "num_batches_tracked")),
                                 saved, strict=True):
            buffer.data.copy_(value)

    def tail(self) -> torch.Tensor:
        """This rank's slots of the step (float64, ``slots * width``): zeros elsewhere."""
        device = _statistic(self.norms[0], "running_mean").device if self.norms else None
        out = torch.zeros(self.slots, self.width, dtype=torch.float64, device=device)
        for slot, moved in self._held.items():
            for n, (mean, var) in moved.items():
                at, size = self._offsets[n], mean.numel()
                out[slot, at:at + size] = mean.reshape(-1)
                out[slot, at + size:at + 2 * size] = var.reshape(-1)
                out[slot, at + 2 * size] = 1.0
        return out.reshape(-1).cpu()  # one copy off the device a step

    def replay(self, summed: torch.Tensor, index: int | None) -> None:
        """Move every norm's statistics by the step's slots (``summed``: the ``tail``s
        summed over the members), in the cut's order."""
        slots = summed.reshape(self.slots, self.width)
        for n, norm in enumerate(self.norms):
            mean, var = _statistic(norm, "running_mean"), _statistic(norm, "running_var")
            count = _statistic(norm, "num_batches_tracked")
            at, size = self._offsets[n], mean.numel()
            moved = slots[:, at + 2 * size]
            if bool((moved > 1).any()):
                log.error("step %s: a micro-batch's BatchNorm statistics came from %d "
                          "members; they stay as they were before the step", index,
                          int(moved.max()))
                continue
            start = int(count)
            for slot in range(self.slots):
                if moved[slot] != 1:
                    continue
                factor = norm.momentum if norm.momentum is not None \
                    else 1.0 / float(start + slot + 1)
                for buffer, update in ((mean, slots[slot, at:at + size]),
                                       (var, slots[slot, at + size:at + 2 * size])):
                    buffer.data.mul_(1.0 - factor).add_(
                        update.to(buffer.device, buffer.dtype).view_as(buffer))
                count.data.add_(1)


def _statistic(norm: torch.nn.Module, name: str) -> torch.Tensor:
    """A BatchNorm's buffer ``name`` (present: :class:`MicroBatchStatistics` takes only
    those that track their statistics)."""
    value = getattr(norm, name)
    assert isinstance(value, torch.Tensor)
    return value

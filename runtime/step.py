"""One global step of elastic training: this rank's micro-batches, a reduce, an apply.

A step trains on the samples :class:`~.data.ElasticOrder` gives its index and
this rank in the current membership (or, for a step repaired after a fault,
this rank's part of the shares nobody kept). Its loop is the DDP loop, with
the all-reduce made explicit:

* iterating the step yields the micro-batches; :meth:`Step.backward` weights
  each one's mean loss (``len / global_batch``), so gradients *summed* over
  the ranks are the gradient of the mean loss over the global batch, at any
  world size;
* :meth:`Step.reduce` sums the gradients, this rank's share of the loss and
  the script's metrics over the ranks (abortably). After it, ``.grad`` holds
  the global gradient, the same on every rank: clipping
  (:meth:`Step.clip_grad_norm_`), unscaling and skip-on-inf go there, and every
  rank decides the same;
* :meth:`Step.commit` applies ``optimizer.step()`` (unless :meth:`Step.skip`)
  and returns whether the step is committed: an aborted step runs again, so
  a scheduler stepped only on True is stepped once per committed step.

The session runs the collectives: a step takes its plan from the membership
(:meth:`.membership.Membership.share`), and asks the
:class:`~.training_step.StepRunner` to load its batches, arm the bucketed
all-reduce before the last micro-batch's backward (``arm``), fold
deterministic-mode gradients (``fold``), reduce (``allreduce``), update and
report what it did (``record_batch``, ``committed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from phalanx.runtime.data import MicroBatch
from phalanx.runtime.recovery import Retained
from phalanx.runtime.replica_group import is_dtensor
from phalanx.runtime.training_step import StepRunner

log = logging.getLogger("phalanx.runtime")


class Step:
    """One global step: this rank's micro-batches, then :meth:`commit`.

    The loop of a step, as DDP users write it::

        for batch in step:                  # this rank's micro-batches
            step.backward(loss_fn(model(batch)))   # weighted for you
        step.clip_grad_norm_(1.0)           # on the all-reduced gradient
        if step.commit():                   # False: aborted, the step runs again
            scheduler.step()                # once per committed step

    Between :meth:`reduce` (the all-reduce, which :meth:`commit` runs if the script
    did not) and :meth:`commit` (the optimizer step), the parameters' ``.grad`` hold
    the gradient of the mean loss over the whole global batch, bitwise the same on
    every rank: that is where anything DDP users do after ``backward()`` and before
    ``optimizer.step()`` goes (clipping, unscaling, inspecting), and every rank
    decides the same from it.
    """

    def __init__(self, runner: StepRunner, index: int) -> None:
        self._runner = runner
        self._state = state = runner.state
        self.index = index
        self.epoch, self.step_in_epoch = divmod(index, state.order.steps_per_epoch)
        #: This rank's micro-batches, and a repaired step's share kept from its aborted try.
        self.plan: list[MicroBatch]
        self.kept: Retained | None
        self.plan, self.kept = runner.membership.share(index)
        if runner.rounds is not None:
            runner.rounds.start(index)
        #: Each micro-batch's place in the step's cut, where the statistics move once per
        #: micro-batch (:mod:`.buffers`); None for one that trains on nothing.
        self._slots: list[int | None] = []
        buffers = state.buffers
        if buffers.buffers:
            batch = state.order.batch(self.epoch, self.step_in_epoch)
            place = {} if buffers.slots is None else {
                sample: n // state.micro_batch_size for n, sample in enumerate(batch)}
            self._slots = [place.get(mb.indices[0]) if mb.weight else None
                           for mb in self.plan]
            kept = [] if self.kept is None else self.kept.indices
            buffers.start(
                index,
                next((n for n, mb in enumerate(self.plan) if batch[0] in mb.indices), None),
                batch[0] in kept, frozenset(place[i] for i in kept if i in place))
        self.outcome: bool | None = None
        #: The step's loss over the whole global batch (the sum of every rank's weighted
        #: shares), once reduced; None before, or if the step was aborted.
        self.loss: float | None = None
        #: The script's metrics (:meth:`add`) summed over the ranks, once reduced.
        self.metrics: dict[str, float] = {}
        #: False once :meth:`skip` was called: the step commits without an update.
        self.updated = True
        self._weight: float | None = None  # of the micro-batch being yielded
        self._loss_share = 0.0
        #: A loss was counted (:meth:`backward`, or given to :meth:`reduce`): a script's
        #: own ``loss.backward()`` tells the step none.
        self.loss_given = False
        self._metric_shares: dict[str, float] = {}
        self._reduced: bool | None = None
        self._reduced_at = 0.0
        self._computed_at = 0.0
        self.started = time.perf_counter()

    @property
    def indices(self) -> list[int]:
        """The samples this rank's gradient covers (a repaired step's kept share first; a
        replica group's filler, weight 0, covers none)."""
        kept = self.kept.indices if self.kept is not None else []
        return kept + [i for mb in self.plan if mb.weight for i in mb.indices]

    def batches(self) -> Iterator[tuple[Any, float]]:
        """``(batch, weight)`` per micro-batch: the raw form of iterating the step.

        Scale the micro-batch's mean loss by ``weight`` yourself, or call
        :meth:`backward`, which does.
        """
        runner = self._runner
        loaded = runner.load(self.plan)
        for n, mb in enumerate(self.plan):
            if n == len(self.plan) - 1:
                runner.arm(self)  # its backward starts the all-reduce
            self._weight = mb.weight
            self._state.buffers.handing(n, self._slots[n] if self._slots else None)
            if runner.rounds is not None:
                runner.rounds.handing(mb.weight)
            if n == 0 and self._state.chaos.due(self.index, "forward"):
                self._state.die()
            yield next(loaded), mb.weight
            if self._state.deterministic:  # the caller's backward for this micro-batch is done
                runner.fold()
        self._weight = None

    def __iter__(self) -> Iterator[Any]:
        """This rank's micro-batches of the step; call :meth:`backward` on each one's loss."""
        for batch, _ in self.batches():
            yield batch

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the current micro-batch's *mean* loss, scaled by its weight.

        Its value counts into the step's :attr:`loss` (reduced with the gradients).

        Raises:
            RuntimeError: called outside the loop over the step's micro-batches.
        """
        if self._weight is None:
            raise RuntimeError("step.backward(loss) belongs inside the loop over the step's "
                               "micro-batches (for batch in step: ...)")
        self._loss_share += float(loss.detach()) * self._weight
        self.loss_given = True
        (loss * self._weight).backward()

    def add(self, name: str, value: float | torch.Tensor) -> None:
        """Add ``value`` to this rank's share of metric ``name`` (declared in the session's
        ``metrics``); after :meth:`reduce`, ``step.metrics[name]`` is the sum over ranks.

        Raises:
            KeyError: ``name`` was not declared.
            RuntimeError: the step was reduced already.
        """
        if name not in self._state.metric_names:
            raise KeyError(f"metric {name!r} is not declared in the session's metrics "
                           f"{list(self._state.metric_names)}")
        if self._reduced is not None:
            raise RuntimeError(f"step {self.index} was reduced already: add metrics before")
        self._metric_shares[name] = self._metric_shares.get(name, 0.0) + float(value)

    def local_metrics(self) -> torch.Tensor:
        """This rank's share of ``[loss, *metrics]`` (with a repaired step's kept share)."""
        values = torch.tensor([self._loss_share, *(
            self._metric_shares.get(name, 0.0) for name in self._state.metric_names)],
            dtype=torch.float64)
        return values if self.kept is None else values + self.kept.metrics

    def reduced(self, summed: torch.Tensor) -> None:
        """The session's call: ``summed`` is :meth:`local_metrics` summed over the ranks."""
        values = summed.tolist()
        self.loss = values[0]
        self.metrics = dict(zip(self._state.metric_names, values[1:], strict=True))

    def reduce(self, loss: float | None = None) -> bool:
        """All-reduce the gradients (and the loss and metrics); idempotent.

        Afterwards ``.grad`` holds the global batch's gradient, the same on every rank.

        Args:
            loss: this rank's share of the step's loss (the sum of its micro-batches'
                weighted losses), for a script that does not use :meth:`backward`.

        Returns:
            False when a fault aborted the step (call :meth:`commit` anyway: it returns
            False too, and the same step runs again in the next generation).

        Raises:
            ValueError: ``loss`` given for a step reduced already.
        """
        if self._reduced is not None:
            if loss is not None:
                raise ValueError(f"step {self.index} was reduced already: pass its loss to "
                                 "the first reduce() or commit()")
            return self._reduced
        if loss is not None:
            self._loss_share, self.loss_given = float(loss), True
        self._runner.record_batch(self)  # before the gradients leave this process
        self._computed_at = time.perf_counter()
        self._reduced = self._runner.allreduce(self)
        self._reduced_at = time.perf_counter()
        return self._reduced

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the *all-reduced* gradient by its global norm (:meth:`reduce` first).

        ``torch.nn.utils.clip_grad_norm_`` over the session's parameters; a non-finite
        norm (inf or nan in the gradient) skips the update (:meth:`skip`) on every rank.

        Returns:
            The gradient's total norm before clipping; None if the step was aborted.
        """
        if not self.reduce():
            return None
        norm = torch.nn.utils.clip_grad_norm_(self._runner.params(), max_norm, norm_type)
        if is_dtensor(norm):  # the norm over a replica group's shards (summed within it)
            norm = norm.full_tensor()  # type: ignore[attr-defined]
        if not bool(torch.isfinite(norm)):
            log.warning("step %d: gradient norm %s, the update is skipped", self.index,
                        float(norm))
            self.skip()
        return norm

    def skip(self) -> None:
        """Commit this step without an optimizer update (its samples count as seen).

        Decide it from reduced values only (after :meth:`reduce`): they are the same on
        every rank, so every rank skips alike and none diverges.

        Raises:
            RuntimeError: the step was not reduced (or was aborted).
        """
        if not self._reduced:
            raise RuntimeError(f"step {self.index}: skip() decides from the reduced "
                               "gradients: call it after reduce() returned True")
        self.updated = False

    def commit(self, loss: float | None = None) -> bool:
        """Reduce (unless :meth:`reduce` ran), then apply the optimizer step.

        Args:
            loss: as for :meth:`reduce`.

        Returns:
            True when the step is committed, False when a fault aborted it: its
            gradients are dropped and the same step runs again in the next generation.
            Step an LR scheduler or an EMA only on True, so that each is stepped once
            per committed step.
        """
        ok = self.reduce(loss)
        if ok and self.updated:
            ok = self._runner.update(self)
        if ok:
            self._runner.committed(self, time.perf_counter())
        # None, as DDP users do: the next backward hands its gradient over instead of
        # adding it into zeroed memory (two passes over every gradient saved).
        self._state.optimizer.zero_grad(set_to_none=True)
        self.outcome = ok
        return ok

    def timings(self, now: float) -> dict[str, float]:
        """Where the step's time went, for the record (``now``: the optimizer step's end),
        and the process's CPU time so far (all threads: the bus thread's and gloo's too),
        whose growth per step is the rank's cost even on a shared, busy machine."""
        return {"compute_s": self._computed_at - self.started,
                "reduce_s": self._reduced_at - self._computed_at,
                "optimizer_s": now - self._reduced_at, "process_cpu_s": time.process_time()}

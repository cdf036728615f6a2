"""The DDP-shaped loop over an elastic session: epochs, a loader, backward, commit.

A DDP script's loop keeps its shape under the session, its ``loss.backward()``
included; the sampler and the optimizer step become the session's::

    loader = session.loader                      # DataLoader(..., sampler=DistributedSampler)
    for epoch in session.epochs(epochs):         # for epoch in range(epochs): set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()                      # as under DDP
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not session.commit():             # optimizer.step()
                continue
            scheduler.step()

Underneath it is one :meth:`ElasticSession.steps` over ``epochs *
steps_per_epoch`` steps; the loop hands out each step's micro-batches and
drives the step (:class:`~.step.Step`) from the script's calls:

* :meth:`EpochLoop.epochs` yields the epoch of the next step to train: after a
  join or a restore, the first is the epoch of the committed step. The loader
  stops once the epoch's last step is committed, and that step's boundary (its
  snapshot, record and report) comes when the script asks for the next epoch,
  so the script's code after the inner loop is part of the step in every
  tier. A membership change that moves the job across an epoch's end (a member
  one step behind receives its peers' state) does not end the iteration early:
  it ends at the end of the epoch the job is in, so the code after the inner
  loop runs once per epoch on every member.
* The loader yields this rank's micro-batches of each step of the epoch, from
  the committed step (one per step without ``micro_batch_size``). A step a
  fault aborted is yielded again, with the new membership's share. A rank
  with no sample in a step (it sits out the first step after a state copy, or
  the step has fewer micro-batches than there are ranks) is handed the step's
  first micro-batch so that the loop body, and the script's post-commit code,
  runs on every rank; its gradient is dropped (it weighs nothing).
* **The backward of a batch is the script's own** (``loss.backward()``, or
  anything that back-propagates into the parameters once per batch, a loss
  scaler's included), as under DDP: the session sees it through hooks on the
  parameters. Each gradient is weighted by the micro-batch's share of the
  global batch on its way into ``.grad``; when the backward ends (a callback
  the autograd engine runs after the whole pass, as DDP's reducer uses) the
  step's last micro-batch also completes the all-reduce, so ``.grad`` then
  holds the global batch's gradient and ``torch.nn.utils.clip_grad_norm_``
  where DDP scripts call it clips that. Between the micro-batches of one step
  the session holds the accumulated gradient out of ``.grad``: an
  ``optimizer.zero_grad()`` or a clip there touches nothing.
  :meth:`EpochLoop.backward` (``session.backward(loss)``) is the same pass that
  also counts the batch's loss into the step's global loss (the records and
  ``step.loss``); it weights the loss itself, as :meth:`Step.backward` does.
  One backward per batch: a second one of the same batch, and a backward
  inside the backward (reentrant activation checkpointing: use
  ``use_reentrant=False``), are refused by name.
* :meth:`EpochLoop.commit` returns False on a micro-batch that is not the
  step's last and on an aborted step, True once the step is committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from phalanx.runtime.data import MicroBatch
from phalanx.runtime.step import Step
from phalanx.runtime.training_step import StepRunner

_END = object()
REENTRANT = ("activation checkpointing with use_reentrant=True runs a backward within the "
             "backward: pass use_reentrant=False")


class EpochLoader:
    """``session.loader``: iterate it once per epoch of :meth:`ElasticSession.epochs`."""

    def __init__(self, loop: EpochLoop) -> None:
        self._loop = loop

    def __iter__(self) -> Iterator[Any]:
        """This rank's micro-batches of the epoch's steps, from the committed one.

        Raises:
            RuntimeError: iterated outside ``for epoch in session.epochs(n)``, or a
                batch was left without ``session.backward`` or a step without
                ``session.commit()``.
        """
        loop = self._loop
        if loop.epoch is None:
            raise RuntimeError("iterate session.loader inside `for epoch in "
                               "session.epochs(n)`: the epochs decide where it starts")
        while (batch := loop.next_batch()) is not _END:
            yield batch


class EpochLoop:
    """The state of the DDP-shaped loop of one session (see the module docstring)."""

    def __init__(self, runner: StepRunner, steps: Callable[[int], Iterator[Step]]) -> None:
        self._runner = runner
        self._session_steps = steps  # the session's loop over steps
        self.loader = EpochLoader(self)
        #: The epoch being iterated; None outside ``session.epochs()``.
        self.epoch: int | None = None
        self._steps: Iterator[Step] | None = None
        self._step: Step | None = None
        self._batches: Iterator[tuple[Any, float]] | None = None  # the step's, in order
        self._ahead: Any = None  # its next batch, fetched when the one before was settled
        self._left = 0  # batches of the step not handed out yet
        self._out = False  # a batch was handed out and its backward has not run
        self._settled = False  # the backward of the batch handed out last has run
        self._stand_in = False  # the step has no sample here: its batch only runs the body
        self._stash: list[torch.Tensor | None] | None = None  # gradient between batches
        self._hooks: list[RemovableHandle] | None = None  # on the parameters, once armed
        self._weighted = False  # session.backward weighted the batch's loss itself
        self._pass: int | None = None  # the autograd task of the batch's backward, once begun

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs to train, from the committed step's to ``count - 1``.

        Raises:
            ValueError: ``count`` < 1.
            RuntimeError: called a second time, or the loop over the loader of an
                epoch ended before the epoch's last step was committed.
        """
        if count < 1:
            raise ValueError(f"epochs must be >= 1, got {count}")
        if self._steps is not None:
            raise RuntimeError("session.epochs() runs once per session")
        self._steps = self._session_steps(count * self._runner.state.order.steps_per_epoch)
        self._advance()
        while self._step is not None:
            self.epoch = self._step.epoch
            yield self.epoch
            step = self._step
            if step is None:  # the job's last step came with a state copy
                break
            if not (step.outcome and self._ends_epoch(step)):
                raise RuntimeError(f"the loop over session.loader left epoch {self.epoch} "
                                   f"at step {step.index}, before its last step was "
                                   "committed: iterate the loader to the end of each epoch "
                                   "(break out of both loops to stop)")
            self._advance()  # the boundary of the epoch's last step: after the epoch's code
        self.epoch = None

    def next_batch(self) -> Any:
        """The loader's next batch, or ``_END`` at the end of the epoch (or of training)."""
        while True:
            step = self._step
            if step is None:
                return _END
            if step.outcome is not None:  # committed, or aborted: the step runs again
                if step.outcome and self._ends_epoch(step):
                    return _END
                self._advance()
                continue
            if self._out:
                if self._runner.state.group is not None:
                    # FSDP2 hands a sharded parameter its gradient outside autograd: the
                    # hooks that weight a plain loss.backward() never see it.
                    raise RuntimeError(f"step {step.index}: with a sharded model (a replica "
                                       "group) call session.backward(loss) on each batch, "
                                       "which weights its loss, not loss.backward()")
                raise RuntimeError(f"step {step.index}: call loss.backward() on each batch "
                                   "before taking the next (no gradient reached the "
                                   "parameters)")
            if not self._left:
                raise RuntimeError(f"step {step.index} was not committed: call "
                                   "session.commit() after each batch's backward")
            self._left -= 1
            self._out, self._settled = True, False
            self._weighting(hooks=True)
            self._arm_hooks()
            if self._stand_in:
                indices = self._runner.state.order.batch(step.epoch, step.step_in_epoch)
                stand_in = MicroBatch(tuple(indices[:self._runner.state.micro_batch_size]), 0.0)
                return next(self._runner.load([stand_in]))
            if self._ahead is not None:
                batch, self._ahead = self._ahead, None
                return batch
            assert self._batches is not None
            return next(self._batches)[0]

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` that also counts the batch's mean loss into the step's loss;
        the loss is weighted here, so the hooks pass its gradient on as it is.

        Raises:
            RuntimeError: called outside the loop over the loader, or twice on a batch.
        """
        step = self._step
        if step is None or not self._out:
            raise RuntimeError("session.backward(loss) belongs in the loop over "
                               "session.loader, once per batch")
        if not self._stand_in:
            self._weighting(hooks=False)
            step.backward(loss)
        elif self._runner.state.group is not None:
            # A replica group's sharded model ends the pass its forward began (FSDP2
            # reshards and reduces in the backward, the group's ranks together): a
            # weightless backward, whose gradient the stand-in drops.
            (loss * 0.0).backward()
        if self._out:  # a stand-in's, or a loss no parameter's gradient came from
            self._backward_done()

    def _weighting(self, hooks: bool) -> None:
        """Who weights the batch's gradient: the hooks (the script's plain
        ``loss.backward()``), or the loss (``session.backward``); ``SyncBatchNorm``'s
        backward weights its sums across the members likewise (:mod:`.sync_batchnorm`)."""
        self._weighted = not hooks
        if self._runner.rounds is not None:
            self._runner.rounds.hooks_weight = hooks

    def _arm_hooks(self) -> None:
        """Hook every parameter's gradient on its way into ``.grad`` (once)."""
        if self._hooks is None:
            self._hooks = [p.register_hook(self._gradient)
                           for p in self._runner.params()]

    def _gradient(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient from the batch's backward, before it is accumulated:
        weighted by the micro-batch's share; the first of a pass puts the step's gradient
        so far back into ``.grad`` (the pass adds to it) and asks for the pass's end."""
        step = self._step
        if step is None:
            return None  # outside the loop: the script's own passes (a warm-up) are its own
        if not self._out:
            raise RuntimeError(f"step {step.index}: a backward with no batch awaiting one: "
                               "call loss.backward() once per batch the loader hands out "
                               f"({REENTRANT})")
        task = torch._C._current_graph_task_id()
        if self._pass is None:
            self._pass = task
            self._restore_stash()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        elif task != self._pass:
            raise RuntimeError(f"a backward inside the batch's backward ({REENTRANT})")
        if self._weighted or self._stand_in:
            return None
        assert step._weight is not None
        return grad * step._weight

    def _restore_stash(self) -> None:
        """Give the step's gradient so far back to ``.grad`` for the pass to add into."""
        if self._stash is None:
            return
        for p, kept in zip(self._runner.params(), self._stash, strict=True):
            if kept is not None:
                p.grad = kept if p.grad is None else p.grad.add_(kept)
        self._stash = None

    def _backward_done(self) -> None:
        """The batch's backward ended: fold it (deterministic mode), hold the step's
        gradient out of ``.grad`` until the next batch's backward, or, after the step's
        last batch, all-reduce it."""
        step = self._step
        assert step is not None
        self._pass = None
        self._out, self._settled = False, True
        params = self._runner.params()
        if self._stand_in:  # it weighs nothing: what its backward left is dropped
            for p in params:
                p.grad = None
        else:
            self._restore_stash()  # no parameter's gradient came: the step's is kept whole
            assert self._batches is not None
            # Step.batches folds a deterministic micro-batch once its backward is done.
            if self._left:
                self._ahead = next(self._batches)[0]
            else:
                next(self._batches, None)
        if self._left:  # kept out of .grad until the next backward
            self._stash = [p.grad for p in params]
            for p in params:
                p.grad = None
        elif not step.reduce():
            for p in params:  # a local gradient: nothing may act on it (it is kept)
                p.grad = None

    def close(self) -> None:
        """Take the hooks off the parameters (the model outlives the session)."""
        for hook in self._hooks or ():
            hook.remove()
        self._hooks = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """:meth:`Step.clip_grad_norm_` on the step's last batch; None on another batch
        (nothing to clip yet) or an aborted step."""
        step = self._settled_step("session.clip_grad_norm_()")
        return None if self._left else step.clip_grad_norm_(max_norm, norm_type)

    def commit(self) -> bool:
        """On the step's last batch, :meth:`Step.commit`; on another batch, False.

        Raises:
            RuntimeError: before the batch's backward, or the step was committed already.
        """
        step = self._settled_step("session.commit()")
        if step.outcome is not None:
            raise RuntimeError(f"step {step.index} was committed already")
        return False if self._left else step.commit()

    def _settled_step(self, call: str) -> Step:
        if self._step is None or not self._settled:
            raise RuntimeError(f"{call} follows the batch's loss.backward() in the loop "
                               "over session.loader")
        return self._step

    def _ends_epoch(self, step: Step) -> bool:
        return step.step_in_epoch == self._runner.state.order.steps_per_epoch - 1

    def _advance(self) -> None:
        """The next step from the session (its boundary first), or None at the end."""
        assert self._steps is not None
        self._step = step = next(self._steps, None)
        self._ahead, self._stash, self._pass = None, None, None
        self._out = self._settled = False
        if step is None:
            return
        self._stand_in = not step.plan
        self._left = len(step.plan) or 1
        self._batches = None if self._stand_in else step.batches()

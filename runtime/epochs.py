"""The DDP-shaped loop over an elastic session: epochs, a loader, backward, commit.

A DDP script's loop keeps its shape under the session; the sampler, the
backward and the optimizer step become the session's::

    loader = session.loader                      # DataLoader(..., sampler=DistributedSampler)
    for epoch in session.epochs(epochs):         # for epoch in range(epochs): set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            session.backward(loss)               # loss.backward()
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
  runs on every rank; its backward is skipped (it weighs nothing).
* :meth:`EpochLoop.backward` weights the micro-batch's mean loss as
  :meth:`Step.backward` does. On the step's last micro-batch it also runs the
  all-reduce, as DDP's backward does, so that ``.grad`` then holds the global
  batch's gradient and ``torch.nn.utils.clip_grad_norm_`` where DDP scripts
  call it clips that. Between the micro-batches of one step the session holds
  the accumulated gradient out of ``.grad``: an ``optimizer.zero_grad()`` or a
  clip there touches nothing.
* :meth:`EpochLoop.commit` returns False on a micro-batch that is not the
  step's last and on an aborted step, True once the step is committed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.runtime.data import MicroBatch

if TYPE_CHECKING:
    from phalanx.runtime.elastic import ElasticSession
    from phalanx.runtime.step import Step

_END = object()


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

    def __init__(self, session: ElasticSession) -> None:
        self.session = session
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
        self._steps = self.session.steps(count * self.session.order.steps_per_epoch)
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
                raise RuntimeError(f"step {step.index}: call session.backward(loss) on each "
                                   "batch before taking the next")
            if not self._left:
                raise RuntimeError(f"step {step.index} was not committed: call "
                                   "session.commit() after each batch's backward")
            self._left -= 1
            self._out, self._settled = True, False
            if self._stand_in:
                indices = self.session.order.batch(step.epoch, step.step_in_epoch)
                stand_in = MicroBatch(tuple(indices[:self.session.micro_batch_size]), 0.0)
                return next(self.session._runner.load([stand_in]))
            if self._ahead is not None:
                batch, self._ahead = self._ahead, None
                return batch
            assert self._batches is not None
            return next(self._batches)[0]

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the batch's mean loss, weighted; on the step's last batch, then
        all-reduce the gradients (abortably).

        Raises:
            RuntimeError: called outside the loop over the loader, or twice on a batch.
        """
        step = self._step
        if step is None or not self._out:
            raise RuntimeError("session.backward(loss) belongs in the loop over "
                               "session.loader, once per batch")
        self._out, self._settled = False, True
        params = self.session._runner.params()
        if self._stash is not None:  # the step's gradient so far: backward adds to it
            for p, kept in zip(params, self._stash, strict=True):
                if kept is not None:
                    p.grad = kept if p.grad is None else p.grad.add_(kept)
            self._stash = None
        if not self._stand_in:
            step.backward(loss)
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
            raise RuntimeError(f"{call} follows session.backward(loss) in the loop over "
                               "session.loader")
        return self._step

    def _ends_epoch(self, step: Step) -> bool:
        return step.step_in_epoch == self.session.order.steps_per_epoch - 1

    def _advance(self) -> None:
        """The next step from the session (its boundary first), or None at the end."""
        assert self._steps is not None
        self._step = step = next(self._steps, None)
        self._ahead, self._stash = None, None
        self._out = self._settled = False
        if step is None:
            return
        self._stand_in = not step.plan
        self._left = len(step.plan) or 1
        self._batches = None if self._stand_in else step.batches()

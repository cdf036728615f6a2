"""The session's side of a step: its batches, the gradient all-reduce, the update, the boundary.

A :class:`~.step.Step` is what the script iterates; what it asks of the
session, :class:`StepRunner` does, in the step's order:

* **Batches.** The rank's micro-batches (:meth:`.membership.Membership.share`)
  are read lazily, through the session's ``DataLoader`` or the dataset's own
  ``batch``.
* **Reduce.** Normally the gradient all-reduce runs in buckets that the
  parameters' post-accumulate hooks start during the last micro-batch's
  backward (:meth:`StepRunner.arm`, :mod:`.reduce`); the buckets of a completed
  all-reduce are lent to the next one. In deterministic mode each micro-batch's
  gradient is folded into a float64 sum, all-reduced whole and rounded once.
  Either way a float64 *tail* rides along: the step's loss and metrics, this
  member's snapshot measurements and whether it has seen a newer generation
  (any member that has makes every member switch after the step). An aborted
  all-reduce keeps this rank's gradient for the repair
  (:class:`~.membership.Retained`) and gives the group up.
* **Apply.** ``optimizer.step()``; a sharded optimizer's broadcast of the
  updated parameters is abortable (a torn step is not committed).
* **Boundary.** A committed step is snapshotted, recorded and reported when the
  script next asks for a step, the loop ends or the session closes
  (:meth:`StepRunner.finish_commit`), so that what the script does after
  ``commit()`` returns (a scheduler's step) is part of the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import msgspec
import torch

from phalanx.runtime.data import MicroBatch
from phalanx.runtime.group import Aborted
from phalanx.runtime.membership import Membership
from phalanx.runtime.recovery import Retained
from phalanx.runtime.reduce import (
    BucketedReduce,
    bucket_plan,
    flat_gradients,
    write_gradients,
)
from phalanx.runtime.replica_group import local as shard
from phalanx.runtime.session_state import SessionState
from phalanx.runtime.snapshot_interval import TAIL_LENGTH
from phalanx.runtime.sync_batchnorm import SyncRounds
from phalanx.schemas import subjects

log = logging.getLogger("phalanx.runtime")


class Step(Protocol):
    """What the runner reads of a step (:class:`.step.Step`, which holds the runner)."""

    index: int
    kept: Retained | None
    started: float
    updated: bool
    loss_given: bool

    @property
    def indices(self) -> list[int]: ...

    def local_metrics(self) -> torch.Tensor: ...

    def reduced(self, summed: torch.Tensor) -> None: ...

    def timings(self, now: float) -> dict[str, float]: ...


class StepRunner:
    """What a session's steps ask of it, in the generation ``membership`` applied.

    It moves the state's ``committed`` and ``last_step_s`` as steps commit.
    """

    def __init__(self, state: SessionState, membership: Membership,
                 norms: Sequence[torch.nn.Module] = ()) -> None:
        self.state = state
        self.membership = membership
        #: The collectives of the model's ``SyncBatchNorm`` layers, if it has any.
        self.rounds = SyncRounds(membership, norms) if norms else None
        self._accumulated: torch.Tensor | None = None  # float64 gradient sum (deterministic)
        self._reduce: BucketedReduce | None = None  # the step's all-reduce, once armed
        self._buckets: list[list[int]] | None = None
        # The buckets of the last completed all-reduce, reused; dropped after an abort.
        self._bucket_buffers: list[torch.Tensor] | None = None
        # The committed step whose snapshot, record and report wait for the boundary after
        # the script's post-commit code: (step, commit time, the step time before, the
        # commit before).
        self._boundary: tuple[Step, float, float, float | None] | None = None
        self._last_commit_at: float | None = None  # perf_counter of this process's last commit
        self._sharded_params = None if state.group is None else [
            p for p in state.model.parameters() if p.requires_grad]

    def params(self) -> list[torch.nn.Parameter]:
        """The parameters that train (the ones the gradients are of). A replica group's
        are its sharded ones, as the session found them: FSDP2 registers the unsharded
        ones in their place between a forward and its backward (all through a
        stand-in's forward, whose backward never runs)."""
        if self._sharded_params is not None:
            return self._sharded_params
        return [p for p in self.state.model.parameters() if p.requires_grad]

    def load(self, plan: list[MicroBatch]) -> Iterator[Any]:
        """The batches of ``plan``'s micro-batches, in order (lazily)."""
        state = self.state
        if state.loader is None:  # the dataset's own gather
            return (state.dataset.batch(mb.indices) for mb in plan)
        return state.loader.batches(plan)

    # --- reduce --------------------------------------------------------------------------

    def fold(self) -> None:
        """Deterministic mode: add the micro-batch's gradient to the float64 sum."""
        flat = flat_gradients(self.params(), torch.float64)
        self._accumulated = flat if self._accumulated is None else self._accumulated + flat
        self.state.optimizer.zero_grad(set_to_none=False)

    def arm(self, step: Step) -> None:
        """Before the step's last backward: let the hooks start the all-reduce as it runs."""
        if not self.state.deterministic and self.membership.pg is not None:
            self._reduce = self._bucketed(step)

    def allreduce(self, step: Step) -> bool:
        """Sum gradients and metrics over the members; False if the step was aborted.

        On success ``step.loss`` and ``step.metrics`` hold the sums over the ranks.
        """
        state, membership = self.state, self.membership
        snapshots = state.snapshots
        params = self.params()
        kept = step.kept.gradient if step.kept is not None else None
        metrics = step.local_metrics()
        reduce = self._reduce
        self._reduce = None
        if self.rounds is not None and self.rounds.end():
            log.warning("step %d aborted in a SyncBatchNorm all-reduce", step.index)
            return False  # given up there already: nothing to sum, the step runs again

        buffers = state.buffers.tail()  # the designated member's buffers (.buffers)

        def tail() -> torch.Tensor:
            # The loss and metrics, the buffers, then this member's snapshot measurements
            # (every member agrees on the interval from their sums), and how many members
            # have seen a newer (join) generation.
            measured = [0.0] * TAIL_LENGTH if snapshots is None else snapshots.schedule.tail()
            return torch.cat([metrics, buffers,
                              torch.tensor([*measured, membership.seen_newer()],
                                           dtype=torch.float64)])

        run: Callable[[], torch.Tensor]
        local_gradient: Callable[[], torch.Tensor]
        if state.deterministic or membership.pg is None:
            if state.deterministic:
                local = self._accumulated if self._accumulated is not None else torch.zeros(
                    sum(shard(p).numel() for p in params), dtype=torch.float64,
                    device=state.device)
                self._accumulated = None
            else:
                local = flat_gradients(params)
            if kept is not None:  # a repaired step: this rank's share from the aborted try
                local = local + kept
            if membership.pg is None:
                write_gradients(params, local)
                # Alone, a replica group is the whole job: its ranks' metrics are the step's.
                step.reduced(metrics if state.group is None
                             else state.group.agree(metrics) / state.group.copies)
                state.buffers.alone()
                return True
            flat = torch.cat([local.to(torch.float64), tail().to(local.device)])
            run = self._reduce_whole(flat, len(metrics) + len(buffers) + TAIL_LENGTH + 1,
                                     step)
            local_gradient = (lambda: local)  # noqa: E731  (already at hand)
        else:
            reduce = reduce or self._bucketed(step, tail)  # not armed: no micro-batch here
            reduce.tail = tail
            run = (lambda: reduce.finish(membership.wait))  # noqa: E731
            local_gradient = reduce.local_gradient
        generation = membership.generation
        assert generation is not None  # a group exists only within a generation
        summed: torch.Tensor | None = None
        try:
            summed = run()
        except Aborted as exc:
            log.warning("step %d aborted: %s", step.index, exc)
            # A rank of a replica group keeps nothing: its group's ranks repair nothing
            # alike (each column would plan its own repair of other samples). Nor does a
            # SyncBatchNorm model: its gradient is of the old membership's rounds.
            membership.give_up(step.index, exc, None if state.group is not None
                               or self.rounds is not None else
                               Retained(step.index, generation, local_gradient(),
                                        step.indices, metrics))
        if state.group is not None:
            completed = summed is not None
            summed, why = self._agree_in_group(summed, len(metrics),
                                               len(metrics) + len(buffers))
            if why is not None and completed:  # its column completed, another did not
                log.warning("step %d aborted: %s", step.index, why)
                membership.give_up(step.index, why)
        if summed is None:
            return False
        if reduce is not None:
            self._bucket_buffers = reduce.flats  # given back: the all-reduce completed
        step.reduced(summed[:len(metrics)])
        after_metrics = len(metrics) + len(buffers)
        state.buffers.settle(summed[len(metrics):after_metrics])
        if snapshots is not None:
            snapshots.schedule.agree(summed[after_metrics:-1].tolist())
        if summed[-1] > 0:
            membership.agree_to_switch()
        return True

    def _agree_in_group(self, summed: torch.Tensor | None, metrics: int,
                        measured: int) -> tuple[torch.Tensor | None, Aborted | None]:
        """A replica group's ranks commit the step or give it up as one
        (:meth:`.replica_group.ReplicaGroup.agree`): ``summed`` (this rank's column's
        sums; None: its all-reduce was aborted) with the metrics, the snapshot
        measurements (at ``measured``) and the switch flag summed over the group's
        columns, or None with why the group gave the step up. Every column then agrees
        on one snapshot interval, from the whole job's measurements: a group's ranks
        snapshot the same steps (a restore needs every column's shard of one step)."""
        group = self.state.group
        assert group is not None
        at = slice(measured, measured + TAIL_LENGTH)
        column = summed if summed is not None else torch.zeros(
            measured + TAIL_LENGTH + 1, dtype=torch.float64)
        verdict = group.agree(torch.cat([
            torch.tensor([0.0 if summed is not None else 1.0], dtype=torch.float64),
            column[:metrics].to(torch.float64), column[at].to(torch.float64),
            column[-1:].to(torch.float64)]))
        if verdict[0] > 0:
            return None, Aborted(f"{int(verdict[0])} of this replica group's ranks lost "
                                 "the step's all-reduce")
        assert summed is not None
        out = summed.clone()
        # Each data shard's loss and metrics were counted by every rank that trained on it.
        out[:metrics] = (verdict[1:1 + metrics] / group.copies).to(out.dtype)
        out[at] = verdict[1 + metrics:1 + metrics + TAIL_LENGTH].to(out.dtype)
        out[-1] = verdict[-1]
        return out, None

    def _reduce_whole(self, flat: torch.Tensor, tail: int,
                      step: Step) -> Callable[[], torch.Tensor]:
        """One all-reduce of the whole flat gradient and the ``tail`` last elements
        (deterministic mode)."""
        state = self.state
        pg = self.membership.pg
        assert pg is not None

        def run() -> torch.Tensor:
            if state.chaos.due(step.index, "allreduce"):
                state.die()
            self.membership.wait(pg.allreduce([flat]))
            write_gradients(self.params(), flat)  # rounds float64 sums once
            return flat[-tail:]

        return run

    def _bucketed(self, step: Step,
                  tail: Callable[[], torch.Tensor] | None = None) -> BucketedReduce:
        """A bucketed all-reduce for ``step``, started by the gradient hooks as backward runs."""
        state = self.state
        assert self.membership.pg is not None
        params = self.params()
        if self._buckets is None:
            self._buckets = bucket_plan(params)
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(
                    lambda _, i=i: self._reduce.gradient_ready(i) if self._reduce else None)
        reduce = BucketedReduce(self.membership.pg, params, self._buckets,
                                step.kept.gradient if step.kept is not None else None,
                                tail or (lambda: torch.zeros(0)), self._bucket_buffers)
        # Lent to this step's all-reduce; an aborted one never gives them back (its gloo
        # threads may still write into them), so the next step allocates new ones.
        self._bucket_buffers = None
        if state.chaos.due(step.index, "allreduce"):
            reduce.before_last_launch = state.die
        return reduce

    # --- apply and commit ----------------------------------------------------------------

    def update(self, step: Step) -> bool:
        """The optimizer step; False if a fault cut a sharded optimizer's broadcast of the
        updated parameters short (the step is torn: it is not committed, and the members
        hold no complete step until they restore one)."""
        state = self.state
        if state.snapshots is not None:
            state.snapshots.fence()  # a snapshot copied off the device is not overwritten
        dies = state.chaos.due(step.index, "update")
        if state.sharded is None:
            state.optimizer.step()
            if dies:
                state.die()
            return True
        try:
            state.sharded.step(self.membership.pg, self.membership.wait,
                               state.die if dies else None)
            return True
        except Aborted as exc:
            log.warning("step %d's parameter broadcast aborted: %s", step.index, exc)
            self.membership.give_up(step.index, exc)
            return False

    def _generation_number(self) -> int:
        generation = self.membership.generation
        return generation.generation if generation is not None else 0

    def record_batch(self, step: Step) -> None:
        """The record's line of what ``step`` trained on (before its gradients leave)."""
        record, group = self.state.record, self.state.group
        if record is not None:
            record.write(
                kind="batch", step=step.index, generation=self._generation_number(),
                rank=self.membership.rank, world_size=self.membership.world_size,
                indices=step.indices if group is None or group.records_data else [],
                loss=float(step.local_metrics()[0]) if step.loss_given else None,
                kept=0 if step.kept is None else len(step.kept.indices))

    def committed(self, step: Step, now: float) -> None:
        """``step`` is committed (its optimizer step applied at ``now``). What the script
        does after ``commit()`` returns (a scheduler's step, an EMA's update, a counter) is
        part of the step too, so the step is snapshotted, recorded and reported at the
        *boundary*: when the script next asks for a step, the loop ends, or the session is
        closed (:meth:`finish_commit`)."""
        state = self.state
        state.buffers.end()
        state.committed = step.index + 1
        step_before, previous = state.last_step_s, self._last_commit_at
        state.last_step_s, self._last_commit_at = now - step.started, now
        self._boundary = (step, now, step_before, previous)

    def forget_boundary(self) -> None:
        """The script failed after its last commit: no boundary to keep (nothing snapshots
        or reports a step whose post-commit code did not complete)."""
        self._boundary = None

    def finish_commit(self) -> None:
        """At the boundary after a committed step: record it, snapshot the whole training
        state (the model, the optimizer and every registered object as the script left
        them), report. The snapshot comes before the report: a step reported committed is
        in memory. The record comes first: a rank stopped between the two had committed
        the step all the same, and a record without it showed a step that a restore from
        that snapshot resumed after as never trained (a cluster stopped under the job)."""
        if self._boundary is None:
            return
        state, membership = self.state, self.membership
        step, now, step_before, previous = self._boundary
        self._boundary = None
        if state.record is not None:
            digest = state.buffers.digest()
            state.record.write(kind="commit", step=step.index,
                                  generation=self._generation_number(), rank=membership.rank,
                                  **step.timings(now),
                                  **({} if step.updated else {"skipped": True}),
                                  **({} if digest is None else {"buffers": digest}))
        extra: dict[str, Any] = {}
        snapshots = state.snapshots
        if snapshots is not None:
            snapshot_s = None
            if snapshots.due(state.committed):
                # A member's.
                assert membership.generation is not None and membership.rank is not None
                if snapshots.take(state.model, state.optimizer_state, state.carried,
                                  state.committed, membership.generation.generation,
                                  membership.rank, membership.world_size):
                    snapshot_s = extra["snapshot_s"] = snapshots.last_copy_s
            # The interval the members agreed on in this step (bench/snapshot.py reads both).
            extra["snapshot_every"] = snapshots.schedule.interval
            snapshots.schedule.measured(
                state.last_step_s, None if snapshots.last_was_first else snapshot_s,
                taken=snapshot_s is not None)
        if state.record is not None and extra:
            state.record.write(kind="snapshot", step=step.index, **extra)
        if state.reporter is not None:
            state.reporter.report(state.committed, state.last_step_s,
                                     final=state.committed == state.total_steps)
        applied = membership.take_applied()
        if applied is not None and state.bus is not None and state.speaks:
            # What the change cost this member: the gap between its commits around it,
            # beyond the step it took before (a joiner had no commit before it).
            pause = None if previous is None else max(0.0, now - previous - step_before)
            applied = msgspec.structs.replace(applied, committed_step=state.committed,
                                              pause_s=pause)
            state.bus.publish_event(
                subjects.generation_applied(state.replica.job_id), applied,
                state.replica.event_id(f"g{applied.generation}-applied"))

"""Recovery planning: what the members of a new generation do before their first step.

After a membership change every member contributes one row to an all-reduce:
the step it has committed up to, and, if its last all-reduce was aborted,
which step it kept a gradient for and the generation that attempted it
(:class:`MemberProgress`). From the same rows,
:func:`plan_recovery` makes every member decide the same thing:

* **Resume step**: the highest step any member committed. A member behind it
  (a joiner, a survivor whose all-reduce was aborted while another's
  completed) receives the state of the lowest rank that holds it (the
  *source*). In generation 0 every member receives rank 0's state, as DDP
  starts every rank from rank 0's parameters.
* **Repair**: if nobody committed the resume step and members kept gradients
  of it from one and the same attempt, those gradients count: only the samples
  no kept gradient covers (the dead ranks' shares, and those of survivors that
  had not reached the all-reduce) are computed again, dealt over every member
  (:meth:`~.data.ElasticOrder.repair_plan`). Which samples are covered is
  counted from the kept gradients' own samples, not from the attempt's ranks:
  an attempt may have dealt its batch otherwise (members sat it out, or it was
  itself a repair).
* **Sitting out**: otherwise, when a join makes some members copy state, the
  ranks that send or receive sit the first step out and the others share its
  batch, so the survivors do not wait for the copy before computing.
* **State lost**: if no member holds the step the job has reached (or every
  copy was cut short), training on would redo committed steps or start over
  silently; that is refused (:class:`StateLost`). The session first tries the
  checkpoint tiers, and only when none holds the step either does it lower the
  step asked for to the newest left, saying so (``ElasticSession._state_lost``).

Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phalanx.schemas.environment import EXIT_STATE_LOST

if TYPE_CHECKING:  # carried, never computed on, here
    import torch

    from phalanx.schemas.messages import Generation


class StateLost(RuntimeError):
    """No member holds the state the job has reached: in-process recovery is impossible.

    ``retry``: whether a later generation may still find it (a lost node's memory, its
    agent back; a holder that was unreachable): the rank then exits
    :data:`~phalanx.schemas.environment.EXIT_STATE_LOST`, a failure health retries.
    Not when nothing could ever hold it (a sharded optimizer without snapshots).
    """

    def __init__(self, message: str, *, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry

    @property
    def exit_status(self) -> int | None:
        """The status the rank exits with, uncaught: a failure to retry, or None (1)."""
        return EXIT_STATE_LOST if self.retry else None


@dataclasses.dataclass(frozen=True)
class Retained:
    """A step's local gradient kept when its all-reduce was aborted: a repair of the step
    in the next generation counts it instead of computing its samples again."""

    step: int
    generation: Generation  # the one the step was attempted in
    gradient: torch.Tensor  # this rank's summed share, not yet all-reduced
    indices: list[int]  # the samples it covers
    metrics: torch.Tensor  # their share of the loss and of the script's metrics (float64)


@dataclasses.dataclass(frozen=True)
class MemberProgress:
    """One member's row of the recovery all-reduce.

    ``committed`` is -1 on a member whose state copy was cut short (it holds no
    step). The ``kept_*`` fields are -1 unless the member kept the gradient of an
    aborted step: that step, and the generation it was attempted in.
    """

    committed: int
    kept_step: int = -1
    kept_generation: int = -1

    def row(self) -> list[int]:
        return [self.committed, self.kept_step, self.kept_generation]


@dataclasses.dataclass(frozen=True)
class Repair:
    """Re-run step ``step`` counting the gradients kept from its attempt in ``generation``:
    only the samples they do not cover are computed again."""

    step: int
    generation: int


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What every member of the generation does before its first step.

    ``behind`` receive the state of ``source`` (step ``resume``); ``repair`` is the
    repaired first step, if any; ``sitting_out`` is, if not None, the ranks that
    compute the first step (the others copy state meanwhile).
    """

    resume: int
    source: int
    behind: tuple[int, ...]
    repair: Repair | None
    sitting_out: tuple[int, ...] | None


def plan_recovery(members: Sequence[MemberProgress], generation: int,
                  job_resume_step: int = 0, *, restored: bool = False) -> RecoveryPlan:
    """The recovery every member of ``generation`` agrees on from the same rows.

    Args:
        members: one row per rank of the generation, in rank order.
        generation: the generation's number (0: everyone starts from rank 0's state).
        job_resume_step: the step the job is known to have reached (the generation's
            ``resume_step``); the members must hold at least that.
        restored: every member has just loaded the same step from a checkpoint tier
            (the rows say so): nobody copies it, not even in generation 0 — a sharded
            optimizer's members loaded only their partitions and could not send more.

    Raises:
        StateLost: no member holds a complete state, or none holds ``job_resume_step``.
    """
    steps = [m.committed for m in members]
    resume = max(steps)
    if resume < 0:
        raise StateLost("no member holds a complete state: every copy was cut short (the "
                        "checkpoint tier is needed to recover)")
    if resume < job_resume_step:
        # Every replica that held the job's progress is gone: training again from an
        # older step would redo committed steps (and from step 0, silently).
        raise StateLost(
            f"no member of generation {generation} holds step {job_resume_step}, which the "
            f"job has reached (they hold up to {resume}): its state is lost (the "
            "checkpoint tier is needed to recover)")
    source = steps.index(resume)
    repair = _repair(members, resume)
    behind = tuple(r for r, step in enumerate(steps)
                   if r != source and (step < resume or (generation == 0 and not restored)))
    active = tuple(r for r in range(len(members)) if r != source and r not in behind)
    sitting_out = active if behind and active and repair is None and generation > 0 \
        else None
    return RecoveryPlan(resume, source, behind, repair, sitting_out)


def _repair(members: Sequence[MemberProgress], resume: int) -> Repair | None:
    attempts = {m.kept_generation for m in members if m.kept_step == resume}
    if len(attempts) != 1:
        return None  # nothing kept for the step to run (or kept from different tries)
    return Repair(resume, attempts.pop())

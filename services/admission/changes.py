"""A running elastic gang's size changes: announced, and a planned one followed to done or
abandoned. Pure.

Admission changes a running elastic gang's size by growth into free slots, a shrink by
preemption or reclaim, an operator's pin (:mod:`.core`), or a node lost. Each change is
*announced* (:class:`Announce`: the shell publishes a
:class:`~phalanx.schemas.messages.ScalingEvent` and opens a span), and so are pins and
their release.

A change admission makes on purpose to a gang whose runtime has reported a membership is
*planned* (:class:`~phalanx.schemas.messages.ScalingChange`, kept in the job record): it
is done when elasticity publishes a generation of the new size (its members switch to it at
their next step boundary; for a leave that comes at once, the leavers finishing their step
after it) and abandoned when it is not done by its deadline,
``scaling.scaling_timeout_s`` after it began. Abandoning a growth gives back the slots
its new replicas never joined in: the gang shrinks back to its size before (the core does
that, and the cooldown then holds the next growth back; a later one starts with fresh
replicas). A shrink has given its slots away already, and its agents stop a leaver that
overstays ``graceful_shutdown_timeout_s``, so an abandoned shrink is only reported.

Not tracked, only announced: a shrink by a node lost (its members' faults are health's
business, not a plan), and any change of a gang whose runtime has reported no membership
(a job not under the runtime has no generations; its size is its processes). A change to
the size the runtime already runs at is done at once; a later change replaces one in
progress.
"""

from __future__ import annotations

import dataclasses

from phalanx.schemas.messages import ScalingChange, ScalingEventKind

GROW, SHRINK = ScalingEventKind.GROW, ScalingEventKind.SHRINK


@dataclasses.dataclass(frozen=True)
class Announce:
    """Announce a scaling event of ``job_id`` (a ScalingEvent on the bus and a span)."""

    job_id: str
    kind: ScalingEventKind
    from_replicas: int
    to_replicas: int
    reason: str
    deadline: float | None = None
    cause: str = ""


def begin(job_id: str, kind: ScalingEventKind, before: int, after: int, reason: str, *,
          planned: bool, world_size: int | None, timeout_s: float, now: float,
          cause: str = "") -> tuple[ScalingChange | None, list[Announce]]:
    """A gang went from ``before`` to ``after`` replicas: the change now in progress (None:
    none to follow) and what to announce.

    Args:
        planned: admission changed the size on purpose (not a node lost).
        world_size: the size the job's runtime last reported (None: none yet).
        timeout_s: the job's ``scaling.scaling_timeout_s``.
    """
    tracked = planned and world_size is not None
    deadline = now + timeout_s if tracked else None
    announced = [Announce(job_id, kind, before, after, reason, deadline, cause)]
    if not tracked:
        return None, announced
    change = ScalingChange(kind=kind, from_replicas=before, to_replicas=after, reason=reason,
                           started_at=now, deadline=now + timeout_s)
    if world_size == after:
        return None, [*announced, done(job_id, change, cause)]
    return change, announced


def applied(job_id: str, change: ScalingChange | None, world_size: int | None,
            cause: str = "") -> tuple[ScalingChange | None, list[Announce]]:
    """The job's runtime now runs at ``world_size``: the change left in progress, and a
    done announcement when that was its size."""
    if change is None or world_size != change.to_replicas:
        return change, []
    return None, [done(job_id, change, cause)]


def done(job_id: str, change: ScalingChange, cause: str = "") -> Announce:
    return Announce(job_id, ScalingEventKind.DONE, change.from_replicas, change.to_replicas,
                    f"runs at {change.to_replicas} replica(s) ({change.reason})",
                    change.deadline, cause)


def overdue(change: ScalingChange | None, now: float) -> bool:
    """Whether ``change`` is past its deadline at ``now``."""
    return change is not None and now >= change.deadline


def abandoned(job_id: str, change: ScalingChange, timeout_s: float,
              cause: str = "") -> Announce:
    """The announcement of ``change`` abandoned at its deadline."""
    what = "growth" if change.kind is GROW else "shrink"
    back = f"; back to {change.from_replicas}" if change.kind is GROW else ""
    return Announce(job_id, ScalingEventKind.TIMEOUT, change.from_replicas,
                    change.to_replicas,
                    f"{what} from {change.from_replicas} to {change.to_replicas} replica(s) "
                    f"not done within scaling_timeout_s = {timeout_s:g} s ({change.reason})"
                    f"{back}", change.deadline, cause)

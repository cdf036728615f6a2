"""The admission core's vocabulary: the events it takes, the decisions it returns, and the
reason every decision and every waiting gang carries. Pure data, no rules.

Events are what the service saw (a job submitted, ended or requeued, a node changed or
removed, an operator's pin, a runtime's membership); decisions are what it must carry out
(admit, shrink, grow, evict, fail, announce a scaling event). Each decision's ``cause`` is
the id of the event (or ``pass-<n>``, ``timeout``, ``scaling-timeout``) that forced it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from phalanx.schemas.messages import JobSpec, ReasonCode, ScalingChange
from phalanx.services.admission.changes import Announce


class Reason:
    """A reason code and the one-line message a user sees.

    The message may be given as a function: a pass sets a reason on every gang it
    looks at, but only the few that are read (explain, persisted) get rendered.
    """

    __slots__ = ("_message", "code")

    def __init__(self, code: ReasonCode, message: str | Callable[[], str]) -> None:
        self.code = code
        self._message = message

    @property
    def message(self) -> str:
        if not isinstance(self._message, str):
            self._message = self._message()
        return self._message

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Reason) and self.code is other.code
                and self.message == other.message)

    def __hash__(self) -> int:
        return hash((self.code, self.message))

    def __repr__(self) -> str:
        return f"Reason({self.code.value!r}, {self.message!r})"



# --- events --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class JobSubmitted:
    job_id: str
    spec: JobSpec
    submitted_at: float
    event_id: str = ""
    pinned_replicas: int | None = None  # an operator's pin, kept in the job record
    change: ScalingChange | None = None  # a planned change in progress, kept there too


@dataclasses.dataclass(frozen=True)
class ScalePinned:
    """An operator pins a job to ``replicas`` (None: releases the pin). Check it with
    :meth:`AdmissionCore.pin_problem` first."""

    job_id: str
    replicas: int | None
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class MembershipChanged:
    """The job's runtime runs at ``world_size`` replicas now (elasticity published a
    generation of that size; None: it has no generation, e.g. it stopped)."""

    job_id: str
    world_size: int | None
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobCancelled:
    job_id: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobFinished:
    job_id: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobFailed:
    """Health ended the job ``failed`` (its failures are past its restart policy)."""

    job_id: str
    reason_code: ReasonCode
    reason: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class JobRequeued:
    """The running gang lost too many members to go on (elasticity): back to the queue."""

    job_id: str
    reason: str
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class NodeUpdated:
    """A node joined, changed, was cordoned/uncordoned, or was found lost (``alive=False``)."""

    node_id: str
    slots: int
    failure_domain: str
    labels: dict[str, str]
    alive: bool = True
    cordoned: bool = False
    event_id: str = ""


@dataclasses.dataclass(frozen=True)
class NodeRemoved:
    node_id: str
    event_id: str = ""


Event = (JobSubmitted | JobCancelled | JobFinished | JobFailed | JobRequeued | NodeUpdated
         | NodeRemoved | ScalePinned | MembershipChanged)


# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Admit:
    """Run the gang with one replica on each listed node (a node may repeat)."""

    job_id: str
    nodes: tuple[str, ...]
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Keep only the listed replicas' nodes (an elastic gang gives slots back)."""

    job_id: str
    nodes: tuple[str, ...]
    reason: Reason
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Evict:
    """Stop the whole gang; back to the queue if ``requeue``, else it is over."""

    job_id: str
    reason: Reason
    requeue: bool
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Fail:
    """The gang will not run: its final reason."""

    job_id: str
    reason: Reason
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Grow:
    """A running elastic gang gets more replicas: it now runs one on each listed node."""

    job_id: str
    nodes: tuple[str, ...]
    cause: str = ""


Decision = Admit | Shrink | Grow | Evict | Fail | Announce

"""Gang admission rules: who runs, where, and why the rest wait. Pure.

:meth:`AdmissionCore.schedule` applies the rules in one pass over the queue, numbered as
the modules cite them (1 order, 2 all or nothing, 3 quota, 4 preemption, 5 reservation
and backfill, 6 elastic growth, 7 timeouts, 8 pins, 9 scaling events); docs/admission.md,
"Rules", writes them out. The core is synchronous, takes ``now`` as an argument, and
never reads a clock or does I/O; the service persists its decisions.

The rules live one concept a module over one model (:class:`~.model.AdmissionState`):
:mod:`.events` (what comes in and goes out), :mod:`.model` (gangs, nodes, the queue,
the allocation and its indexes), :mod:`.lifecycle` (what each event does, and
:meth:`~AdmissionCore.validate`), :mod:`.scheduling` (the pass: rules 1-3 and 5-7),
:mod:`.placement` (where replicas go: rules 2, 5 and 6), :mod:`.preemption` (rule 4),
:mod:`.changes` (rule 9), :mod:`.explain` (the reasons); :class:`AdmissionCore` is their
entry point.
"""

from __future__ import annotations

from collections.abc import Iterable

from phalanx.schemas.messages import JobSpec
from phalanx.services.admission import explain, lifecycle, scheduling
from phalanx.services.admission.events import (
    Admit,
    Decision,
    Event,
    Evict,
    Fail,
    Grow,
    JobCancelled,
    JobFailed,
    JobFinished,
    JobRequeued,
    JobSubmitted,
    MembershipChanged,
    NodeRemoved,
    NodeUpdated,
    Reason,
    ScalePinned,
    Shrink,
)
from phalanx.services.admission.lifecycle import SpecRejected
from phalanx.services.admission.model import (
    AdmissionState,
    Capacity,
    Gang,
    Node,
    Shape,
    admission_number,
    carry_slots,
)
from phalanx.services.admission.policy import AdmissionPolicy

# The names the core has always offered, wherever they are defined now.
__all__ = [
    "AdmissionCore", "AdmissionState", "Admit", "Capacity", "Decision", "Event", "Evict",
    "Fail", "Gang", "Grow", "JobCancelled", "JobFailed", "JobFinished", "JobRequeued",
    "JobSubmitted", "MembershipChanged", "Node", "NodeRemoved", "NodeUpdated", "Reason",
    "ScalePinned", "Shape", "Shrink", "SpecRejected", "admission_number", "carry_slots",
]


class AdmissionCore:
    """The admission state machine. Feed events with :meth:`handle`, run :meth:`schedule`.

    It holds the model (:attr:`state`) and hands each call to the module of its rules.
    """

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.state = AdmissionState(policy)

    # What the service and tests read of the model.

    @property
    def policy(self) -> AdmissionPolicy:
        return self.state.policy

    @property
    def gangs(self) -> dict[str, Gang]:
        """Every job it was told of, by id, whatever its state."""
        return self.state.gangs

    @property
    def nodes(self) -> dict[str, Node]:
        return self.state.nodes

    @property
    def queue(self) -> list[Gang]:
        """The pending gangs, in admission order."""
        return self.state.queue

    @property
    def running(self) -> dict[str, Gang]:
        """The admitted gangs, by job id."""
        return self.state.running

    @property
    def usage(self) -> dict[str, int]:
        """Slots held, by team."""
        return self.state.usage

    @property
    def pass_no(self) -> int:
        """The number of the last admission pass (0: none yet)."""
        return self.state.pass_no

    # Events.

    def validate(self, spec: JobSpec, registered: Capacity | None = None) -> None:
        """Refuse a spec that names an unknown class or could never fit this cluster
        (:func:`.lifecycle.validate`; ``registered``: the registry's nodes, None: this
        core's).

        Raises:
            SpecRejected: naming the field and the numbers.
        """
        lifecycle.validate(self.state, spec, registered)

    def handle(self, event: Event, now: float) -> list[Decision]:
        """Apply one event; returns the decisions it forces at once (not an admission pass)."""
        return lifecycle.handle(self.state, event, now)

    def pin_problem(self, job_id: str, replicas: int | None) -> str | None:
        """Why ``job_id`` cannot be pinned to ``replicas`` now (None: it can).

        Raises:
            KeyError: unknown job.
        """
        return lifecycle.pin_problem(self.state, job_id, replicas)

    def restore(self, event: JobSubmitted, nodes: list[str],
                now: float = 0.0) -> list[Decision]:
        """Rebuild a gang the ledger says runs on ``nodes`` (a new leader loading state).

        Call after the nodes are known. A gang whose nodes are gone, lost or now too
        small goes back to the queue (returned as an :class:`Evict`).
        """
        return lifecycle.restore(self.state, event, nodes, now)

    def expire(self, now: float) -> list[Decision]:
        """Fail pending gangs that waited longer than their ``schedule_timeout_s``."""
        return scheduling.expire(self.state, now)

    # The admission pass.

    def schedule(self, now: float) -> list[Decision]:
        """One admission pass over the queue (see the module docstring for the rules)."""
        return scheduling.schedule(self.state, now)

    def step(self, events: Iterable[Event], now: float) -> list[Decision]:
        """Apply ``events`` then run one pass: what the service does per batch."""
        decisions: list[Decision] = []
        for event in events:
            decisions += self.handle(event, now)
        return decisions + self.schedule(now)

    # Explanations.

    def explain(self, job_id: str) -> Reason:
        """Why ``job_id`` is where it is, with its queue position if pending.

        Raises:
            KeyError: unknown job.
        """
        return explain.explain(self.state, job_id)

    def position(self, job_id: str) -> int | None:
        """1-based place of a pending job in the queue; None if it is not pending."""
        return explain.position(self.state, job_id)

    def check_invariants(self) -> None:
        """Assert the state is consistent (used by tests after every step)."""
        self.state.check_invariants()

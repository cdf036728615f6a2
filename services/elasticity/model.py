"""The elasticity core's model: one job's membership and its replicas. Pure.

:class:`JobMembership` is everything the rules know of one running job: its placement
(slots), the replicas launched, ready and members, the ``current`` generation and what
is pending for the next one, the replacement budget and the history; its
:attr:`~JobMembership.phase` names what it is doing (:mod:`.phase`). The rules are
:mod:`.gang` (before the first ready replica) and :mod:`.generations` (after it).
"""

from __future__ import annotations

import dataclasses

from phalanx.schemas.messages import Generation, GenerationRecord
from phalanx.services.elasticity.events import LaunchReplacement, MemberFailed
from phalanx.services.elasticity.phase import Phase


@dataclasses.dataclass(frozen=True)
class Replica:
    replica_id: str
    slot: int
    node_id: str
    endpoint: str = ""


@dataclasses.dataclass
class JobMembership:
    job_id: str
    min_members: int
    max_members: int
    slots: dict[int, str]  # slot -> node
    replacements_left: int
    admission: int = 0  # which admission of the job this membership is (0: not known)
    current: Generation | None = None  # None until generation 0 forms
    replacement_budget: int | None = None  # replacements_left again after progress
    replicas: dict[str, Replica] = dataclasses.field(default_factory=dict)  # members + ready
    launched: dict[str, int] = dataclasses.field(default_factory=dict)  # not yet ready: slot
    forming: set[str] = dataclasses.field(default_factory=set)  # generation 0 waits for these
    incarnation: dict[int, int] = dataclasses.field(default_factory=dict)  # slot -> latest
    applied: set[str] = dataclasses.field(default_factory=set)  # members done with current
    committed: dict[str, int] = dataclasses.field(default_factory=dict)  # replica -> step
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # folded: replica -> why
    ready: list[str] = dataclasses.field(default_factory=list)  # folded joiners, in order
    waiting_since: float | None = None  # below min since
    complete: bool = False  # a member finished the training
    to_launch: list[LaunchReplacement] = dataclasses.field(default_factory=list)
    high_water: int = 0  # the highest step any member ever reported committed
    managed: bool = False  # a replica reported ready: the job uses the runtime
    early_faults: list[MemberFailed] = dataclasses.field(default_factory=list)  # before that
    leaving: list[str] = dataclasses.field(default_factory=list)  # members whose slot is gone
    departing: list[str] = dataclasses.field(default_factory=list)  # left in current, unapplied
    sizes: list[int] = dataclasses.field(default_factory=list)  # allowed sizes (empty: all)
    history: list[GenerationRecord] = dataclasses.field(default_factory=list)  # latest last
    # Ready replacements that came from a warm spare: they join without waiting for the
    # change in flight (only a spare can be ready while one is: cold launches wait).
    warm_ready: list[str] = dataclasses.field(default_factory=list)
    gather_since: float | None = None  # no survivor holds the state: replacements awaited
    replaced: int = 0  # replacements launched
    # Why a member gave the current generation up ("": none did); it is decided again.
    given_up: str = ""
    session: bool = False  # the spec declares a session: never a torchrun gang
    gang_round: int = 0  # not managed yet: the incarnation the gang runs in every slot

    # The current generation's replica ids, by rank, and as a set: made once per
    # generation (a job of 16,384 members asked for them several times an event).
    _ids: tuple[Generation | None, tuple[str, ...], frozenset[str]] = dataclasses.field(
        default=(None, (), frozenset()), repr=False, compare=False)

    def _member_ids(self) -> tuple[tuple[str, ...], frozenset[str]]:
        if self._ids[0] is not self.current:
            ids = () if self.current is None else tuple(
                m.replica_id for m in self.current.members)
            self._ids = (self.current, ids, frozenset(ids))
        return self._ids[1], self._ids[2]

    @property
    def members(self) -> list[str]:
        """The current generation's members' replica ids, by rank."""
        return list(self._member_ids()[0])

    @property
    def member_set(self) -> frozenset[str]:
        """The current generation's members' replica ids."""
        return self._member_ids()[1]

    @property
    def in_flight(self) -> bool:
        members = self.member_set
        # ``applied`` holds members only: fewer of them than members is in flight.
        return len(self.applied) < len(members) or not members <= self.applied

    @property
    def phase(self) -> Phase:
        """What the membership is doing (the first of :class:`~.phase.Phase`'s that
        applies: a job below ``min`` that also gathers is waiting)."""
        if self.complete:
            return Phase.COMPLETE
        if not self.managed:
            return Phase.GANG
        if self.waiting_since is not None:
            return Phase.WAITING
        if self.gather_since is not None:
            return Phase.GATHERING
        if self.current is None:
            return Phase.FORMING
        return Phase.IN_FLIGHT if self.in_flight else Phase.TRAINING

    def check_invariants(self) -> None:
        """Assert the membership is consistent (used by tests after every step)."""
        members = self.members
        assert len(set(members)) == len(members), "a replica is a member twice"
        assert not set(self.ready) & set(members), "a member is also waiting to join"
        assert not set(self.launched) & set(self.replicas), "launched and ready at once"
        assert self.complete or set(self.ready) | set(members) == set(self.replicas), \
            "replica bookkeeping"
        assert len(members) <= self.max_members, "above max"
        assert set(self.leaving) <= set(members), "a leaver that is not a member"
        assert not set(self.departing) & set(members), "a departed replica is a member"
        assert not self.given_up or self.phase is not Phase.TRAINING, \
            "a generation given up is trained in"
        live = [r for r in members if r not in self.failed] + self.ready
        slots = [self.replicas[r].slot for r in live] + list(self.launched.values())
        assert len(slots) == len(set(slots)), "two replicas in one slot"
        if self.current is not None:
            assert self.current.world_size == len(members)
            assert len(members) >= self.min_members or self.current.generation == 0, \
                "a generation below min"
        elif self.managed:  # FORMING means what it says: generation 0 awaits replicas
            assert self.forming or self.waiting_since is not None, \
                "no generation, and none awaited"


def slot_of(replica: str) -> tuple[int, int]:
    """``r<slot>-<incarnation>`` -> (slot, incarnation)."""
    slot, _, incarnation = replica.removeprefix("r").partition("-")
    return int(slot), int(incarnation)

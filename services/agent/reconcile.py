"""Which of a job's ranks this node starts, stops, lets leave or keeps, and where: pure.

The shell (:class:`~phalanx.services.agent.ranks.RankSet`) hands these rules plain data
about one job — its record, the ranks of it running here and the replica last launched in
each of its slots here (each a :class:`Launch`, by slot) — and carries out the decisions
they return, in their order. The rules read no clock and start no process, so they are
tested as torch elastic tests its agent: with no processes at all.

**Following the record** (:func:`reconcile`). Rank (slot) ``s`` of a job runs on the
node its admitted record places slot ``s`` on; a record that is not admitted (pending
again, cancelled, finished) places nothing.

1. A record that places more here than the node has slots (a replica of several ranks
   takes all their slots, ``JobSpec.slots_per_group``) is refused whole
   (:attr:`Refusal.TOO_LARGE`): admission never does so, so it is not admission's (or is
   corrupt), and running it would oversubscribe the node.
2. A running rank whose slot the record no longer places here is stopped
   (:class:`Stop`), except in an elastic job still admitted (a planned shrink), where
   it first gets to leave by itself (:class:`Leave`, within the spec's
   ``scaling.graceful_shutdown_timeout_s``). A torchrun-style job (not elastic: no
   generation) is one gang: when its placement changes, every rank launched for
   another placement is stopped, and its slots start again with the new world.
3. What was launched in such a slot is forgotten (:class:`Forget`), so that the record
   that places the slot here again starts it again.
4. A slot the record places here with nothing launched in it starts its first replica,
   ``r<slot>-0`` (:class:`Start`); in an elastic job that is a slot it grew into, whose
   replica joins the running members.

A job gone from the bus (its record deleted) stops every rank and forgets every launch
(:func:`drop`). Ranks are stopped in the order given, before anything starts.

**Launch requests** (:func:`replacement`, elasticity's ``LaunchReplica``). A replica
(``r<slot>-<incarnation>``) is launched at most once per node: :func:`launch_verdict`
answers a request for a slot from the replica last launched there. The same replica
again is *already launched* — a retried or re-sent request (elasticity re-sends its
launches after a restart: at least once), never a second process, even if the first has
exited (:class:`Keep`); an older incarnation than the last is refused
(:attr:`Refusal.OUTDATED`), since a newer one has already replaced it; a slot not placed
here is refused (:attr:`Refusal.NOT_PLACED_HERE`). Otherwise what runs in the slot is
stopped and the replica started. A stop request stops the replica it names only if that
is what runs in the slot (:func:`stop_request`).

**Where a replica starts** (:func:`slots_for`): in the lowest slots of the node that no
rank holds and no cordon takes out of use. When there are not enough, it waits for an
exit if a rank here is stopping (however long its grace period is); it gives up if only
cordons are in the way (admission has not yet heard of them); otherwise every slot is
held by ranks of jobs admission has moved off this node, whose records this agent has
not applied yet (:attr:`SlotWait.MOVED`: the shell waits a bounded time for one to go).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterable, Mapping

from phalanx.schemas.messages import JobRecord, JobState
from phalanx.schemas.replicas import earlier, replica_id


@dataclasses.dataclass(frozen=True)
class Launch:
    """A replica launched in one of a job's slots here, and the job's placement (its
    nodes, by slot) it was launched for."""

    replica_id: str
    placement: tuple[str, ...]


# --- decisions -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Start:
    """Start ``replica_id`` in ``slot``, for the job's ``placement``."""

    slot: int
    replica_id: str
    placement: tuple[str, ...]
    elastic: bool = False
    """It joins an elastic job's running members: it may be a warm spare of the job, is a
    world of its own, and starts niced until ready. False: one of a torchrun-style gang."""
    warm_only: bool = False
    """Only from a warm spare of the job: with none here, nothing starts (or stops)."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Stop the rank in ``slot`` now (its job's grace period applies); its exit is
    reported stopped."""

    slot: int
    replica_id: str


@dataclasses.dataclass(frozen=True)
class Leave:
    """Let the rank in ``slot`` leave by itself (its runtime finishes its step and exits),
    and stop it if it is still there after ``timeout_s``."""

    slot: int
    replica_id: str
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class Forget:
    """Forget what was launched in ``slots``: their records may start them afresh."""

    slots: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Keep:
    """Start nothing: ``replica_id`` was launched in ``slot`` already (``running``: and it
    still runs there)."""

    slot: int
    replica_id: str
    running: bool


class Refusal(enum.Enum):
    """Why a record or a launch request is not carried out here."""

    TOO_LARGE = "too large"
    """The record places more slots here than the node has."""
    NOT_PLACED_HERE = "not placed here"
    """The job is not admitted with the slot asked for on this node."""
    OUTDATED = "outdated"
    """A newer incarnation than the replica asked for was launched in the slot."""


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Do nothing of it, for ``reason`` (``message`` says it with the numbers)."""

    reason: Refusal
    message: str


Decision = Start | Stop | Leave | Forget | Keep | Refuse


# --- which replica a slot may run ----------------------------------------------------------


class LaunchVerdict(enum.Enum):
    """What a launch request for a slot gets, given the replica last launched there."""

    LAUNCH = "launch"
    """Nothing launched there yet, or a newer incarnation: start it."""
    ALREADY_LAUNCHED = "already launched"
    """This very replica was launched there before (it may have exited): not again."""
    OUTDATED = "outdated"
    """An older incarnation than the one last launched there: refused."""


def first_replica(slot: int) -> str:
    """The replica an admitted slot starts with."""
    return replica_id(slot, 0)


def launch_verdict(last: str | None, wanted: str) -> LaunchVerdict:
    """May ``wanted`` start in a slot whose last launched replica is ``last``?

    Names that carry no incarnation are only told apart by equality.
    """
    if last is None:
        return LaunchVerdict.LAUNCH
    if wanted == last:
        return LaunchVerdict.ALREADY_LAUNCHED
    return LaunchVerdict.OUTDATED if earlier(wanted, last) else LaunchVerdict.LAUNCH


# --- the rules -----------------------------------------------------------------------------


def reconcile(record: JobRecord, node_id: str, running: Mapping[int, Launch],
              launched: Mapping[int, Launch], *, elastic: bool = False,
              capacity: int | None = None) -> list[Decision]:
    """What makes node ``node_id`` run exactly the ranks ``record`` places on it.

    Args:
        running: slot -> the rank of the job running (or stopping) here, in the order
            they are to be stopped.
        launched: slot -> the replica last launched in it here, running or not.
        elastic: the job's membership is managed by elasticity (it has a generation), so
            a rank keeps running as long as its slot stays here, whatever else the
            placement does.
        capacity: the node's slots (None: unbounded).

    Returns:
        A :class:`Refuse` alone; or every :class:`Stop` and :class:`Leave`, then at
        most one :class:`Forget`, then each :class:`Start` in slot order.
    """
    placement = tuple(record.nodes) if record.state is JobState.ADMITTED else ()
    wanted = {slot for slot, node in record.placement().items() if node == node_id}
    per_replica = record.spec.slots_per_group  # all of a group's ranks' slots
    if capacity is not None and len(wanted) * per_replica > capacity:
        return [Refuse(Refusal.TOO_LARGE,
                       f"{record.job_id} places {len(wanted)} replicas of {per_replica} "
                       f"slots on {node_id}, which has {capacity}")]
    # A shrink, not an end: what is let go leaves by itself first.
    leave_s = record.spec.scaling.graceful_shutdown_timeout_s if elastic and placement \
        else None
    return _converge(wanted, placement, running, launched, elastic=elastic, leave_s=leave_s)


def drop(running: Mapping[int, Launch], launched: Mapping[int, Launch]) -> list[Decision]:
    """What ends a job that is gone (its record deleted) here: every rank of it stopped,
    every launch forgotten."""
    return _converge(set(), (), running, launched, elastic=False, leave_s=None)


def _converge(wanted: Collection[int], placement: tuple[str, ...],
              running: Mapping[int, Launch], launched: Mapping[int, Launch], *,
              elastic: bool, leave_s: float | None) -> list[Decision]:
    """The decisions that leave the job's ``wanted`` slots here, and only them, running
    replicas launched for ``placement`` (for any placement, if ``elastic``)."""

    def outdated(slot: int, launch: Launch) -> bool:
        return slot not in wanted or (not elastic and launch.placement != placement)

    decisions: list[Decision] = [
        Stop(slot, rank.replica_id) if leave_s is None
        else Leave(slot, rank.replica_id, leave_s)
        for slot, rank in running.items() if outdated(slot, rank)]
    gone = tuple(slot for slot, launch in launched.items() if outdated(slot, launch))
    if gone:
        decisions.append(Forget(gone))
    decisions += [Start(slot, first_replica(slot), placement, elastic=elastic)
                  for slot in sorted(wanted) if slot not in launched or slot in gone]
    return decisions


def replacement(record: JobRecord, node_id: str, slot: int, replica: str,
                running: Launch | None, last: Launch | None, *, gang: bool = False,
                warm_only: bool = False) -> list[Decision]:
    """What a request to run ``replica`` in ``slot`` of ``record``'s job on ``node_id``
    gets.

    Args:
        running: the rank of the slot running here (None: none).
        last: the replica last launched in the slot here, running or not (None: none).
        gang: the slot's part of a restart of a torchrun-style job's whole gang: a new
            process with the gang's variables.
        warm_only: start it only from a warm spare of the job.

    Returns:
        A :class:`Refuse` or a :class:`Keep` alone; or a :class:`Stop` of what runs in
        the slot, if anything does, then the :class:`Start`.
    """
    if record.placement().get(slot) != node_id:
        return [Refuse(Refusal.NOT_PLACED_HERE,
                       f"slot {slot} of {record.job_id} is not placed on {node_id}")]
    match launch_verdict(last.replica_id if last is not None else None, replica):
        case LaunchVerdict.ALREADY_LAUNCHED:
            return [Keep(slot, replica, running is not None and running.replica_id == replica)]
        case LaunchVerdict.OUTDATED:
            assert last is not None
            return [Refuse(Refusal.OUTDATED,
                           f"{replica} is older than {last.replica_id}, launched in slot "
                           f"{slot} of {record.job_id} already")]
    stop: list[Decision] = [] if running is None else [Stop(slot, running.replica_id)]
    return [*stop, Start(slot, replica, tuple(record.nodes), elastic=not gang,
                         warm_only=warm_only)]


def stop_request(slot: int, replica: str, running: Launch | None) -> list[Decision]:
    """What a request to stop ``replica`` in ``slot`` (a joiner its job no longer needs)
    gets: a :class:`Stop` if that is what runs there, else nothing."""
    return [Stop(slot, replica)] if running is not None and running.replica_id == replica \
        else []


# --- where a replica starts ----------------------------------------------------------------


class SlotWait(enum.Enum):
    """Why a replica cannot have slots here yet."""

    EXIT = "exit"
    """A rank here is stopping: its exit frees slots (wait however long that takes)."""
    CORDONED = "cordoned"
    """Only cordoned slots are free: give up (it waits elsewhere, or here once
    uncordoned, when admission hears of the cordon)."""
    MOVED = "moved"
    """Every slot is held by ranks of jobs admission has moved off this node, whose
    records are not applied yet: one of them is about to be stopped (wait, bounded)."""


def node_slots(held: Iterable[int], count: int) -> tuple[int, ...]:
    """The ``count`` lowest slot indices of this node that no running rank holds: where a
    new replica runs (its ``LOCAL_RANK`` is the first, its GPUs are those slots' GPUs)."""
    taken = set(held)
    free: list[int] = []
    index = 0
    while len(free) < count:
        if index not in taken:
            free.append(index)
        index += 1
    return tuple(free)


def slots_for(count: int, held: Collection[int], cordoned: Collection[int],
              capacity: int | None, stopping: bool) -> tuple[int, ...] | SlotWait:
    """The slots a replica of ``count`` slots starts in, or why it waits.

    Args:
        held: the node's slots ranks hold now (running or stopping).
        cordoned: the node's slots out of use.
        capacity: the node's slots (None: unbounded).
        stopping: a rank here is stopping.
    """
    slots = node_slots({*held, *cordoned}, count)
    if capacity is None or slots[-1] < capacity:
        return slots
    if stopping:
        return SlotWait.EXIT
    if node_slots(held, count)[-1] < capacity:
        return SlotWait.CORDONED
    return SlotWait.MOVED

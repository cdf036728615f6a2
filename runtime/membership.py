"""A replica's membership: applying the job's generations between steps, and leaving.

The session (:mod:`.elastic`) hears of generations and faults on the bus
(:mod:`.inbox`); :class:`Membership` decides at each step boundary what they
mean for this replica, and owns what follows: the generation it is a member
of, its rank, world size and process group.

* **Applying a generation** (:meth:`Membership.ensure`). A newer generation
  this replica is in is applied at once: the old group is abandoned, the new
  one rendezvoused (:mod:`.group`) and the state agreed on. A *planned* one (a
  join, a leave) waits until the members agreed, in a step's all-reduce, to
  switch after that step (:meth:`Membership.agree_to_switch`). A generation
  superseded while it is applied is given up, and the newer one applied.
* **A generation that cannot form.** One given up for another reason (rank 0's
  store or a peer unreachable in time, under load) while it is still the newest
  is reported (:class:`~phalanx.schemas.messages.GenerationGivenUp`), and again
  every 2 s while this replica waits for a newer one: with no member dead, no
  fault would replace it, and elasticity keeps a generation in flight until
  every member applies it. So is one whose step's collectives failed with no
  fault known: at once, naming the members whose nodes answer no connect, when
  a collective waited ``unreachable_after_s`` without progress for them
  (:class:`~.group.Unreachable`: a link between nodes cut, which the bus does
  not see); after the collective timeout otherwise. The stream stores repeats
  within its duplicate window once; after it (elasticity or the bus restarted
  and lost it) they are heard again, and a report of a generation decided
  again already changes nothing.
* **Not a member.** A replica not yet taken in waits for a newer generation,
  re-announcing itself every 2 s; one the job completes without ends with
  :class:`JobCompletedWithoutThisReplica`; one a planned shrink takes out
  commits the step the members switch after and ends with :class:`LeftTheJob`;
  one dropped otherwise raises :class:`Dropped`.
* **Agreeing on the state** after the rendezvous (:mod:`.resume`). What a
  fault left goes into it (when the step was given up and why, for the
  generation's trace; each survivor's kept gradient: :class:`Retained`), and
  what it decides for the resume step (a repaired step's shares, the ranks that
  sit it out) goes into that step's plan (:meth:`Membership.share`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from opentelemetry import context as otel_context

from phalanx.bus import telemetry
from phalanx.runtime import default_group, reach
from phalanx.runtime.data import MicroBatch
from phalanx.runtime.group import (
    Aborted,
    Group,
    GroupWork,
    Hosted,
    Unreachable,
    Waits,
    host_store,
    rendezvous,
)
from phalanx.runtime.recovery import Retained
from phalanx.runtime.resume import resume
from phalanx.runtime.session_state import Seat, SessionState
from phalanx.schemas import environment, subjects
from phalanx.schemas.messages import (
    DETAIL_CHARS,
    Generation,
    GenerationApplied,
    GenerationGivenUp,
    GenerationReason,
    ReplicaReady,
    StateSource,
)

log = logging.getLogger("phalanx.runtime")


class Dropped(RuntimeError):
    """This replica is not a member of the job's newest generation.

    Uncaught, the process exits :data:`~phalanx.schemas.environment.EXIT_DROPPED`, which
    health counts as an infrastructure event, not the application's failure.
    """

    exit_status = environment.EXIT_DROPPED


class JobCompletedWithoutThisReplica(SystemExit):
    """The job's last step was committed before this replica became a member.

    It holds no trained state (its parameters are the initial ones), so nothing
    after the training loop may run as if it did. Raised by
    :meth:`~.elastic.ElasticSession.steps` after
    :meth:`~.elastic.ElasticSession.close`: a ``SystemExit`` with status 0, so ``except
    Exception`` does not catch it, ``finally`` blocks and context managers still run,
    and the process ends as a successful one (the job's completion is not its failure).
    """

    def __init__(self, job_id: str, replica_id: str, step: int) -> None:
        super().__init__(0)
        self.job_id, self.replica_id, self.step = job_id, replica_id, step

    def __str__(self) -> str:
        return (f"{self.job_id} completed (step {self.step}) before {self.replica_id} "
                "became a member: it holds no trained state")


class LeftTheJob(SystemExit):
    """This replica left the job in a planned shrink, after the step the members switched
    at (it committed it, like everyone else).

    Raised by :meth:`~.elastic.ElasticSession.steps` after
    :meth:`~.elastic.ElasticSession.close`: a ``SystemExit`` with status 0 — the replica
    did its part — so code after the training loop (a save, an evaluation of the final
    model) does not run on a process that holds the state of a step the job has since
    gone past.
    """

    def __init__(self, job_id: str, replica_id: str, step: int, generation: int) -> None:
        super().__init__(0)
        self.job_id, self.replica_id = job_id, replica_id
        self.step, self.generation = step, generation

    def __str__(self) -> str:
        return (f"{self.replica_id} left {self.job_id} after step {self.step}: generation "
                f"{self.generation} goes on without it")


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """Passed to ``on_membership`` after each generation is applied."""

    generation: int
    world_size: int
    rank: int
    resume_step: int


#: How a replica's log line of an applied generation names a state that came from a tier.
_FROM = {StateSource.MEMORY: " (restored from the nodes' memory)",
         StateSource.BUDDY: " (restored from the nodes' memory and buddy replicas)",
         StateSource.DURABLE: " (restored from durable storage)",
         StateSource.OLDER: " (the step the job had reached was lost: trained again)",
         StateSource.START: " (the job's state was lost: from the start)"}


class Membership:
    """The generation a session's replica is a member of, its rank, world size and group.

    Reads the session's :class:`~.session_state.SessionState` (its configuration, training
    state, inbox, record and bus); a state copy or a restore moves its ``committed``.
    """

    def __init__(self, state: SessionState) -> None:
        self.state = state
        self.generation: Generation | None = None
        # None while not a member (never taken in, or dropped): such a replica holds no
        # trained state, and `rank == 0` must not single it out to save.
        self.rank: int | None = 0 if state.bus is None else None
        self.world_size = 1
        self.pg: Group | None = None
        self.waits = Waits(state.inbox, self.heartbeat, self.unreachable,
                           state.unreachable_after_s)
        #: For the optimizer state a joiner receives (set when it joins a running job).
        self.landing: list[torch.Tensor] = []
        #: Where peers reach this replica's store, ``<host>:<port>`` (:meth:`host_store`).
        self.endpoint = ""
        self._store: Hosted | None = None
        self._stores: dict[str, dist.Store] = {}
        self._switch_agreed = False  # the last all-reduce said: switch to the next generation
        self._applied: GenerationApplied | None = None  # to report after the next commit
        self._restored_from = StateSource.MEMBERS  # where the last applied state came from
        # The step given up last, when and why: a span of the generation that ends the wait.
        self._aborted: tuple[int, int, str] | None = None
        # The members the step given up last could not reach (:class:`Unreachable`).
        self._unreachable: tuple[str, ...] = ()
        self._retained: Retained | None = None  # from an aborted step
        # A repaired step: (step, this rank's plan, its kept gradient if it has one).
        self._repair: tuple[int, list[MicroBatch], Retained | None] | None = None
        # The first step after a state copy: (step, the ranks that compute it).
        self._sitting_out: tuple[int, list[int]] | None = None

    def host_store(self) -> str:
        """Host this replica's store (a generation rendezvouses on its rank 0's): the
        endpoint peers reach it at, ``<host>:<port>``."""
        self._store = host_store(self.state.timeout, environment.store_secret(os.environ))
        self.endpoint = f"{self.state.replica.host}:{self._store.port}"
        return self.endpoint

    def announce(self) -> None:
        """Tell elasticity this replica is ready (again: a non-member repeats it); a group's
        rank 0 speaks for the group."""
        s = self.state
        assert s.bus is not None
        if not s.speaks:
            return
        s.bus.publish_event(subjects.replica_ready(s.replica.job_id), ReplicaReady(
            job_id=s.replica.job_id, replica_id=s.replica.replica_id, slot=s.replica.slot,
            node_id=s.replica.node_id, endpoint=self.endpoint, committed_step=s.committed,
            sent_at=time.time(), admission=s.replica.admission),
            s.replica.event_id("ready"))

    # --- waiting ---------------------------------------------------------------------------

    def wait(self, work: GroupWork) -> None:
        """Wait for ``work``; raise :class:`Aborted` the moment the generation is abandoned
        (a member of it failed, or a fault generation replaced it)."""
        self.waits.work(work, lambda: self.state.inbox.must_abort(self.generation))

    def heartbeat(self) -> None:
        """Progress while waiting: a rank waiting for its peers is not hung (in collectives,
        rendezvous and store calls alike; the reporter sends at most one per 0.1 s)."""
        s = self.state
        if s.reporter is not None and self.generation is not None:
            s.reporter.report(max(s.committed, 0), s.last_step_s)

    def unreachable(self) -> list[str]:
        """The members of this replica's generation whose node answers no connect to
        their endpoint (:mod:`.reach`; one connect per node, this node's own never):
        asked when a collective made no progress for ``unreachable_after_s``."""
        generation, own = self.generation, self.state.replica
        if generation is None:
            return []
        by_host: dict[str, list[str]] = {}
        endpoint: dict[str, str] = {}
        for member in generation.members:
            host = member.endpoint.rpartition(":")[0]
            if member.replica_id == own.replica_id or host == own.host or not host:
                continue
            by_host.setdefault(host, []).append(member.replica_id)
            endpoint.setdefault(host, member.endpoint)
        silent = reach.silent(endpoint.values())
        return [replica for host, replicas in by_host.items() if endpoint[host] in silent
                for replica in replicas]

    def seat(self) -> Seat:
        """This member's place in its generation (a member: its group is built)."""
        assert self.pg is not None and self.rank is not None
        return Seat(self.pg, self.rank, self.world_size, self.wait, self.heartbeat)

    # --- at a step boundary --------------------------------------------------------------

    def ensure(self, total_steps: int) -> bool:
        """Apply a pending generation, waiting for one if this rank has none usable.

        Returns False when the job completed before this replica became a member.
        """
        s = self.state
        while True:
            newest, context = s.inbox.newest()
            finished = s.inbox.finished_step
            if s.bus is None:
                return True  # alone: world size 1, no process group
            if self.generation is None and finished >= total_steps:
                return False
            planned = newest is not None and newest.reason in (GenerationReason.JOIN,
                                                                 GenerationReason.LEAVE)
            if self.generation is not None and self.pg is not None and (
                    newest is None or newest.generation == self.generation.generation
                    or (planned and not self._switch_agreed)):
                # A join or a leave waits until every member has seen it (the flag in the
                # all-reduce).
                return True
            if newest is not None and (self.generation is None
                                       or newest.generation > self.generation.generation):
                if self._switch_agreed and s.sharded is not None and self.pg is not None:
                    self._hand_over(newest)
                if newest.member(s.replica.replica_id) is None:
                    # A planned change without it (a leave, or a join that takes leavers out
                    # with it): it switches out after the agreed step, as everyone does.
                    if self.generation is not None and planned and self._switch_agreed:
                        self._leave(newest)
                    if self.generation is not None:
                        self.rank = None  # its state is no longer the job's
                        if s.group is None:
                            default_group.clear()
                        raise Dropped(f"{s.replica.replica_id} is not a member of generation "
                                      f"{newest.generation} of {s.replica.job_id}")
                else:
                    try:
                        self._apply(newest, context)
                        return True
                    except Aborted as exc:  # anything else is a bug: the rank crashes
                        log.warning("generation %d not applied: %s", newest.generation, exc)
                        # Its state copy's peers it could not reach are named in the report.
                        self._unreachable = exc.replicas if isinstance(exc, Unreachable) \
                            else ()
                        self.abandon()
                        if newest.generation == s.inbox.newest_number():
                            self.wait_for_newer(newest.generation, total_steps,
                                                given_up=str(exc))
                        continue
            # Here the newest generation is this replica's own, or one it is not in (and it
            # never was a member): wait for a newer one than that.
            self.wait_for_newer(-1 if newest is None else newest.generation, total_steps,
                                *self._failed_without_fault(newest))

    def wait_for_newer(self, than: int, total_steps: int, given_up: str | None = None,
                       report_after_s: float = 0.0) -> None:
        """Wait for a generation newer than ``than`` (a non-member re-announces itself).

        ``given_up``: why this member gave generation ``than`` up; it reports that after
        ``report_after_s`` and every 2 s while it waits, since elasticity decides no newer
        one otherwise.
        """
        s = self.state
        started = last_announce = time.monotonic()
        reported: float | None = None
        while True:
            now = time.monotonic()
            if given_up is not None and (
                    now - started >= report_after_s if reported is None
                    else now - reported > 2.0):  # elasticity or the bus may have restarted
                self._report_given_up(than, given_up)
                reported = now
            if s.inbox.newest_number() > than:
                return
            if self.generation is None and s.inbox.finished_step >= total_steps:
                return
            s.inbox.sleep(0.5)
            self.heartbeat()
            if self.generation is None and time.monotonic() - last_announce > 2.0:
                self.announce()  # elasticity may have restarted (or the bus): say it again
                last_announce = time.monotonic()

    def _failed_without_fault(self, newest: Generation | None) -> tuple[str | None, float]:
        """Why this member gave its own generation up after a step's collectives failed
        with no fault known, and after how long to say so: ``(None, 0)`` otherwise.

        A link cut between members, or lossy, fails their collectives (gloo times out or
        loses a connection) with every process alive: no fault comes, no member's
        progress stops, and without a report elasticity would decide no generation, the
        job deadlocked. A peer that died is faulted within seconds (the collective
        timeout is the grace), so only a failure nobody else sees is reported."""
        if self.generation is None or self.pg is not None or self._aborted is None \
                or newest is None or newest.generation != self.generation.generation:
            return None, 0.0
        step, _, why = self._aborted
        # Members it cannot reach are said at once: it waited unreachable_after_s already.
        return (f"step {step}'s collectives failed with no member faulted: {why}",
                0.0 if self._unreachable else self.state.timeout.total_seconds())

    def _report_given_up(self, generation: int, why: str) -> None:
        """Tell elasticity this member gave ``generation`` up (stored in the job-events
        stream; repeats within its duplicate window are stored once). Not when a member
        of it is known to have failed, or the job to have finished: the fault (or the
        end) replaces it anyway, and a report would only add a generation."""
        s = self.state
        newest, _ = s.inbox.newest()
        if s.bus is None or newest is None or newest.generation != generation \
                or s.inbox.must_abort(newest) \
                or (self.generation is None and s.inbox.finished_step >= s.total_steps):
            return
        own = self.generation is not None and self.generation.generation == generation
        s.bus.publish_event(subjects.generation_given_up(s.replica.job_id), GenerationGivenUp(
            job_id=s.replica.job_id, generation=generation, replica_id=s.replica.replica_id,
            reason=why[:DETAIL_CHARS], sent_at=time.time(), admission=s.replica.admission,
            unreachable=list(self._unreachable) if own else []),
            s.replica.event_id(f"g{generation}-given-up"))

    def leave_without_joining(self) -> None:
        """The job completed before this replica became a member: raise
        :class:`JobCompletedWithoutThisReplica` (the session closes, and the process ends
        with status 0) rather than return into the script, whose post-training code would
        treat the untrained parameters as the result."""
        s = self.state
        finished = s.inbox.finished_step
        completed = JobCompletedWithoutThisReplica(s.replica.job_id, s.replica.replica_id, finished)
        log.info("%s", completed)
        if s.record is not None:
            s.record.write(kind="left", step=finished)
        raise completed

    def _leave(self, generation: Generation) -> None:
        """A planned shrink took this replica out: it committed the step the members switched
        after. Raise :class:`LeftTheJob` (the session closes, and the process ends with
        status 0: its agent frees the slot when it exits)."""
        s = self.state
        left = LeftTheJob(s.replica.job_id, s.replica.replica_id, s.committed - 1,
                          generation.generation)
        log.info("%s", left)
        self.rank = None  # the job goes on without it: it is nobody's primary
        if s.group is None:
            default_group.clear()
        if s.record is not None:
            s.record.write(kind="left", step=s.committed, generation=generation.generation,
                            planned=True)
        raise left

    def _hand_over(self, newest: Generation) -> None:
        """A planned change with a sharded optimizer, before the members switch: no member
        gathers the whole state. A shrink (every new member is an old one) moves each
        entry to its new owner over the old group now, before the leaving ones go; a join
        keeps each member's partition through the switch, and the new group moves them
        (:meth:`_apply`). Cut short by a fault, the members hold only their old partitions,
        and the new generation restores a snapshot."""
        sharded = self.state.sharded
        assert sharded is not None and self.pg is not None and self.generation is not None
        old = [self.generation.member(m.replica_id) for m in newest.members]
        if any(member is None for member in old):
            sharded.hold()
            return
        try:
            sharded.hand_to(self.pg, self.wait,
                            [member.rank for member in old if member is not None],
                            newest.world_size)
        except Aborted as exc:
            log.warning("the optimizer's partitions were not handed over: %s", exc)
            self.abandon()

    # --- from a step -----------------------------------------------------------------------

    def share(self, index: int) -> tuple[list[MicroBatch], Retained | None]:
        """Step ``index``'s micro-batches for this rank, and a repaired step's kept share."""
        s = self.state
        if self._repair is not None and self._repair[0] == index:
            _, plan, kept = self._repair
            self._repair = None
            return plan, kept
        if self._sitting_out is not None and self._sitting_out[0] == index:
            active = self._sitting_out[1]
            self._sitting_out = None
            return s.plan_share(index, len(active), active.index(self.rank)
                                if self.rank in active else None), None
        assert self.rank is not None  # a step is planned only for a member
        return s.plan_share(index, self.world_size, self.rank), None

    def seen_newer(self) -> float:
        """1.0 if this member has seen a newer generation (its part of a step's flag)."""
        assert self.generation is not None  # asked in a step's all-reduce: within one
        return 1.0 if self.state.inbox.newest_number() > self.generation.generation else 0.0

    def agree_to_switch(self) -> None:
        """A step's all-reduce said a member has seen a newer generation: every member
        switches after this step (waiting here for the generation if it has not come)."""
        assert self.generation is not None
        self._switch_agreed = True
        if self.state.inbox.newest_number() <= self.generation.generation:
            self.wait_for_newer(self.generation.generation, self.state.total_steps)

    def give_up(self, step: int, why: Aborted, kept: Retained | None = None) -> None:
        """A fault aborted ``step``: abandon the group, and keep for the next generation
        when and why (its trace) and this rank's gradient, if ``kept`` (its repair)."""
        self._aborted = (step, time.time_ns(), str(why))
        self._unreachable = why.replicas if isinstance(why, Unreachable) else ()
        if kept is not None:
            self._retained = kept
        self.abandon()

    def take_applied(self) -> GenerationApplied | None:
        """The applied generation not yet reported (once its first step is committed)."""
        applied, self._applied = self._applied, None
        return applied

    def abandon(self) -> None:
        # gloo: kept, not aborted or destroyed (a group whose work is still blocked on a dead
        # peer must be left to its own timeout; abort() makes its exit std::terminate).
        # NCCL: aborted, its kernels hold the device (:meth:`.group.Waits.abandon`).
        if self.pg is not None:
            self.waits.abandon(self.pg)
        self.pg = None

    # --- applying a generation -----------------------------------------------------------

    def _trace_abort(self, generation: Generation, received_ns: int) -> None:
        """The last step given up, as the first recovery phase in ``generation``'s trace:
        from the abort until this replica starts applying the generation."""
        if self._aborted is None:
            return
        step, aborted_ns, why = self._aborted
        self._aborted = None
        span = telemetry.tracer().start_span("abort step", start_time=aborted_ns, attributes={
            "phalanx.job": self.state.replica.job_id,
            "phalanx.replica": self.state.replica.replica_id,
            "phalanx.step": step, "phalanx.generation": generation.generation,
            "phalanx.abort.cause": why})
        span.end(end_time=max(aborted_ns, received_ns))

    def _apply(self, generation: Generation, context: Any) -> None:
        """Rebuild the process group for ``generation`` and agree on the state."""
        s = self.state
        received = time.time()
        token = otel_context.attach(context) if context is not None else None
        try:
            self._trace_abort(generation, int(received * 1e9))
            with telemetry.tracer().start_as_current_span(
                    f"apply generation {generation.generation}", attributes={
                        "phalanx.job": s.replica.job_id, "phalanx.replica": s.replica.replica_id,
                        "phalanx.generation": generation.generation,
                        "phalanx.reason": generation.reason.value,
                        "phalanx.world_size": generation.world_size}) as applying:
                self.abandon()
                if s.snapshots is not None:
                    s.snapshots.fence()  # a restore or a copy writes the state
                member = generation.member(s.replica.replica_id)
                assert member is not None
                with telemetry.tracer().start_as_current_span("rebuild process group"):
                    pg = self._rendezvous(generation, member.rank)
                built = time.time()
                self.pg, self.generation = pg, generation
                self._switch_agreed = False
                self.rank, self.world_size = member.rank, generation.world_size
                s.inbox.forget_faults(generation)
                with telemetry.tracer().start_as_current_span("copy state") as copying:
                    # A planned change's held partitions, if they add up to the whole state.
                    holders = None if s.sharded is None else s.sharded.agree(
                        pg, self.wait, self.rank, self.world_size, s.committed)
                    resume, nbytes = self._resume(generation)
                    if holders is not None and self._restored_from is StateSource.MEMBERS:
                        assert s.sharded is not None
                        nbytes += s.sharded.take_over(pg, self.wait, self.rank,
                                                       self.world_size, holders)
                    copying.set_attribute("phalanx.state_bytes", nbytes)
                if s.sharded is not None:
                    s.sharded.repartition(self.rank, self.world_size)
                synced = time.time()
                applying.set_attributes({"phalanx.rank": member.rank,
                                         "phalanx.resume_step": resume})
        finally:
            if token is not None:
                otel_context.detach(token)
        if s.record is not None:
            s.record.write(kind="generation", generation=generation.generation,
                            reason=generation.reason.value, rank=self.rank,
                            world_size=self.world_size, received=received, built=built,
                            synced=synced, resume=resume, state_bytes=nbytes,
                            restored_from=self._restored_from.value)
        # Reported once the first step in the generation is committed: elasticity starts
        # replacements only then, so their start-up does not slow the survivors' recovery.
        self._applied = GenerationApplied(
            job_id=s.replica.job_id, generation=generation.generation,
            replica_id=s.replica.replica_id,
            committed_step=s.committed, resume_step=resume, rebuild_s=built - received,
            state_copy_s=synced - built, state_bytes=nbytes, restored_from=self._restored_from,
            admission=s.replica.admission)
        if s.group is None:  # a group's default group is the group's own
            default_group.answer(self.rank, self.world_size)
        if s.reporter is not None:
            s.reporter.generation = generation.generation
        # In the replica's log (the agent's file for its output): where membership changed.
        print(f"=== phalanx: generation {generation.generation} ({generation.reason.value}"
              f"{': ' + generation.cause if generation.cause else ''}): {s.replica.replica_id} is "
              f"rank {self.rank} of {self.world_size}, resuming after step {resume}"
              f"{_FROM.get(self._restored_from, '')}", flush=True)
        if s.on_membership is not None:
            s.on_membership(MembershipChange(generation.generation, self.world_size,
                                             self.rank, resume))

    def _rendezvous(self, generation: Generation, rank: int) -> Group:
        """The group of ``generation`` (the session's ``backend``), given up at once if it
        is superseded meanwhile (its rank 0 died, say) or the job ends before this replica
        gets in."""
        s = self.state

        def give_up() -> str | None:
            if s.inbox.newest_number() > generation.generation:
                return f"generation {generation.generation} was superseded"
            if self.generation is None and s.inbox.finished_step >= s.total_steps:
                return "the job finished before this replica joined"
            return None

        def arrived() -> None:
            if s.chaos.in_rendezvous(generation.generation):
                s.die()

        assert self._store is not None
        return rendezvous(self.waits, self._stores, (s.replica.replica_id, self._store),
                          generation, rank, s.timeout, give_up, s.backend, s.device,
                          column=s.column, host=s.replica.host, arrived=arrived)

    def _resume(self, generation: Generation) -> tuple[int, int]:
        """Agree on the state ``generation`` resumes from (:mod:`.resume`), handing it what
        a fault left and keeping what it decides for the first step: the resume step and
        the state bytes this rank sent or received."""
        landing, self.landing = self.landing, []  # used by this copy or never
        retained, self._retained = self._retained, None
        self._repair = self._sitting_out = None
        resumed = resume(self.state, self.seat(), generation, retained, landing)
        self._restored_from = resumed.origin
        self._repair, self._sitting_out = resumed.repair, resumed.sitting_out
        self.state.chaos.arm(generation.generation, resumed.step)
        return resumed.step, resumed.nbytes

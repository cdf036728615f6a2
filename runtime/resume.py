"""Where a new generation resumes: the step its members agree on, and the state they load.

Right after the rendezvous of a generation (:mod:`.membership`), :func:`resume`
runs on every member, in the same order, over the new group:

1. One all-reduce of the members' progress (:class:`~.recovery.MemberProgress`:
   the step each committed, and the step a survivor kept a gradient for).
2. The newest complete snapshot in the members' nodes' memory newer than any
   member's step (:mod:`.snapshot`), then a committed step in durable storage
   newer than both (:mod:`.durable`), is restored on every member. When no
   member holds the step the job had reached (or any trained step: a job
   admitted again), the shards of the newest step in memory that no member's
   node holds are first fetched onto one (:mod:`.fetch`).
3. If nothing holds the step the job had reached, the members go on from the
   newest step left (the initial state at worst), and the record says so.
4. The pure plan (:func:`~.recovery.plan_recovery`): the resume step, a repair
   of an aborted step from the survivors' kept gradients, the ranks that sit
   out the first step, and who sends state to whom.
5. Members behind the resume step receive model, optimizer, registered objects
   and step from the plan's source (:mod:`.state`).

A sharded optimizer whose members hold only their partitions (a planned change
cut short) recovers only from a snapshot: without one it stops with
:class:`~.recovery.StateLost`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from phalanx.runtime.data import MicroBatch
from phalanx.runtime.durable import Committed, DurableCorrupt, corrupt_records
from phalanx.runtime.durable import restore as restore_durable
from phalanx.runtime.fetch import fetch_missing
from phalanx.runtime.recovery import MemberProgress, Repair, Retained, StateLost, plan_recovery
from phalanx.runtime.session_state import Seat, SessionState
from phalanx.runtime.snapshot import restore
from phalanx.runtime.state import StateTransferError, receive_state, send_state
from phalanx.schemas import subjects
from phalanx.schemas.messages import Generation, SnapshotRecord, SnapshotTier, StateSource
from phalanx.schemas.snapshot_file import Header

log = logging.getLogger("phalanx.runtime")


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What the members agreed on in a generation, as this rank holds it."""

    step: int  # the resume step: the next step to run
    nbytes: int  # the state this rank sent or received
    origin: StateSource  # where the resume step's state came from
    # The resume step repaired: (step, this rank's plan, its kept gradient if it has one).
    repair: tuple[int, list[MicroBatch], Retained | None] | None
    # The first step after a state copy: (step, the ranks that compute it).
    sitting_out: tuple[int, list[int]] | None


def resume(state: SessionState, seat: Seat, generation: Generation,
           retained: Retained | None, landing: list[torch.Tensor]) -> Resumed:
    """Agree on the resume step, a repair and who copies state (:mod:`.recovery`), then
    copy: ranks behind the resume step receive the state of one that has it.

    ``seat`` is this member's place in ``generation``, its group built; ``retained`` is its
    gradient kept from an aborted step, ``landing`` the buffers a joiner receives the
    optimizer state into. Moves ``state.committed`` to the step it then holds.

    Raises:
        Aborted: the generation was given up meanwhile.
        StateLost: a sharded optimizer's members hold no complete step and no snapshot.
        StateTransferError: the copy received another step than the one agreed on.
    """
    s = state
    pg, rank, world_size = seat.pg, seat.rank, seat.world_size
    # A member holding only its partition of a sharded optimizer holds no whole step,
    # unless the members' held partitions add up to it (a planned change's hand-over).
    mine = MemberProgress(s.committed if s.sharded is None or s.sharded.holds_all
                          or s.sharded.held is not None else -1)
    if retained is not None and s.sharded is None:
        mine = MemberProgress(s.committed, retained.step, retained.generation.generation)
    info = torch.zeros(world_size, len(mine.row()), dtype=torch.int64)
    info[rank] = torch.tensor(mine.row())
    seat.wait(pg.allreduce([info]))
    rows = [MemberProgress(*row) for row in info.tolist()]
    job_step = generation.resume_step
    members_step = max(row.committed for row in rows)
    origin = StateSource.MEMBERS
    restored: int | None = None
    # No member holds the step the job reached, or any trained step of a job admitted
    # again whose earlier step is not on record: a shard no member's node holds is
    # fetched onto one. (A first admission's members hold step 0 only at its start, when
    # nothing anywhere holds more.)
    if members_step < job_step or (members_step == 0 and s.replica.admission > 1):
        fetch_missing(s, seat, generation, members_step)
    snapshot = _restore_snapshot(s, seat, generation, members_step)
    if snapshot is not None:
        restored, origin = snapshot
    durable = _restore_durable(s, seat, generation, max(members_step, restored or -1))
    if durable is not None:
        restored, origin = durable, StateSource.DURABLE
    if restored is not None:  # every member holds the restored step now, nothing kept
        rows, retained = [MemberProgress(restored)] * len(rows), None
        if restored < job_step:  # the steps since the newest snapshot are trained again
            log.warning("%s: job %s had reached step %d; generation %d restores step %d "
                        "from the %s tier (%d steps trained again)", s.replica.replica_id,
                        s.replica.job_id,
                        job_step, generation.generation, restored, origin.value,
                        job_step - restored)
        job_step = min(job_step, restored)
    newest = max(row.committed for row in rows)
    if restored is None and newest == 0 and job_step == 0 and s.replica.admission > 1 \
            and generation.generation == 0:
        # Admitted again and the step it had reached not known (health's record of it
        # missing): no member and no tier holds any trained step either.
        origin = StateSource.START
        _state_lost(s, generation, None, 0, origin)
    if 0 <= newest < job_step:
        # No member and no tier holds the step the job reached (every holder died with
        # its memory, snapshots off or not yet taken): go on from the newest step that
        # is left, as a restart would, and say so.
        origin = StateSource.START if newest == 0 else StateSource.OLDER
        _state_lost(s, generation, job_step, newest, origin)
        job_step = newest
    if s.sharded is not None and restored is None \
            and max(row.committed for row in rows) < 0:
        raise StateLost(f"generation {generation.generation}: every member holds only "
                        "its partition of the sharded optimizer and no snapshot of a "
                        "complete step is left on the members' nodes (a sharded "
                        "optimizer recovers from a fault only from snapshots: "
                        "checkpoint.memory_every_steps)",
                        retry=s.snapshots is not None or s.durable is not None)
    plan = plan_recovery(rows, generation.generation, job_step, restored=restored is not None)
    step, source = plan.resume, plan.source
    repair = None
    if plan.repair is not None:
        repair = _repair(s, seat, plan.repair, retained)
    sitting_out = None if plan.sitting_out is None else (step, list(plan.sitting_out))
    nbytes = 0
    if rank == source:
        for dst in plan.behind:
            nbytes += send_state(pg, dst, s.model, s.optimizer_state, step, seat.wait,
                                 checksum=s.checksum, extra=s.carried).nbytes
    elif rank in plan.behind:
        # Until the copy is complete this rank holds no step's state: if the copy is
        # cut short, the next generation sees it as behind everyone and copies again.
        s.committed = -1
        received, stats = receive_state(pg, source, s.model, s.optimizer_state, seat.wait,
                                        landing, extra=s.carried)
        if received != step:
            raise StateTransferError(f"asked for step {step}, received step {received}")
        s.committed, nbytes = received, stats.nbytes
        if s.record is not None:
            s.record.write(kind="adopt", generation=generation.generation,
                            step=received, source=source, state_bytes=nbytes)
    return Resumed(step, nbytes, origin, repair, sitting_out)


def _repair(s: SessionState, seat: Seat, plan: Repair, retained: Retained | None
            ) -> tuple[int, list[MicroBatch], Retained | None] | None:
    """The repair of step ``plan.step``: one all-reduce of which samples the members'
    kept gradients cover, then this rank's part of the rest; None (the step runs whole,
    nothing kept counts) if the kept shares do not complete the batch once each."""
    epoch, in_epoch = divmod(plan.step, s.order.steps_per_epoch)
    kept = retained if retained is not None and retained.step == plan.step \
        and retained.generation.generation == plan.generation else None
    counts = torch.tensor(s.order.kept_counts(epoch, in_epoch,
                                              kept.indices if kept is not None else []),
                          dtype=torch.int64)
    seat.wait(seat.pg.allreduce([counts]))
    micro = s.order.repair_plan(epoch, in_epoch, counts.tolist(), seat.world_size, seat.rank,
                                s.micro_batch_size, aligned=s.deterministic)
    if micro is None:
        log.error("%s: the gradients kept from step %d do not cover its batch once each; "
                  "the step runs whole", s.replica.replica_id, plan.step)
        return None
    return plan.step, micro, kept


def _state_lost(s: SessionState, generation: Generation, reached: int | None,
                newest: int, origin: StateSource) -> None:
    """The job had reached step ``reached`` (None: not known, a job admitted again whose
    earlier progress is not on record) and nothing holds it: the members go on from
    ``newest`` (their newest step, 0: the initial state), ``origin`` saying which."""
    if reached is None:
        log.error("%s: job %s is admitted again (admission %d) and no member and no "
                  "checkpoint tier holds a step of it: it trains from step %d",
                  s.replica.replica_id, s.replica.job_id, s.replica.admission, newest)
    else:
        log.error("%s: no member and no checkpoint tier holds step %d, which job %s had "
                  "reached: generation %d resumes after step %d (%d steps trained again)",
                  s.replica.replica_id, reached, s.replica.job_id, generation.generation, newest,
                  reached - newest)
    if s.record is not None:
        s.record.write(kind="restore", generation=generation.generation, step=newest,
                        tier=origin.value, reached=reached, state_bytes=0,
                        seconds=0.0, corrupt=[])


def _keeps(s: SessionState, seat: Seat) -> Callable[[int], bool] | None:
    """A restore's filter: a sharded optimizer's entries of this member's new partition
    (every member restores, so nobody needs the whole state from it)."""
    if s.sharded is None:
        return None
    return s.sharded.keeps(seat.rank, seat.world_size)


def _restore_snapshot(s: SessionState, seat: Seat, generation: Generation,
                      members_step: int) -> tuple[int, StateSource] | None:
    """If the members' nodes hold snapshots newer than ``members_step`` (the newest
    step a member holds), load the newest complete one on every member: its step, and
    whether buddies' replicas were needed."""
    if s.snapshots is None:
        return None
    assert s.snapshot_dir is not None
    started = time.time()

    def report(header: Header, problem: str, replica: bool) -> None:
        log.error("snapshot skipped: %s", problem)
        if s.record is not None:
            s.record.write(kind="corrupt", step=header.step, shard=header.shard,
                            shards=header.shards, problem=problem)
        assert s.bus is not None
        s.bus.publish(subjects.ckpt_snapshot(s.replica.job_id), SnapshotRecord(
            job_id=s.replica.job_id, step=header.step, shard=header.shard,
            num_shards=header.shards, node_id=s.replica.node_id,
            tier=SnapshotTier.BUDDY if replica else SnapshotTier.LOCAL,
            nbytes=header.length, checksum=f"{header.checksum:016x}",
            created_at=time.time(), generation=header.generation,
            total_bytes=header.total, corrupt=True, detail=problem,
            column=header.column, columns=header.columns))

    group = s.group
    restored = restore(seat.pg, seat.wait, seat.rank, seat.world_size, Path(s.snapshot_dir),
                       s.replica.job_id, members_step, s.model, s.optimizer_state, s.carried,
                       report, _keeps(s, seat),
                       column=(0, 1) if group is None else (group.rank, group.size),
                       agree=None if group is None else group.agree)
    if restored is None:
        return None
    s.committed = restored.step
    log.warning("%s restored step %d from the nodes' memory (%d B) in generation %d",
                s.replica.replica_id, restored.step, restored.nbytes, generation.generation)
    if s.record is not None:
        s.record.write(kind="restore", generation=generation.generation,
                        step=restored.step, tier="memory", state_bytes=restored.nbytes,
                        seconds=time.time() - started, corrupt=restored.corrupt,
                        from_replicas=restored.from_replicas,
                        reached=generation.resume_step)
    return restored.step, StateSource.BUDDY if restored.from_replicas else StateSource.MEMORY


def _restore_durable(s: SessionState, seat: Seat, generation: Generation,
                     newer_than: int) -> int | None:
    """If durable storage holds a committed step newer than ``newer_than`` (what the
    members and their nodes' memory hold), load it on every member: its step."""
    if s.durable is None:
        return None
    started = time.time()

    def report(step: Committed, problem: DurableCorrupt) -> None:
        log.error("durable step skipped: %s", problem)
        if s.record is not None:
            s.record.write(kind="corrupt", step=step.step, shards=step.shards,
                            shard=problem.shard, job=step.job_id, tier="durable",
                            problem=str(problem))
        if s.bus is not None:  # in the catalog of the job that wrote it
            assert s.durable is not None
            location = s.durable.location(step)
            for message in corrupt_records(step, problem, location, s.replica.node_id, time.time()):
                s.bus.publish(subjects.ckpt_snapshot(step.job_id), message)

    group = s.group
    restored = restore_durable(seat.pg, seat.wait, seat.world_size, s.durable,
                               s.replica.job_id, newer_than, s.model, s.optimizer_state,
                               s.carried, report, _keeps(s, seat),
                               agree=None if group is None else group.agree,
                               column=0 if group is None else group.rank)
    if restored is None:
        return None
    step, nbytes = restored
    s.committed = step
    log.warning("%s restored step %d from durable storage (%d B) in generation %d",
                s.replica.replica_id, step, nbytes, generation.generation)
    if s.record is not None:
        s.record.write(kind="restore", generation=generation.generation, step=step,
                        tier="durable", state_bytes=nbytes,
                        seconds=time.time() - started, corrupt=[],
                        reached=generation.resume_step)
    return step

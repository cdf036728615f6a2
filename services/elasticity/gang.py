"""A job before its first ready replica: a torchrun gang that restarts whole. Pure.

Until a replica reports ready the job's processes are a torchrun gang (the agents give
them the gang's ``RANK``, ``WORLD_SIZE`` and rendezvous), unless its spec declares a
session. A process that fails leaves the others waiting for it in their
``init_process_group`` or failing with it, so a failed replica restarts the whole gang,
as torchrun restarts its workers. The first ready replica makes the job *managed*
(:mod:`.generations`); jobs that never use the runtime never get generations.
"""

from __future__ import annotations

from phalanx.schemas.replicas import incarnation, replica_id
from phalanx.services.elasticity.events import (
    Decision,
    Event,
    JobAdmitted,
    LaunchReplacement,
    MemberFailed,
    ReplicaReadySeen,
)
from phalanx.services.elasticity.model import JobMembership, slot_of


def handle(job: JobMembership, event: Event) -> tuple[list[Decision], list[Event]]:
    """Apply one event to a job not managed yet.

    Returns:
        The decisions, and the events to apply next to the job, managed from now on:
        a declared session's faults kept until then, and the readiness that made it
        managed (empty while it is not).
    """
    match event:
        case JobAdmitted():
            if event.slots != job.slots:
                # Re-placed: the agents start the gang again, r<s>-0 in the new world.
                job.slots, job.gang_round, job.launched = dict(event.slots), 0, {}
        case MemberFailed() if job.session:
            job.early_faults.append(event)  # a session's processes are worlds of their own
        case MemberFailed():
            return _restart(job, event), []
        case ReplicaReadySeen() if incarnation(event.replica_id) == job.gang_round:
            job.managed = True  # the job uses the runtime: the gang's replicas expected
            for slot in sorted(job.slots):
                job.launched[replica_id(slot, job.gang_round)] = slot
                job.incarnation[slot] = job.gang_round
            job.forming = set(job.launched)
            early, job.early_faults = job.early_faults, []
            return [], [*early, event]
    return [], []


def _restart(job: JobMembership, failed: MemberFailed) -> list[Decision]:
    """A replica of the job's current torchrun gang failed before any was ready: every
    slot's next incarnation, all alike (``r<s>-1`` in every slot, then ``r<s>-2`` …),
    launched as a gang (:attr:`~.events.LaunchReplacement.gang`: the agent stops what
    runs in the slot and gives the new process the gang's variables and a rendezvous
    port of that incarnation's own). A fault of an earlier incarnation (a member of the
    gang already restarted, failing with it) or of a node that is gone (admission
    re-places the job) restarts nothing. Health's restart budget decides how often:
    past it the job fails before its fault reaches here."""
    if not failed.replaceable or incarnation(failed.replica_id) != job.gang_round \
            or slot_of(failed.replica_id)[0] not in job.slots:
        return []
    job.gang_round += 1
    job.launched = {replica_id(s, job.gang_round): s for s in job.slots}
    job.replaced += len(job.slots)
    return [LaunchReplacement(job.job_id, s, node, replica_id(s, job.gang_round),
                              failed.event_id, gang=True)
            for s, node in sorted(job.slots.items())]

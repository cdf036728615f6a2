"""What a rank's fault or end makes of its job: a repair, the job's failure, its finish. Pure.

Rules 8 and 2 of :mod:`.core`. Each crash, hang or node-lost fault of a rank is charged
to its job's :class:`~phalanx.services.health.policy.RestartBudget` (:func:`rank_failed`):
within it the fault goes out, to be repaired; past it the job fails (:class:`FailJob`)
and is no longer watched. A job some rank of which is done and none still runs is
finished (:func:`finish_if_done`) and no longer watched. Either way its last progress
record is kept for the shell to store.
"""

from __future__ import annotations

import dataclasses

from phalanx.services.health import cordon
from phalanx.services.health.events import Decision, FailJob, FinishJob, RaiseFault
from phalanx.services.health.model import HealthState, JobHealth, RankExit, RankHealth
from phalanx.services.health.policy import Failure


def rank_failed(state: HealthState, rank: RankHealth, failure: Failure, at: float,
                fault: RaiseFault) -> list[Decision]:
    """Charge a rank's failure to its job's restart budget: the fault that has it
    repaired, or, past the budget, the job's end."""
    job = rank.job
    state.changed.add(job.job_id)
    node = state.nodes.get(rank.node_id)
    if node is None or at > node.chaos_until:
        # An injected fault is no evidence, neither against its node nor for a fault
        # that struck the whole job (which would clear a real one beside it).
        cordon.strike(state, job.job_id, rank.node_id, at)
    # The reason's first line is the fault's first line and the policy's verdict (a
    # one-line view shows only it); the rank's last output follows.
    first, newline, output = fault.detail.partition("\n")
    what = f"{rank.replica_id or f'rank {rank.rank}'} on {rank.node_id}: {first}"
    verdict = job.budget.charge(failure, at, what, started_in=rank.round,
                                step=max(job.track.step, job.final_step or 0))
    if verdict is not None:
        del state.jobs[job.job_id]
        state.ended_progress.append(job.progress(at))
        return [FailJob(job.job_id, verdict.reason_code, verdict.reason + newline + output)]
    job.progress_due = True  # a restart more
    return [dataclasses.replace(fault, application=failure.application)]


def finish_if_done(state: HealthState, job: JobHealth) -> list[Decision]:
    """Finished: some rank exited 0 and none still runs (a crashed slot that is never
    started again does not hold the job back)."""
    exits = [r.exit for r in job.ranks.values()]
    if RankExit.DONE in exits and None not in exits:
        del state.jobs[job.job_id]
        state.ended_progress.append(job.progress(state.now))
        return [FinishJob(job.job_id, job.final_step)]
    return []

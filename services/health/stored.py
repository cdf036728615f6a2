"""What of a watched job outlives the health leader: its snapshot and its restore. Pure.

A job's *lasting part* (:class:`WatchedJobState`) is its placement and hang timeout, each
rank's node, replica, exit, whether it reported and was done or departing, and the
restart budget's spending; :func:`snapshot` encodes it (msgpack) for the shell to store,
and :func:`restore` takes it back into a new leader's state. The timing state (last
reports, step times, the step track, node heartbeats) is not kept: a restored rank that
was reporting gets a full hang timeout from the restore, and the rest is heard afresh.
"""

from __future__ import annotations

import collections
import dataclasses

import msgspec

from phalanx.schemas.errors import StoredStateError
from phalanx.schemas.messages import RestartPolicy
from phalanx.services.health.events import DEFAULT_RESTART_POLICY
from phalanx.services.health.model import HealthState, JobHealth, RankExit, RankHealth
from phalanx.services.health.policy import RestartBudget


@dataclasses.dataclass(frozen=True)
class RankSnapshot:
    rank: int
    node_id: str
    replica_id: str | None
    exit: RankExit | None
    reporting: bool
    done: bool = False
    departing: bool = False
    round: int = 0  # the restart round it was started in


@dataclasses.dataclass(frozen=True)
class WatchedJobState:
    """The lasting part of a watched job."""

    job_id: str
    nodes: tuple[str, ...]
    hang_timeout_s: float
    slots: tuple[int, ...]
    ranks: tuple[RankSnapshot, ...]
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    restarts: int = 0
    app_failures: int = 0
    recent_restarts: tuple[float, ...] = ()  # the rounds of the streak without progress
    completed: bool = False
    final_step: int | None = None
    restart_round: int = 0
    stalled_step: int = 0  # the job's step when the latest round began
    admission: int = 0  # which admission of the job it watched (JobRecord.admission)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(WatchedJobState)


def snapshot(job: JobHealth) -> bytes:
    """A watched job's lasting part, for :func:`restore`."""
    budget = job.budget
    return _ENCODER.encode(WatchedJobState(
        job.job_id, job.nodes, job.hang_timeout_s, job.slots,
        tuple(RankSnapshot(r.rank, r.node_id, r.replica_id, r.exit, r.reporting, r.done,
                           departing=r.rank not in job.ranks, round=r.round)
              for r in [*job.ranks.values(), *job.departing.values()]),
        budget.policy, budget.restarts, budget.app_failures, tuple(budget.stalled),
        job.completed, job.final_step, budget.round, budget.step, job.admission))


def restore(state: HealthState, data: bytes, now: float) -> str:
    """Take back a job's :func:`snapshot` into ``state`` at ``now``; returns the job id.

    Its reporting ranks are judged for hangs from ``now`` on (a full timeout).

    Raises:
        StoredStateError: ``data`` is not a snapshot this version can read.
    """
    try:
        stored = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StoredStateError(f"not a health job snapshot: {exc}") from None
    now = state.advance(now)
    job = JobHealth(stored.job_id, stored.nodes, stored.hang_timeout_s, stored.slots,
                    budget=RestartBudget(stored.restart_policy, stored.restarts,
                                         stored.app_failures,
                                         collections.deque(stored.recent_restarts),
                                         stored.restart_round, stored.stalled_step,
                                         knows_step=False),
                    completed=stored.completed, final_step=stored.final_step,
                    admission=stored.admission)
    for kept in stored.ranks:
        into = job.departing if kept.departing else job.ranks
        into[kept.rank] = RankHealth(job, kept.rank, kept.node_id, kept.replica_id,
                                     kept.exit, kept.reporting, hang_since=now,
                                     done=kept.done, round=kept.round)
    state.jobs[job.job_id] = job
    for rank in job.ranks.values():
        state.arm(rank)
    return job.job_id

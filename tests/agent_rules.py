"""For the tests of the agent's reconcile rules: a job record as the agent receives it,
and a node's ranks as plain data, changed as the shell's processes would change them."""

from __future__ import annotations

from phalanx.schemas.messages import (
    JobRecord,
    JobSpec,
    JobState,
    ReasonCode,
    ReplicaRange,
    ScalingPolicy,
)
from phalanx.services.agent.core import Decision, Forget, Launch, Leave, Start, Stop


def job_record(*nodes: str, slots: tuple[int, ...] = (),
               state: JobState = JobState.ADMITTED, slots_per_replica: int = 1,
               leave_s: float = 30.0, ranks_per_replica: int = 1) -> JobRecord:
    """Job ``j`` with replica (slot) ``slots[i]``, else ``i``, on ``nodes[i]`` when
    admitted; ``leave_s``: its ``scaling.graceful_shutdown_timeout_s``."""
    spec = JobSpec(name="j", team="t", priority_class="normal", command=["train"],
                   slots_per_replica=slots_per_replica, ranks_per_replica=ranks_per_replica,
                   replicas=ReplicaRange(min=1, max=8),
                   scaling=ScalingPolicy(graceful_shutdown_timeout_s=leave_s))
    admitted = state is JobState.ADMITTED
    return JobRecord(job_id="j", spec=spec, state=state, submitted_at=1.0, updated_at=1.0,
                     reason_code=ReasonCode.ADMITTED if admitted else ReasonCode.QUEUED,
                     nodes=list(nodes) if admitted else [], slots=list(slots))


def carry_out(decisions: list[Decision], running: dict[int, Launch],
              launched: dict[int, Launch]) -> None:
    """Change ``running`` and ``launched`` (by slot) as the shell's processes would: a
    stopped or leaving rank is gone, a started one runs."""
    for decision in decisions:
        match decision:
            case Stop(slot=slot) | Leave(slot=slot):
                del running[slot]
            case Forget(slots=slots):
                for slot in slots:
                    del launched[slot]
            case Start(slot=slot, replica_id=replica, placement=placement):
                running[slot] = launched[slot] = Launch(replica, placement)
            case _:
                raise AssertionError(f"{decision!r} is not the reconcile rules'")

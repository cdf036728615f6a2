"""What every partition test checks: a run whose cut-off ranks' records hold no step the
job keeps twice, on a job admitted once (a rank's exit, waited on by its pidfd, is the
harness's :func:`~phalanx.bench.partition_harness.exited`)."""

from __future__ import annotations

from pathlib import Path

from phalanx.bus.client import Bus, Delivery
from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import Generation, GenerationReason, JobRecord, JobState


async def job_states(bus: Bus, job_id: str) -> list[JobState]:
    """The list that ``job_id``'s states fill as its record changes, from now on."""
    states: list[JobState] = []

    async def on_state(job: JobRecord, _: Delivery) -> None:
        states.append(job.state)

    await bus.subscribe(subjects.job_state(job_id), JobRecord, on_state)
    return states


def check_cut_off(rec: Path, steps: list[record.StepRecord], generations: list[Generation],
                  cut_off: set[str], states: list[JobState]) -> None:
    """Every rank's record (the cut-off ranks' included) holds no step the job keeps
    committed twice, and none committed by a cut-off rank once the job left it; the job
    went on without them (``cut_off``: none, it kept them), admitted once, and finished.

    A step may be committed by two generations: the one in flight when the job moved
    on (one at each change of generation). Its members aborted it and trained it again
    in the next generation while the cut-off ranks, hearing nothing, may have finished
    it in theirs: a commit the job does not keep (of a step, the newest generation's is
    kept).
    """
    records = record.read(rec)
    assert cut_off <= set(records)
    by_step: dict[int, set[int]] = {}
    for lines in records.values():
        for line in lines:
            if line["kind"] == "commit":
                by_step.setdefault(line["step"], set()).add(line["generation"])
    twice = {step: gens for step, gens in by_step.items() if len(gens) > 1}
    assert len(twice) <= len(generations) - 1, twice  # the step in flight at each change
    kept = {s.step: s.generation for s in steps}
    for step, gens in twice.items():
        assert kept[step] == max(gens), (step, gens)
        assert all(replica in cut_off for replica, lines in records.items() for line in lines
                   if line["kind"] == "commit" and line["step"] == step
                   and line["generation"] < max(gens)), step
    # Nothing a cut-off rank committed after the job moved past it: each is judged from
    # the first generation without it (a lossy node's ranks may leave one by one: two
    # unreachable in one generation, the third hung in the next).
    for replica in cut_off:
        left_at = min(g.generation for g in generations
                      if replica not in {m.replica_id for m in g.members})
        assert all(line["generation"] < left_at for line in records[replica]
                   if line["kind"] == "commit"), (replica, left_at)
    # The job went on without them: never admitted again, no gang restart.
    assert all(g.reason is not GenerationReason.START for g in generations[1:]), generations
    ended = next(i for i, s in enumerate(states) if s.terminal)
    assert set(states[:ended]) <= {JobState.ADMITTED}, states
    assert set(states[ended:]) == {JobState.FINISHED}, states

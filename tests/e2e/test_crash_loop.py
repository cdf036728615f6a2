"""The crash-loop guard end to end: progress between faults is no crash loop.

Issue 24: a job that committed steps between every one of ten faults in 133 s
ended ``failed`` with ``restart_rate`` (eight restarts within 300 s). Health
now fails a job only when its restarts repeat with no committed step between
them. Both tests use ``max_restarts_in_window: 2``: the first kills four ranks
one after another while the job trains between the kills (the old count failed
it at the third) and must finish; the second kills every incarnation of one
slot of a two-replica job at step 0, before any step, and must fail as before.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from e2e_cli import next_of
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    ARGS,
    ORDER,
    SCRIPT,
    Watch,
    drain,
    progressed,
    run_job,
    watched_cluster,
)

from phalanx.runtime import record
from phalanx.schemas.messages import (
    GenerationReason,
    JobSpec,
    JobState,
    Placement,
    ReasonCode,
    ReplicaRange,
    RestartPolicy,
)
from phalanx.services.client import AdmissionClient

QUICK = RestartPolicy(max_restarts_in_window=2)  # the old rule: a third restart in 300 s fails
STEPS = 150  # the last kill at step 80; more steps after the kills would prove nothing more


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple]:
    async with watched_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


async def test_rank_kills_with_steps_committed_between_them_never_fail_the_job(
        cluster, data_dir: Path, tmp_path: Path) -> None:
    kills = {"r0-0": 20, "r1-0": 40, "r2-0": 60, "r3-0": 80}

    async def past_the_kills(job_id: str, watch: Watch) -> None:
        await progressed(watch, job_id, max(kills.values()) + 5)

    rec, generations = await run_job(
        cluster, data_dir, tmp_path, "through", past_the_kills, steps=STEPS,
        spec={"restart_policy": QUICK},
        env={"PHALANX_CHAOS_KILL": ",".join(f"{r}:{s}:boundary" for r, s in kills.items())})
    records = record.read(rec)
    assert sorted(r for r, lines in records.items()
                  if any(line["kind"] == "chaos" for line in lines)) == sorted(kills)
    faults = [g for g in generations if g.reason is GenerationReason.FAULT]
    assert len(faults) >= len(kills) > QUICK.max_restarts_in_window, generations
    assert record.verify(records, ORDER, STEPS) == []


async def test_a_crash_that_recurs_before_any_step_fails_the_job(
        cluster, data_dir: Path, tmp_path: Path) -> None:
    _, bus, watch = cluster
    drain(watch.states)
    # Every incarnation of slot 0 dies at step 0's boundary; with two replicas of two,
    # nothing trains without it.
    loop = ",".join(f"r0-{i}:0:boundary" for i in range(6))
    spec = JobSpec(name="loop", team="t", priority_class="normal",
                   replicas=ReplicaRange(min=2, max=2), placement=Placement(),
                   command=[sys.executable, str(SCRIPT), "--data-dir", str(data_dir), *ARGS,
                            "--steps", str(STEPS)],
                   env={"PHALANX_RECORD_DIR": str(tmp_path / "rec"), "PHALANX_CHAOS_KILL": loop},
                   hang_timeout_s=5.0, restart_policy=QUICK)
    job = await AdmissionClient(bus).submit(spec, "loop-1")
    end = await next_of(watch.states,
                        lambda r: r.job_id == job.job_id and r.state.terminal, 120)
    assert (end.state, end.reason_code) == (JobState.FAILED, ReasonCode.RESTART_RATE), end
    assert "after 2 restart(s) within 300 s without a committed step between them" \
        in end.reason, end.reason
    chaos = [r for r, lines in record.read(tmp_path / "rec").items()
             if any(line["kind"] == "chaos" for line in lines)]
    assert sorted(chaos) == ["r0-0", "r0-1", "r0-2"]  # three rounds: the third failed it

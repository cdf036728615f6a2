"""A warm spare replaces a killed rank end to end, and the job ends as if nothing happened.

``phalanx up`` with one agent of 5 slots; ``examples/train_mlp.py`` as a
4-replica elastic job with ``spares: 1``, so the node's free slot holds one
warm spare: the script run up to ``ElasticSession.from_env`` (model built,
data opened), waiting for an identity. Rank 1 is SIGKILLed mid-training: its
replacement ``r1-1`` must be that spare (the same process, told its replica
id), join, and the job must end with parameters bitwise equal to the
fault-free run (deterministic mode) and every step's loss the same. The spare
taken is replaced by a new one; when the job ends, its spare is stopped; after
``phalanx down`` none is left.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from e2e_cli import next_of, phalanx
from proc_tree import until
from spare_probe import spares_of
from test_elastic import (  # the e2e helpers of the elastic tests: same job, same checks
    STEPS,
    Watch,
    check_run,
    progressed,
    run_job,
    watched_cluster,
)

from phalanx.bus.client import Delivery
from phalanx.schemas import subjects
from phalanx.schemas.messages import Generation, GenerationReason, RankStarted


@pytest.mark.timeout(420)
async def test_a_killed_rank_is_replaced_by_a_warm_spare_and_the_job_ends_bitwise_equal(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    data = tmp_path_factory.mktemp("cluster")
    where = ("--data-dir", str(data))
    job_ids: list[str] = []
    async with watched_cluster(data, "--slots-per-agent", "5", agents=1) as cluster:
        _, bus, _ = cluster
        started: asyncio.Queue[RankStarted] = asyncio.Queue()
        generations: asyncio.Queue[Generation] = asyncio.Queue()
        waiting: set[int] = set()

        async def put(queue: asyncio.Queue, message: object, _: Delivery) -> None:
            await queue.put(message)

        async def kill(job_id: str, watch: Watch) -> None:
            job_ids.append(job_id)
            await bus.subscribe(subjects.rank_started(job_id), RankStarted,
                                lambda m, d: put(started, m, d))
            await bus.subscribe(subjects.job_generation(job_id), Generation,
                                lambda m, d: put(generations, m, d))
            await progressed(watch, job_id, 40)
            waiting.update(await until(lambda: spares_of(job_id)))
            assert len(waiting) == 1, waiting  # one free slot: one spare
            phalanx("chaos", "kill-rank", job_id, "1", *where)
            replacement = await next_of(started, lambda s: s.replica_id == "r1-1", 120)
            assert replacement.pid in waiting  # the spare became r1-1, no new process
            join = await next_of(generations, lambda g: g.reason is GenerationReason.JOIN, 120)
            assert [m.replica_id for m in join.members][-1] == "r1-1"
            # The spare taken is replaced by a new one.
            await until(lambda: spares_of(job_id) - waiting, 60)

        rec, _ = await run_job(cluster, data_dir, tmp_path, "spare", kill, spec={"spares": 1})
        (job_id,) = job_ids
        # The job's end stops its spare (the agent follows the finished record).
        await until(lambda: not spares_of(job_id), 30)
        steps = check_run(rec, tmp_path / "final.pt", reference)
        assert len(steps) == STEPS
        params = torch.load(tmp_path / "final.pt")
        assert all(torch.equal(params[name], value)
                   for name, value in reference["params"].items())
        log = phalanx("logs", job_id, "--replica", "r1-1", *where).stdout
        assert "r1-1 starting on warm spare" in log and "r1-1 is rank 3 of 4" in log, log
        # Elasticity's log says which path the replacement took.
        launches = [json.loads(line) for line in
                    (data / "logs" / "elasticity.log").read_text().splitlines()
                    if '"agent request done"' in line]
        # (Asked of a spare during the recovery, then cold once it is over, r1-1 may be
        # asked twice when the recovery ends before it is ready: the second is a no-op.)
        assert [(e["replica"], e["spare"]) for e in launches][:1] == [("r1-1", True)], launches
        assert all(e["replica"] == "r1-1" and "already launched" in e["detail"]
                   for e in launches[1:]), launches
    assert not spares_of(job_id)  # nothing left after phalanx down

"""The Kubernetes agent's process layout, with a training job: each agent runs under
``phalanx agent --supervised`` (``phalanx up --supervised-agents``, as the DaemonSet
runs it). An agent SIGKILLed mid-training is started again in place by its supervisor;
the ranks it left are reparented to the supervisor meanwhile and train on, are adopted
by the new agent, and the job finishes without a fault or a new generation, equal to
the run alone (deterministic mode). A job whose ranks end while every agent is down
finishes too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from e2e_cli import phalanx
from proc_tree import children, parent, until
from test_elastic import Watch, check_run, progressed, run_job, watched_cluster

from phalanx.schemas import subjects
from phalanx.schemas.messages import GenerationReason, NodeHeartbeat
from phalanx.services.manifest import running_in_manifest

pytestmark = pytest.mark.timeout(300)
NODE = "local-0"


async def test_an_agent_killed_under_its_supervisor_comes_back_and_its_ranks_train_on(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster_dir = tmp_path_factory.mktemp("cluster")
    seen: dict[str, object] = {}
    # Long enough for the supervisor's restart (1 s) and the new agent's start on a
    # loaded machine: the node must not be judged lost meanwhile.
    async with watched_cluster(cluster_dir, "--supervised-agents", "--lost-after", "15") \
            as cluster:
        _, bus, _ = cluster
        beats: asyncio.Queue[NodeHeartbeat] = asyncio.Queue()

        async def on_beat(beat: NodeHeartbeat, _: object) -> None:
            beats.put_nowait(beat)

        await bus.subscribe(subjects.node_heartbeat(NODE), NodeHeartbeat, on_beat)

        async def kill_agent(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, 10)
            supervisor = json.loads((cluster_dir / "up.json").read_text())["agents"][NODE]
            (agent,) = children(supervisor)
            ranks = [r["pid"] for r in running_in_manifest(
                cluster_dir / "agents" / NODE / "ranks.json") if r["job_id"] == job_id]
            # The agent's children, or its zygote's (the agent forks ranks from it).
            agent_and_zygote = {agent, *children(agent)}
            assert len(ranks) == 2
            assert all(parent(pid) in agent_and_zygote for pid in ranks)
            phalanx("chaos", "kill-agent", NODE, "--data-dir", str(cluster_dir))
            # Its ranks outlive it (and its zygote, which ends with it): reparented to
            # the supervisor (the child subreaper).
            await until(lambda: not agent_and_zygote & {parent(pid) for pid in ranks})
            assert {parent(pid) for pid in ranks} == {supervisor}
            # The agent again, in place: a new child of the supervisor that heartbeats.
            await until(lambda: children(supervisor) - {*agent_and_zygote, *ranks})
            while not beats.empty():
                beats.get_nowait()
            await asyncio.wait_for(beats.get(), 30)
            seen["ranks"], seen["agent"] = ranks, children(supervisor) - set(ranks)
            seen["supervisor"] = supervisor

        rec, generations = await run_job(cluster, data_dir, tmp_path, "supervised",
                                         kill_agent)
    # Adopted, not replaced: the same processes trained to the end, in one generation.
    assert [g.reason for g in generations] == [GenerationReason.START], generations
    assert len(seen["agent"]) == 1  # type: ignore[arg-type]
    check_run(rec, tmp_path / "final.pt", reference)


def ended(pid: int) -> bool:
    """The process exited: gone, or a zombie its stopped parent has not reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


async def test_a_job_that_ends_while_its_agents_are_down_finishes(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every agent stalls (SIGSTOP, as a machine under memory pressure) while the job
    trains its last steps; its ranks end meanwhile, unreported; the agents are then
    SIGKILLed and their supervisors start them again. The new agents find the ranks gone,
    their exit statuses unknowable (reported ``lost``): after the ranks' final report that
    is the training's end, not a crash, and the job finishes with no new generation."""
    cluster_dir = tmp_path_factory.mktemp("cluster")
    async with watched_cluster(cluster_dir, "--supervised-agents", "--lost-after", "15") \
            as cluster:
        async def stall_agents_over_the_end(job_id: str, watch: Watch) -> None:
            await progressed(watch, job_id, 10)
            supervisors = json.loads((cluster_dir / "up.json").read_text())["agents"]
            agents = {node: children(pid) - {
                r["pid"] for r in running_in_manifest(
                    cluster_dir / "agents" / node / "ranks.json")}
                for node, pid in supervisors.items()}
            agent_pids = [pid for pids in agents.values() for pid in pids]
            ranks = [r["pid"] for node in supervisors for r in running_in_manifest(
                cluster_dir / "agents" / node / "ranks.json") if r["job_id"] == job_id]
            assert len(agent_pids) == 2 and len(ranks) == 4
            for pid in agent_pids:
                os.kill(pid, signal.SIGSTOP)
            (tmp_path / "release").touch()  # the job trains its last steps at full speed
            await until(lambda: all(ended(pid) for pid in ranks), 120)
            for pid in agent_pids:
                os.kill(pid, signal.SIGKILL)

        _, generations = await run_job(cluster, data_dir, tmp_path, "ends-unseen",
                                       stall_agents_over_the_end)
    assert [g.reason for g in generations] == [GenerationReason.START], generations
    check_run(tmp_path / "rec", tmp_path / "final.pt", reference)

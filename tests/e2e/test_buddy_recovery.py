"""Path 2 end to end: a whole node lost, and every other rank with it; the job continues
from the buddy's replicas.

A 4-replica job of ``examples/train_mlp.py`` on a local cluster (2 agents x 2 slots,
failure domains domain-0 and domain-1) snapshots every committed step into its agents'
shared memory, and each agent replicates its node's snapshots to its buddy, the other
node (placed by the checkpoint service across the domains). Once the job trains, every
rank is frozen, and once the buddy has announced replicas of everything node A's memory
holds, node A dies: its agent and its ranks SIGKILLed and its memory (its snapshot store)
gone; every other rank is SIGKILLed too, its agent alive. No process holds the job's
state, and half of its shares exist only as the buddy's replicas. The job's ranks start
again on the surviving node and must restore the newest step complete in memory before
the loss (none lost) from that node's own snapshots and the replicas, and train to the
end: parameters and every step's loss equal to the fault-free run (deterministic mode),
every sample once per epoch.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from e2e_cli import phalanx
from snapshot_probe import committed, newest_complete, until_replicated
from test_control_plane import leader_pid
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    FaultFreeRuns,
    Watch,
    check_run,
    progressed,
    run_job,
    watched_cluster,
)

from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import CheckpointPolicy, SnapshotRecord, SnapshotTier
from phalanx.services.agent.snapshots import default_root
from phalanx.services.manifest import running_in_manifest

pytestmark = pytest.mark.timeout(300)
STEPS = 160
LOST, SURVIVOR = "local-0", "local-1"  # domain-0 and domain-1: each other's buddy


@pytest.fixture(scope="module")
def reference(fault_free_runs: FaultFreeRuns) -> dict:
    return fault_free_runs(STEPS)


class NodeLoss:
    """The fault, as ``run_job``'s inject: once the job trains, every rank of ``lost`` and
    ``survivor`` is frozen; once ``buddy`` announced a replica of every buffer ``lost``'s
    memory holds, ``lost`` dies with its memory (agent and ranks SIGKILLed, store
    deleted) and every rank of ``survivor`` is SIGKILLed, its agent alive. ``before``
    holds what the stores held then: ``all`` (``lost``'s and ``survivor``'s own
    buffers), ``survivor`` (everything its store held) and ``survivor_own``."""

    def __init__(self, cluster_dir: Path, lost: str, survivor: str, buddy: str,
                 before_loss: Callable[[], Awaitable[None]] | None = None) -> None:
        self.cluster_dir, self.lost, self.survivor, self.buddy = (cluster_dir, lost,
                                                                  survivor, buddy)
        self.before_loss = before_loss  # awaited just before the node dies
        self.stores = {node: default_root(node, cluster_dir / "agents" / node)
                       for node in (lost, survivor)}
        self.replicated: set[tuple[int, int, int, str]] = set()  # step, shards, shard, sum
        self.arrived = asyncio.Event()
        self.before: dict[str, set] = {}

    async def watch(self, bus) -> None:
        """Follow the buddy's announcements of the replicas it took."""
        async def on_snapshot(announced: SnapshotRecord, _) -> None:
            if announced.tier is SnapshotTier.BUDDY and announced.node_id == self.buddy:
                self.replicated.add((announced.step, announced.num_shards, announced.shard,
                                     announced.checksum))
                self.arrived.set()

        await bus.subscribe(subjects.any_id(subjects.ckpt_snapshot), SnapshotRecord,
                            on_snapshot)

    async def __call__(self, job_id: str, watch: Watch) -> None:
        await progressed(watch, job_id, 20)
        lost, survivor, stores = self.lost, self.survivor, self.stores
        ranks = {node: running_in_manifest(self.cluster_dir / "agents" / node / "ranks.json")
                 for node in (lost, survivor)}
        assert [len(r) for r in ranks.values()] == [2, 2], ranks
        for rank in ranks[lost] + ranks[survivor]:  # training stops where it is
            os.kill(rank["pid"], signal.SIGSTOP)
        # Until the buddy announced a replica of every buffer the lost node's memory holds.
        lost_own = await until_replicated(stores[lost] / job_id, self.replicated, self.arrived)
        self.before["all"] = set(lost_own) | set(committed(stores[survivor] / job_id, "w"))
        self.before["survivor"] = set(committed(stores[survivor] / job_id))
        self.before["survivor_own"] = set(committed(stores[survivor] / job_id, "w"))
        if self.before_loss is not None:
            await self.before_loss()
        # The lost node dies with its memory; every other rank dies, its agent alive.
        phalanx("chaos", "kill-agent", lost, "--data-dir", str(self.cluster_dir))
        for rank in ranks[lost] + ranks[survivor]:
            os.kill(rank["pid"], signal.SIGKILL)
        shutil.rmtree(stores[lost], ignore_errors=True)


# Sharded: half of the optimizer's owners' entries exist only in the buddy's replicas. The
# reference is the plain optimizer's run: a sharded AdamW makes the same updates, bitwise.
@pytest.mark.parametrize("args", [[], ["--sharded-optimizer"]], ids=["plain", "sharded"])
async def test_a_node_and_every_rank_lost_the_job_resumes_from_the_buddys_replicas(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory, args: list[str]) -> None:
    cluster_dir = tmp_path_factory.mktemp("cluster")
    loss = NodeLoss(cluster_dir, LOST, SURVIVOR, buddy=SURVIVOR)
    before = loss.before
    async with watched_cluster(cluster_dir) as cluster:
        await loss.watch(cluster[1])
        rec, generations = await run_job(
            cluster, data_dir, tmp_path, "buddy", loss, steps=STEPS, args=args,
            # Frozen ranks are not hung: the test waits on the replicas meanwhile.
            spec={"hang_timeout_s": 60.0,
                  "checkpoint": CheckpointPolicy(memory_every_steps=1)})
    newest = newest_complete(before["all"])
    # The survivor's memory alone (own snapshots + replicas) held that step, and its own
    # snapshots alone did not: the replicas were needed.
    assert newest is not None and newest < STEPS - 1, "the job ended before the loss"
    assert newest_complete(before["survivor"]) == newest, before
    assert newest_complete(before["survivor_own"]) is None, before
    records = record.read(rec)
    restores = [line for lines in records.values() for line in lines
                if line["kind"] == "restore"]
    # Every restarted rank restored the newest step complete in memory before the loss.
    assert restores and {line["step"] for line in restores} == {newest}, (restores, newest)
    assert all(line["tier"] == "memory" and line["corrupt"] == [] for line in restores)
    assert sum(line["from_replicas"] for line in restores) > 0, restores
    # They ran on the surviving node only: its memory held every shard.
    restored_in = {line["generation"] for line in restores}
    for generation in (g for g in generations if g.generation in restored_in):
        assert {m.node_id for m in generation.members} == {SURVIVOR}, generation
    check_run(rec, tmp_path / "final.pt", reference)


@pytest.mark.parametrize("handover", [False, True], ids=["leaders-alive", "leaders-killed"])
async def test_a_lost_nodes_shards_are_fetched_from_a_buddy_that_runs_no_member(
        data_dir: Path, reference: dict, tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory, handover: bool) -> None:
    """Three nodes: the job runs on A and C (domain-0), and their buddy B (domain-1, the
    only node in another domain) is cordoned, so it runs none of the job's ranks but
    keeps A's replicas. A dies with its memory and C's ranks are killed: the job starts
    again on C alone, whose node lacks A's shards. The members fetch them from B's agent
    onto C before restoring, and resume at the newest step complete in memory.

    With ``handover``, the leaders of health, admission and elasticity are SIGKILLed just
    before A dies: their standbys never hear A. Health must still judge A lost from its
    takeover (its ranks, departing from the shrunk placement, leave only by that fault);
    before, none did and the job waited on them for good."""
    lost, buddy, survivor = "local-0", "local-1", "local-2"
    cluster_dir = tmp_path_factory.mktemp("cluster")
    standbys = ("--admission", "2", "--health", "2", "--elasticity", "2") if handover else ()
    loss = NodeLoss(cluster_dir, lost, survivor, buddy)
    before = loss.before
    async with watched_cluster(cluster_dir, *standbys, agents=3) as cluster:
        if handover:
            async def kill_leaders() -> None:
                for service in ("health", "admission", "elasticity"):
                    os.kill((await leader_pid(cluster[1], cluster_dir, service))[1],
                            signal.SIGKILL)

            loss.before_loss = kill_leaders
        phalanx("node", "cordon", buddy, "--data-dir", str(cluster_dir))
        await loss.watch(cluster[1])
        rec, generations = await run_job(
            cluster, data_dir, tmp_path, "fetch", loss, steps=STEPS,
            spec={"hang_timeout_s": 60.0,
                  "checkpoint": CheckpointPolicy(memory_every_steps=1)})
    newest = newest_complete(before["all"])
    assert newest is not None and newest < STEPS - 1, "the job ended before the loss"
    # The survivor's node alone held no complete step: A's shards had to come from B.
    assert newest_complete(before["survivor"]) is None, before
    records = record.read(rec)
    lines = [line for replica in records.values() for line in replica]
    restores = [line for line in lines if line["kind"] == "restore"]
    fetches = [line for line in lines if line["kind"] == "fetch"]
    assert restores and {line["step"] for line in restores} == {newest}, (restores, newest)
    assert all(line["tier"] == "memory" and line["corrupt"] == [] for line in restores)
    # Each of A's two shards was fetched once, by one member, with the step restored.
    assert fetches and {line["step"] for line in fetches} == {newest}, fetches
    assert sorted(s for line in fetches for s in line["shards"]) == \
        sorted(s for line in fetches for s in line["wanted"]), fetches
    assert len([s for line in fetches for s in line["shards"]]) == 2, fetches
    restored_in = {line["generation"] for line in restores}
    for generation in (g for g in generations if g.generation in restored_in):
        assert {m.node_id for m in generation.members} == {survivor}, generation
    # The fetched copies of A's shards went once the job trained on C alone: no newer
    # replica from A would ever have replaced them.
    log = (cluster_dir / "logs" / f"agent-{survivor}.log").read_text()
    assert "pruned the replicas of nodes the job left" in log
    check_run(rec, tmp_path / "final.pt", reference)

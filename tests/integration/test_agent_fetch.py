"""An agent sends a snapshot copy it holds to another node's store when a rank asks (the
fetch before a restore), over real agents and a real server: the copy arrives as its
owner's replica, committed and listed; what cannot be done is refused naming why."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_replication import JOB, commit

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.runtime.snapshot import held_in
from phalanx.schemas import snapshot_file, subjects
from phalanx.schemas.messages import ReplicaFetch, ReplicaFetched, SnapshotReserve
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.service import AgentService


def agent(node: str, tmp_path: Path, bus_config: BusConfig) -> AgentService:
    return AgentService(AgentConfig(node_id=node, slots=1, heartbeat_interval_s=0.2,
                                    work_dir=str(tmp_path / node),
                                    snapshot_dir=str(tmp_path / f"{node}-store"),
                                    replica_host="127.0.0.1"), bus_config)


async def test_an_agent_sends_what_it_holds_to_another_node_and_refuses_saying_why(
        bus: Bus, bus_config: BusConfig, uid: str, tmp_path: Path) -> None:
    holder, member = f"{uid}-holder", f"{uid}-member"
    agents = [agent(holder, tmp_path, bus_config), agent(member, tmp_path, bus_config)]
    for a in agents:
        await a.start()
    try:
        ring = agents[0].snapshots.reserve(SnapshotReserve(
            job_id=JOB, replica_id="r1-0", shard=1, shards=2, nbytes=8192))
        commit(ring[0], 7, 1, 2)

        def fetch(**changes) -> ReplicaFetch:
            return ReplicaFetch(**{"job_id": JOB, "step": 7, "shard": 1, "shards": 2,
                                   "to_node": member, **changes})

        reply = await bus.request(subjects.agent_fetch(holder, JOB), fetch(), ReplicaFetched,
                                  timeout_s=10)
        header = snapshot_file.read_header(ring[0].read_bytes())
        assert (reply.node_id, reply.nbytes) == (holder, header.meta_length + header.length)
        store = agents[1].snapshots.job_dir(JOB)
        [replica] = store.iterdir()
        assert replica.name == f"buddy.{holder}.w2-s1.0"
        assert snapshot_file.read_header(replica.read_bytes()) == header
        assert [(h.step, h.shard) for h in held_in(store, JOB)] == [(7, 1)]
        for changes, code, reason in [
                ({"step": 8}, "404", f"{holder} holds no committed copy of shard 1/2"),
                ({"shards": 4}, "404", "holds no committed copy"),
                ({"to_node": holder}, "409", "which is this node"),
                ({"to_node": f"{uid}-nowhere"}, "404", "is not registered"),
                # A fetch of this job's shard asked on another job's subject.
                ({"job_id": "other"}, "400", f"belongs to job '{JOB}'")]:
            with pytest.raises(RemoteError) as refused:
                await bus.request(subjects.agent_fetch(holder, JOB), fetch(**changes),
                                  ReplicaFetched, timeout_s=10)
            assert refused.value.code == code and reason in refused.value.description, \
                (changes, refused.value)
    finally:
        for a in agents:
            await a.stop()

"""A 3-server NATS cluster with R3 buckets loses a server: nothing stored is lost.

Real nats-servers (:class:`~phalanx.services.natsd.NatsCluster`). The client is
connected to the server that is killed, which also leads the bucket's stream, so
both failovers happen at once: the client reconnects to another server, and the
bucket's survivors elect a leader. Writes made meanwhile must not fail
(:mod:`phalanx.bus.kv` retries them through the election), and every value
written before must still be there.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.bus.client import Bus, replicas_for
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import JOB_EVENTS, ensure_job_events
from phalanx.schemas.messages import Lease
from phalanx.services.natsd import NatsCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "js", 3, log_dir=tmp_path) as running:
        yield running


def lease(holder: str, epoch: int) -> Lease:
    return Lease(holder=holder, epoch=epoch, expires_at=1e9)


async def move_leader(bus: Bus, stream: str, server: str) -> None:
    """Have ``stream``'s Raft group elect ``server`` (a stepdown with a preferred peer)."""
    while (await bus.js.stream_info(stream)).cluster.leader != server:
        await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                             json.dumps({"placement": {"preferred": server}}).encode(),
                             timeout=5)
        await asyncio.sleep(0.2)


async def test_r3_bucket_keeps_every_value_and_takes_writes_across_a_server_loss(
        cluster: NatsCluster, uid: str) -> None:
    config = BusConfig.load(env={"PHALANX_NATS_REPLICAS": "3"}, servers=",".join(cluster.urls))
    async with await Bus.connect(config, name="test") as bus:
        assert replicas_for(bus.js) == 3
        kv = await TypedKV.open(bus.js, f"cluster_{uid}", Lease)
        await ensure_job_events(bus)
        for name in (f"KV_cluster_{uid}", JOB_EVENTS):  # both created R3
            assert (await bus.js.stream_info(name)).config.num_replicas == 3
        before = {f"k{i}": await kv.put(f"k{i}", lease(f"h{i}", i)) for i in range(20)}

        url = bus.nc.connected_url
        assert url is not None
        victim = next(i for i, s in enumerate(cluster.servers) if s.port == url.port)
        name = cluster.servers[victim].routes.server_name  # type: ignore[union-attr]
        await move_leader(bus, f"KV_cluster_{uid}", name)
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        bus.on_reconnect(on_reconnect)
        cluster.kill(victim)
        started = time.monotonic()
        # Through the election: a conditional write and a read-modify-write succeed.
        revision = await kv.update("k0", lease("after", 100), before["k0"])
        written_s = time.monotonic() - started
        entry = await kv.modify("k1", lambda old: lease("modified", old.epoch + 1))
        assert entry.value == lease("modified", 2)
        await asyncio.wait_for(reconnected.wait(), 10)
        assert bus.nc.connected_url is not None and bus.nc.connected_url.port != url.port

        survivors = await kv.entries()
        assert survivors[1] == []
        values = {e.key: e.value for e in survivors[0]}
        assert values == {"k0": lease("after", 100), "k1": lease("modified", 2),
                          **{f"k{i}": lease(f"h{i}", i) for i in range(2, 20)}}
        assert (await kv.get("k0")).revision == revision  # type: ignore[union-attr]
        leader = (await bus.js.stream_info(f"KV_cluster_{uid}")).cluster.leader
        assert leader not in (None, name)
        print(f"first write after the loss of {name} took {written_s:.2f} s")

        # The dead server comes back on its ports and store and catches up.
        cluster.restart(victim)
        async with await Bus.connect(BusConfig.load(env={}, servers=cluster.urls[victim])) \
                as direct:
            reader = await TypedKV.open(direct.js, f"cluster_{uid}", Lease)
            assert (await reader.get("k1")).value == lease("modified", 2)  # type: ignore[union-attr]


def test_a_cluster_forms_and_elects_a_new_meta_leader_without_one_server(
        cluster: NatsCluster) -> None:
    leader = cluster.wait_formed()
    cluster.kill(leader)
    started = time.monotonic()
    survivor_leader = cluster.wait_formed()
    assert survivor_leader != leader and cluster.servers[survivor_leader].running
    print(f"meta leader elected {time.monotonic() - started:.2f} s after the loss")

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
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest

from phalanx.bus.client import Bus, replicas_for
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.bus.stream import JOB_EVENTS, ensure_job_events
from phalanx.schemas import subjects
from phalanx.schemas.messages import Lease
from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.roles import Role
from phalanx.services.natsd import NatsCluster, NatsServer, Routes
from phalanx.services.ports import free_port


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


def wait_logged(path: Path, needle: str, timeout_s: float = 30.0) -> str:
    """The first line of the server log ``path`` that holds ``needle`` (read as it grows)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        found = [line for line in text.splitlines() if needle in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{needle!r} not in {path}:\n{text[-3000:]}"
        time.sleep(0.1)


async def test_a_secured_clusters_routes_admit_only_its_certificate_and_secret(
        tmp_path: Path, uid: str) -> None:
    """``phalanx up --secure --nats-cluster``'s bus: routes over mutual TLS with the CA's
    route certificate, and the routes' secret. A message crosses the cluster between two
    identities; a server with another CA's certificate is refused at the handshake, and
    one with the cluster's certificate but not its secret is refused its route."""
    auth = AuthDir.init(tmp_path / "auth")
    auth.add(Role.CLI)
    with NatsCluster(tmp_path / "js", 3, log_dir=tmp_path, config_file=auth.config_path,
                     secured=auth.route_security()) as cluster:
        env = auth.env(Role.CLI)
        near, far = (BusConfig.load(env=env, servers=url) for url in cluster.urls[:2])
        async with await Bus.connect(near) as sender, await Bus.connect(far) as receiver:
            subject = subjects.agent_status(f"node-{uid}")  # the CLI's to send and hear
            heard = await receiver.nc.subscribe(subject)
            await receiver.round_trip(5)
            deadline = time.monotonic() + 20
            while True:  # until the receiver's interest has crossed the routes
                await sender.nc.publish(subject, b"across the routes")
                try:
                    assert (await heard.next_msg(timeout=0.5)).data == b"across the routes"
                    break
                except nats.errors.TimeoutError:
                    assert time.monotonic() < deadline, "nothing crossed the routes"

        members = tuple(f"nats://127.0.0.1:{s.routes.port}" for s in cluster.servers
                        if s.routes is not None)
        cluster_secret = auth.route_security()
        foreign = AuthDir.init(tmp_path / "foreign")
        impostors = {  # each knows what the other lacks
            "other-ca": dataclasses.replace(foreign.route_security(),
                                            password=cluster_secret.password),
            "no-secret": dataclasses.replace(cluster_secret, password="guessed"),
        }
        for name, secured in impostors.items():
            routes = Routes(cluster_name=cluster.name, server_name=name, port=free_port(),
                            routes=members, secured=secured)
            log = tmp_path / f"{name}.log"
            with NatsServer(tmp_path / name, log_path=log, routes=routes,
                            config_file=foreign.config_path):
                refused = "TLS route handshake error" if name == "other-ca" \
                    else "Route Error 'Authorization Violation'"
                assert refused in wait_logged(log, refused)
                # Never a member: it heard of no JetStream meta leader.
                assert "metadata leader" not in log.read_text(errors="replace")

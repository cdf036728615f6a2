"""The service shell over a real server: $SRV API, bad input, shutdown."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

from phalanx.bus.client import Bus, Delivery, raise_for_error
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import RemoteError
from phalanx.schemas.errors import MustStop
from phalanx.schemas.messages import NodeInfo, NodeRecord, NodeStatusRequest
from phalanx.services.base import Service


class EchoService(Service):
    def __init__(self, config: BusConfig, uid: str) -> None:
        super().__init__(f"echo-{uid}", "test", config, shutdown_timeout_s=1.0)
        self.uid = uid
        self.loop_finished = asyncio.Event()

    async def setup(self) -> None:
        await self.add_endpoint("status", f"t.{self.uid}.status", NodeStatusRequest, self.status)
        self.spawn(self.loop(), "loop")

    async def status(self, _: NodeStatusRequest, __: Delivery) -> NodeRecord:
        info = NodeInfo(node_id=self.uid, host="h", slots=1, failure_domain="d")
        return NodeRecord(node=info)

    async def loop(self) -> None:
        while not await self.sleep_or_stop(0.05):
            pass
        self.loop_finished.set()


async def _srv(bus: Bus, verb: str, name: str) -> dict:
    reply = await bus.nc.request(f"$SRV.{verb}.{name}", b"", timeout=10)
    return json.loads(reply.data)


async def test_service_answers_srv_api_and_survives_garbage(bus: Bus, bus_config: BusConfig,
                                                            uid: str) -> None:
    service = EchoService(bus_config, uid)
    await service.start()
    try:
        ping = await _srv(bus, "PING", service.name)
        assert ping["name"] == service.name
        info = await _srv(bus, "INFO", service.name)
        assert [e["subject"] for e in info["endpoints"]] == [f"t.{uid}.status"]

        for junk in (b"", b"\xc1", b"\x93\x01\x02\x03", b'{"json": true}'):
            reply = await bus.nc.request(f"t.{uid}.status", junk, timeout=10)
            with pytest.raises(RemoteError) as err:
                raise_for_error(reply, f"t.{uid}.status")
            assert err.value.code == "400"
            assert "phalanx.node_status_request.v1" in err.value.description

        assert (await _srv(bus, "PING", service.name))["name"] == service.name
        reply = await bus.request(f"t.{uid}.status", NodeStatusRequest(), NodeRecord)
        assert reply.node.node_id == uid

        stats = await _srv(bus, "STATS", service.name)
        endpoint = stats["endpoints"][0]
        assert endpoint["data"]["bad_messages"] == 4
        assert endpoint["num_errors"] == 4 and endpoint["num_requests"] == 5
    finally:
        await service.stop()
    assert service.loop_finished.is_set()  # the loop saw the stop and ended by itself
    await service.stop()  # idempotent


class WaitingService(Service):
    """A loop that waits on something that never comes (as a bus watch may)."""

    def __init__(self, config: BusConfig, uid: str) -> None:
        super().__init__(f"waiting-{uid}", "test", config, shutdown_timeout_s=3600.0)
        self.waiting = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def setup(self) -> None:
        self.spawn(self.until_stopped(self.forever()), "forever")

    async def forever(self) -> None:
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_stop_cancels_a_loop_run_until_stopped_instead_of_waiting_for_it(
        bus_config: BusConfig, uid: str) -> None:
    service = WaitingService(bus_config, uid)
    await service.start()
    await asyncio.wait_for(service.waiting.wait(), 10)
    # The stop would wait an hour for the loop (its shutdown timeout) if it were not
    # cancelled; the test's own timeout ends it long before.
    await service.stop()
    assert service.cancelled.is_set()


class FailingLoopService(Service):
    """A loop that fails twice and then runs; a one-off task that fails; and, when
    asked, a task that must stop the service."""

    def __init__(self, config: BusConfig, uid: str) -> None:
        super().__init__(f"failing-{uid}", "test", config, shutdown_timeout_s=1.0)
        self.starts = 0
        self.running = asyncio.Event()

    async def setup(self) -> None:
        self.keep_running(self.loop, "flaky loop")
        self.spawn(self.one_off(), "one-off")

    async def loop(self) -> None:
        self.starts += 1
        if self.starts <= 2:
            raise KeyError("a bug in the loop")
        self.running.set()
        while not await self.sleep_or_stop(0.05):
            pass

    async def one_off(self) -> None:
        raise RuntimeError("a one-off task's bug")


def failures(task: str) -> float:
    return REGISTRY.get_sample_value("phalanx_task_failures_total", {"task": task}) or 0.0


async def test_a_failing_background_task_never_stops_the_service_but_must_stop_does(
        bus_config: BusConfig, uid: str) -> None:
    service = FailingLoopService(bus_config, uid)
    before = failures("flaky"), failures("one-off")
    await service.start()
    try:
        await asyncio.wait_for(service.running.wait(), 10)  # started a third time
        assert service.starts == 3 and not service.stopping
        assert (failures("flaky"), failures("one-off")) == (before[0] + 2, before[1] + 1)

        async def node_id_taken() -> None:
            raise MustStop("another live agent holds this node id")

        service.spawn(node_id_taken(), "heartbeat")
        await asyncio.wait_for(service._stop_requested.wait(), 10)
    finally:
        await service.stop()

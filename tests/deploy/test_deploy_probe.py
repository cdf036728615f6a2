"""deploy/probe.py, the exec probe of the containers, against a real server and service."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest
from deploy_local import DEPLOY

from phalanx.bus.config import BusConfig
from phalanx.services.base import Service
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import free_port


async def probe(*args: str, url: str, **env: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(DEPLOY / "probe.py"), *args, env={"PHALANX_NATS_URL": url, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    return process.returncode, out.decode()


@pytest.fixture
async def service(nats_server: NatsServer, uid: str) -> AsyncIterator[str]:
    """A running service named ``probe-<uid>``, instance ``pod-a``."""
    config = BusConfig.load(env={}, servers=[nats_server.url])
    running = Service(f"probe-{uid}", "pod-a", config)
    await running.start()
    try:
        yield running.name
    finally:
        await running.stop()


async def test_ready_and_live_when_this_instance_answers(service: str,
                                                         nats_server: NatsServer) -> None:
    for kind in ("ready", "live"):
        code, out = await probe(kind, service, "--instance", "pod-a", url=nats_server.url)
        assert code == 0, out
        assert f"{service} pod-a answered" in out


async def test_another_instance_answering_is_not_this_one(service: str,
                                                          nats_server: NatsServer) -> None:
    for kind in ("ready", "live"):
        code, out = await probe(kind, service, "--instance", "pod-b", "--timeout", "0.5",
                                url=nats_server.url)
        assert code == 1, out
        assert "pod-b did not answer within 0.5 s (answered: pod-a)" in out


async def test_instance_from_the_environment_and_default_host_rule(
        service: str, nats_server: NatsServer) -> None:
    code, out = await probe("ready", service, url=nats_server.url,
                            PHALANX_PROBE_INSTANCE="pod-a")
    assert code == 0 and "pod-a answered" in out, out
    # Neither: an instance named after this host (<host> or <host>-...); pod-a is not.
    code, out = await probe("ready", service, "--timeout", "0.5", url=nats_server.url)
    assert code == 1 and "(answered: pod-a)" in out, out


async def test_unreachable_bus_fails_readiness_but_not_liveness(uid: str) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    code, out = await probe("ready", f"probe-{uid}", "--timeout", "1", url=url)
    assert code == 1 and "not ready: bus unreachable" in out, out
    code, out = await probe("live", f"probe-{uid}", "--timeout", "1", url=url)
    assert code == 0 and "bus unreachable" in out and "not judged" in out, out

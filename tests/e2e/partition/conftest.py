"""The partition modules' cluster: one per module, each node in a network namespace of
its own (:mod:`harness`), skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from test_elastic import Watch, watching

from phalanx.bench.partition_harness import NamespacedCluster, partitioned_cluster, unavailable
from phalanx.bus.client import Bus
from phalanx.schemas import settings


@pytest.fixture(scope="module")
async def partitioned(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory
                      ) -> AsyncIterator[tuple[NamespacedCluster, Bus, Watch]]:
    """Two nodes of two slots, each in its namespace; the bus watched from this machine.
    A module's ``CLUSTER`` (a dict of :func:`partitioned_cluster`'s arguments) changes
    what it starts."""
    why = unavailable()
    if why is not None:
        pytest.skip(f"partition harness: {why}")
    cordon = settings.HEALTH("cordon_faults")
    before = os.environ.get(cordon)
    # A node cut off, or one whose rank a test killed, is not a bad node.
    os.environ[cordon] = "1000"
    try:
        async with partitioned_cluster(tmp_path_factory.mktemp("cluster"),
                                       **getattr(request.module, "CLUSTER", {})) as cluster:
            assert cluster.nats_url is not None
            async with watching(cluster.nats_url) as (bus, watch):
                yield cluster, bus, watch
    finally:
        if before is None:
            del os.environ[cordon]
        else:
            os.environ[cordon] = before

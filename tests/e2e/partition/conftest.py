"""The partition modules' cluster: one per module, each node in a network namespace of
its own (:mod:`harness`), skipped with the reason where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from cuts import watched_partitioned
from harness import NamespacedCluster
from test_elastic import Watch

from phalanx.bus.client import Bus


@pytest.fixture(scope="module")
async def partitioned(tmp_path_factory: pytest.TempPathFactory
                      ) -> AsyncIterator[tuple[NamespacedCluster, Bus, Watch]]:
    """Two nodes of two slots, each in its namespace; the bus watched from this machine."""
    async with watched_partitioned(tmp_path_factory.mktemp("cluster")) as running:
        yield running

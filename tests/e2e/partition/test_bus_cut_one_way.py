"""A node that hears nothing of the bus while the bus still hears it (issue 53): what
the bus sends it is dropped, what it sends arrives. Its agent's round trips go
unanswered as in a cut both ways, and it fences its ranks within the same bound; the
job goes on without them (:mod:`test_bus_cut`, whose checks these are; a module of its
own for a cluster of its own, each module near 30 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bus_cut import CUT, cut_off_from_the_bus
from test_elastic import Watch

from phalanx.bench.partition_harness import BUS, NamespacedCluster
from phalanx.bus.client import Bus


@pytest.mark.timeout(150)
async def test_a_node_that_hears_nothing_of_the_bus_stops_its_ranks(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    await cut_off_from_the_bus(partitioned, data_dir, reference, tmp_path, "deaf",
                               lambda net: net.cut(BUS, CUT, both=False))

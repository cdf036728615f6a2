"""A cluster of nodes in network namespaces of their own (:mod:`harness`), with no fault.

Each node's agent is given its address, and its host name resolves to 127.0.1.1 on the
node itself, as on a Debian machine: a job trains across the nodes only where the
address peers reach a rank at (its rendezvous store, gloo) follows the node's address.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import NamespacedCluster
from test_elastic import Watch, check_run, run_job

from phalanx.bus.client import Bus


@pytest.mark.timeout(120)
async def test_a_job_trains_across_namespaces_each_node_at_its_own_address(
        partitioned: tuple[NamespacedCluster, Bus, Watch], data_dir: Path, reference: dict,
        tmp_path: Path) -> None:
    cluster, bus, watch = partitioned

    async def nothing(job_id: str, watch: Watch) -> None:
        pass

    rec, generations = await run_job((cluster.data_dir, bus, watch), data_dir, tmp_path,
                                     "across", nothing)
    assert [g.world_size for g in generations] == [4]
    hosts = {m.endpoint.rpartition(":")[0] for m in generations[0].members}
    assert hosts == {n.address for n in cluster.net.nodes.values()}
    check_run(rec, tmp_path / "final.pt", reference)

"""The partition harness itself: its cuts, one way or both, its loss, its heal, and that
it leaves nothing behind, whoever stops it (real namespaces, a bridge, nftables; UDP
datagrams as probes, since a TCP connection needs both ways)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.bench.partition_harness import BUS, Network, delivered, network, sh, sweep, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"partition harness: {WHY}")


def reach(net: Network) -> set[tuple[str, str]]:
    """Every (from, to) pair a datagram gets through."""
    ends = [BUS, *net.nodes]
    return {(a, b) for a in ends for b in ends if a != b and delivered(net, a, b, 2) > 0}


def left(net_names: list[str]) -> list[str]:
    """Which of these names (namespaces, links, tables) still exist."""
    existing = sh("ip", "netns", "list") + sh("ip", "-o", "link") + sh("nft", "list", "tables")
    return [name for name in net_names if name in existing]


def test_cuts_one_way_or_both_loss_and_heal_and_nothing_left() -> None:
    with network(["a", "b"]) as net:
        every = {(x, y) for x in (BUS, "a", "b") for y in (BUS, "a", "b") if x != y}
        assert reach(net) == every
        net.cut("a", BUS, both=False)  # the node hears the bus; the bus does not hear it
        assert reach(net) == every - {("a", BUS)}
        net.cut("a", "b")
        assert reach(net) == every - {("a", BUS), ("a", "b"), ("b", "a")}
        net.heal("a", BUS)
        assert reach(net) == every - {("a", "b"), ("b", "a")}
        net.heal()
        assert reach(net) == every
        net.loss("b", BUS, 50, both=False)
        arrived = delivered(net, "b", BUS, 400, wait_s=0.5)
        assert 120 < arrived < 280, arrived  # 200 expected; 6 sigma either way
        net.heal()  # a probe through the 50 % loss left would pass by chance
        net.isolate("a")
        assert reach(net) == {(BUS, "b"), ("b", BUS)}
        names = [net.bridge, net.table, *(n.netns for n in net.nodes.values())]
        assert left(names) == names
    assert left(names) == []


def test_the_sweep_removes_what_a_dead_owner_left_and_nothing_of_a_live_one(
        tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-c",
         "from phalanx.bench.partition_harness import Network; n = Network(['a']).start(); "
         "print(n.bridge, n.table, *(x.netns for x in n.nodes.values()))"],
        capture_output=True, text=True, check=True)
    orphans = made.stdout.split()
    assert left(orphans) == orphans  # its owner exited without stopping it
    with network(["a"]) as live:  # the sweep at its start removes the orphans
        assert left(orphans) == []
        mine = [live.bridge, live.table, *(n.netns for n in live.nodes.values())]
        sweep()
        assert left(mine) == mine

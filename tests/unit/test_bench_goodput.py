"""bench/goodput.py's pure parts: the failure schedule, the checkpoint interval and the
accounting of efficiency and lost time, which every system's figures go through; and its
injector against four `sleep` processes standing for two nodes' ranks."""

from __future__ import annotations

import asyncio
import math
import statistics
import subprocess
from pathlib import Path

import pytest

from phalanx.bench.goodput import (
    MIX,
    NODES,
    SYSTEMS,
    Commit,
    Failure,
    Injector,
    Rank,
    arguments,
    efficiency,
    lost_time,
    median_step_s,
    schedule,
    young_daly_s,
)


def test_the_schedule_is_the_same_for_every_system_and_poisson_in_its_gaps() -> None:
    failures = schedule(seed=3, mtbf_s=10.0, duration_s=20_000.0)
    assert failures == schedule(seed=3, mtbf_s=10.0, duration_s=20_000.0)
    assert failures != schedule(seed=4, mtbf_s=10.0, duration_s=20_000.0)
    times = [f.at_s for f in failures]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 20_000
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(10.0, rel=0.05)
    # Exponential: the standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(10.0, rel=0.1)
    shares = {k: sum(f.kind == k for f in failures) / len(failures) for k in MIX}
    assert shares == pytest.approx(MIX, abs=0.03)
    assert all(0 <= f.pick < 1 for f in failures)


def test_young_daly_interval() -> None:
    assert young_daly_s(checkpoint_s=2.0, mtbf_s=60.0) == pytest.approx(math.sqrt(240))
    assert young_daly_s(0.5, 15.0) < young_daly_s(0.5, 60.0)


def test_efficiency_counts_shares_of_the_batch_within_the_window() -> None:
    commits = [Commit(t=0.5 + i, step=i) for i in range(10)]  # one step a second
    commits.append(Commit(t=10.5, step=10, share=0.5))  # half the batch
    work, eff = efficiency(commits, start=2.0, end=12.0, step_s=1.0)
    assert work == 8.5  # steps 2..9 whole, step 10 half
    assert eff == pytest.approx(0.85)
    assert median_step_s(commits, 0.0, 12.0) == 1.0  # the half step is not a full one


def test_lost_time_is_the_stalls_and_the_degraded_rest() -> None:
    # Steps of 1 s, a 4 s gap (a stall of 3 s), then steps of 2 s (degraded).
    times = [1, 2, 3, 7, 9, 11]
    commits = [Commit(float(t), i) for i, t in enumerate(times)]
    parts = lost_time(commits, start=0.0, end=12.0, step_s=1.0)
    assert parts["stalled"] == pytest.approx(3)  # the gap 3 -> 7 alone
    lost = 12.0 - len(times) * 1.0
    assert sum(parts.values()) == pytest.approx(lost)
    assert parts["degraded"] == pytest.approx(lost - parts["stalled"])


def test_the_defaults_are_the_issues_settings() -> None:
    args = arguments().parse_args([])
    assert args.mtbf == [300.0, 60.0, 15.0] and args.duration == 300.0
    assert args.systems == list(SYSTEMS) and isinstance(args.seed, int)
    assert arguments().parse_args(["--mtbf", "60", "15"]).mtbf == [60.0, 15.0]


class Sleepers:
    """Four `sleep` processes as the ranks of two nodes."""

    name = "sleepers"

    def __init__(self) -> None:
        self.procs = {node: [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
                      for node in NODES}
        self.lost: list[str] = []

    def ranks(self) -> list[Rank]:
        return [Rank(node, p.pid) for node, procs in self.procs.items() for p in procs
                if p.poll() is None]

    async def lose_node(self, node: str) -> None:
        self.lost.append(node)
        for p in self.procs[node]:
            p.kill()
            p.wait()

    async def restore_node(self, node: str) -> None:
        self.lost.remove(node)


async def test_a_node_loss_with_a_node_down_is_a_rank_kill_and_hangs_end() -> None:
    system = Sleepers()
    injector = Injector(system, hang_s=0.2, node_down_s=60.0)
    try:
        await injector.inject(Failure(0.0, "node_loss", 0.0))
        await injector.inject(Failure(0.0, "node_loss", 0.0))  # node-1 alone is up
        await asyncio.sleep(0.1)  # the killed rank is gone
        await injector.inject(Failure(0.0, "hang", 0.0))
        assert [i.kind for i in injector.log] == ["node_loss", "rank_kill", "hang"]
        assert system.lost == ["node-0"]
        (alive,) = system.ranks()
        assert injector.stopped == {alive.pid}
        await asyncio.sleep(0.5)  # the hang is let go on
        assert not injector.stopped
        assert Path(f"/proc/{alive.pid}/stat").read_text().split()[2] != "T"
    finally:
        await injector.close()
        for procs in system.procs.values():
            for p in procs:
                p.kill()
                p.wait()

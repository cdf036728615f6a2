"""bench/goodput.py's pure parts: the failure schedule, the checkpoint interval and the
accounting of efficiency and lost time, which every system's figures go through."""

from __future__ import annotations

import math
import statistics

import pytest

from phalanx.bench.goodput import (
    MIX,
    Commit,
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
    assert times == sorted(times) and 0 < times[0] and times[-1] < 20_000
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

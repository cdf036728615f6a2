"""Fault injection inside a rank: who dies when, and a job held slow until released."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.runtime.chaos import Kill, Pace, Plan, hold, parse_chaos_kill, parse_chaos_pace
from phalanx.schemas.errors import ConfigError


def test_chaos_kill_names_its_replica_step_and_phase() -> None:
    value = "r1-0:40:allreduce,r2-0:7:boundary,r3-0:g2:update,r4-0:8:forward"
    assert parse_chaos_kill(value, "r1-0") == Kill("allreduce", step=40)
    assert parse_chaos_kill(value, "r4-0") == Kill("forward", step=8)
    assert parse_chaos_kill(value, "r2-0") == Kill("boundary", step=7)
    assert parse_chaos_kill(value, "r3-0") == Kill("update", generation=2)
    assert parse_chaos_kill(value, "r0-0") is None and parse_chaos_kill("", "r0-0") is None
    with pytest.raises(ConfigError, match="'r1-0:x:boundary' is not"):
        parse_chaos_kill("r1-0:x:boundary", "r0-0")  # refused whoever reads it


def test_a_kill_in_a_rendezvous_names_its_generation_and_no_step() -> None:
    kill = parse_chaos_kill("r0-0:g1:rendezvous", "r0-0")
    assert kill == Kill("rendezvous", generation=1)
    plan = Plan.of(kill)
    assert plan.in_rendezvous(1) and not plan.in_rendezvous(2)
    plan.arm(1, 5)  # generation 1 applied after all: none of its steps is the kill's
    assert not plan.due(5, "rendezvous")
    with pytest.raises(ConfigError, match="'r0-0:3:rendezvous' is not"):
        parse_chaos_kill("r0-0:3:rendezvous", "r0-0")  # a rendezvous is in no step


def test_chaos_kill_names_a_replica_groups_ranks_or_one_of_them() -> None:
    assert parse_chaos_kill("r1-0:5:update", "r1-0", group_rank=1) == Kill("update", step=5)
    assert parse_chaos_kill("r1-0.g1:5:update", "r1-0", group_rank=1) == Kill("update", step=5)
    assert parse_chaos_kill("r1-0.g1:5:update", "r1-0", group_rank=0) is None
    assert parse_chaos_kill("r1-0.g1:5:update", "r1-0") is None  # one rank per replica


def test_a_paced_job_waits_before_every_step_until_released(tmp_path: Path) -> None:
    slept: list[float] = []
    release = tmp_path / "release"
    pace = Pace(0.25, release, slept.append)
    pace.wait()
    pace.wait()
    assert slept == [0.25, 0.25]
    release.touch()
    pace.wait()
    release.unlink()  # released for good: the file is not looked at again
    pace.wait()
    assert slept == [0.25, 0.25] and pace.released


@pytest.mark.parametrize("value", ["x:/tmp/r", "0:/tmp/r", "61:/tmp/r", "0.1", "0.1:", "-1:/r"])
def test_a_pace_that_is_not_seconds_and_a_path_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match=f"PHALANX_CHAOS_PACE: {value!r} is not"):
        parse_chaos_pace(value)


def test_a_pace_is_seconds_and_a_path() -> None:
    pace = parse_chaos_pace("0.05:/tmp/phalanx-release")
    assert pace is not None and (pace.seconds, pace.release) == (
        0.05, Path("/tmp/phalanx-release"))
    assert parse_chaos_pace("") is None


def test_a_held_replica_waits_until_released_and_others_go_on(tmp_path: Path) -> None:
    release = tmp_path / "release"
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            release.touch()

    hold(f"r1-1:{release}", "r1-1", sleep=nap)
    assert naps == [0.05] * 3  # until the path existed
    naps.clear()
    hold(f"r1-1:{tmp_path / 'never'}", "r0-0", sleep=nap)  # not named: no wait
    hold("", "r1-1", sleep=nap)
    assert naps == []
    with pytest.raises(ConfigError, match="PHALANX_CHAOS_HOLD"):
        hold("r1-1", "r1-1", sleep=nap)

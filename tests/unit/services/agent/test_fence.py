"""The fencing rule of a node cut from the bus (:mod:`phalanx.services.agent.fence`)."""

from __future__ import annotations

from phalanx.schemas.messages import ExitCause
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import StopReason, exit_cause
from phalanx.services.agent.fence import BusWatch, bound_s


def test_ranks_are_fenced_once_the_bus_is_unconfirmed_for_fence_after_s() -> None:
    watch = BusWatch(fence_after_s=3.0, confirmed_at=100.0)
    assert watch.verdict(102.9, ranks=2) is None
    fence = watch.verdict(103.0, ranks=2)
    assert fence is not None and fence.unconfirmed_s == 3.0
    assert "3.0 s" in fence.message
    assert watch.verdict(104.0, ranks=2) is None  # once an outage
    watch.confirmed(104.5)  # healed: the next outage fences again
    assert watch.verdict(107.0, ranks=1) is None
    assert watch.verdict(107.5, ranks=1) is not None


def test_nothing_to_fence_without_ranks_or_with_the_rule_off() -> None:
    watch = BusWatch(fence_after_s=3.0, confirmed_at=0.0)
    assert watch.verdict(10.0, ranks=0) is None
    assert watch.verdict(11.0, ranks=1) is not None  # one launched meanwhile (adopted)
    assert BusWatch(fence_after_s=0.0, confirmed_at=0.0).verdict(1e6, ranks=4) is None


def test_an_answer_to_an_older_round_trip_moves_nothing_back() -> None:
    watch = BusWatch(fence_after_s=3.0, confirmed_at=10.0)
    watch.confirmed(9.0)
    assert watch.confirmed_at == 10.0


def test_a_fenced_rank_is_lost_to_its_job_and_the_bound_is_stated() -> None:
    assert exit_cause(StopReason.FENCED) is ExitCause.LOST  # an infrastructure fault
    assert bound_s(3.0, 0.5) == 4.0
    config = AgentConfig.from_env({"PHALANX_AGENT_LOST_AFTER_S": "4"}, node_id="n")
    assert config.fence_s == 4.0
    assert AgentConfig.from_env({"PHALANX_AGENT_FENCE_AFTER_S": "0"},
                                node_id="n").fence_s == 0

"""A replica of several ranks (a group) on one node: each process's share of the slots and
its variables, how the group's end is told from its processes' ends, and that such a job
keeps no spares. Pure rules, no process."""

from __future__ import annotations

import socket

import pytest
from agent_rules import job_record

from phalanx.schemas import environment
from phalanx.services.agent.core import (
    ProcessEnd,
    Refusal,
    Refuse,
    Start,
    group_exit,
    group_slots,
    group_variables,
    reconcile,
    siblings_wait_s,
    spare_counts,
    spares_wanted,
)
from phalanx.services.ports import GROUP_PORTS, group_master_port


@pytest.mark.parametrize(("slots", "ranks", "shares"), [
    ((0,), 1, ((0,),)),
    ((2, 3), 2, ((2,), (3,))),
    ((0, 1, 4, 5), 2, ((0, 1), (4, 5))),  # slots_per_replica 2: each rank its run of 2
    ((1, 2, 3), 3, ((1,), (2,), (3,))),
])
def test_each_rank_of_a_group_takes_its_own_run_of_the_replicas_slots(
        slots: tuple[int, ...], ranks: int, shares: tuple[tuple[int, ...], ...]) -> None:
    assert group_slots(slots, ranks) == shares


def test_torchruns_variables_describe_the_group_on_a_cpu_node() -> None:
    env = group_variables((), (5,), 1, 2, 41234)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                   "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41234",
                   environment.DEVICE: "cpu"}
    assert environment.WORLD_OF_ONE_MARK not in env


def test_on_a_gpu_node_each_rank_sees_its_own_gpus_as_cuda_0_onwards() -> None:
    gpus = (4, 5, 6, 7)
    env = group_variables(gpus, (2, 3), 1, 2, 29999)
    assert (env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"], env[environment.DEVICE]) == \
        ("6,7", "0", "cuda")
    assert (env["RANK"], env["WORLD_SIZE"]) == ("1", "2")


def end(group_rank: int, code: int | None, sig: str | None = None,
        known: bool = True) -> ProcessEnd:
    return ProcessEnd(group_rank, code, sig, known)


@pytest.mark.parametrize(("ends", "reported"), [
    ([end(1, None, "SIGKILL"), end(0, None, "SIGTERM")], end(1, None, "SIGKILL")),
    ([end(0, 3), end(1, 0)], end(0, 3)),  # the first, even when the others are clean
    ([end(0, 0), end(1, 0)], end(0, 0)),  # a clean group: the first
    ([end(1, 0), end(0, None, "SIGTERM")], end(0, None, "SIGTERM")),  # 0 then a failure
    ([end(0, None, known=False), end(1, 0)], end(0, None, known=False)),  # adopted: lost
    ([end(0, 0)], end(0, 0)),  # a replica of one rank: its own end
])
def test_a_group_is_reported_with_its_first_end_unless_that_was_clean_and_another_was_not(
        ends: list[ProcessEnd], reported: ProcessEnd) -> None:
    assert group_exit(ends) == reported


def test_a_group_is_taken_down_at_once_after_a_failure_and_waited_for_after_a_clean_exit(
        ) -> None:
    assert siblings_wait_s(end(0, 0), 30.0) == 30.0
    for failed in (end(0, 1), end(1, None, "SIGKILL"), end(0, None, known=False)):
        assert siblings_wait_s(failed, 30.0) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        group_exit([])


def test_a_job_of_groups_keeps_spare_groups_each_in_a_whole_groups_free_slots() -> None:
    assert spares_wanted(3, False) == 3 and spares_wanted(None, True) == 1
    # 2 groups of 2 ranks placed on 6 slots: room for one spare group, not a second.
    assert spare_counts(6, 4, [("j", 2, 2)]) == {"j": 1}
    assert spare_counts(5, 4, [("j", 1, 2)]) == {"j": 0}


def test_a_spare_groups_ranks_hold_no_slots_yet_and_get_the_groups_variables() -> None:
    env = group_variables((), (), 1, 2, 41234)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == \
        ("1", "1", "2", "41234")


def test_a_record_placing_more_groups_than_the_node_holds_is_refused() -> None:
    fits = job_record("n1", "n1", ranks_per_replica=2)
    assert [type(d) for d in reconcile(fits, "n1", {}, {}, capacity=4)] == [Start, Start]
    too_big = job_record("n1", "n1", ranks_per_replica=2, slots_per_replica=2)
    assert reconcile(too_big, "n1", {}, {}, capacity=4) == [Refuse(
        Refusal.TOO_LARGE, "j places 2 replicas of 4 slots on n1, which has 4")]


def test_a_groups_master_port_is_free_and_below_the_ephemeral_ports() -> None:
    """Picked from the ephemeral range, a port free when picked was taken by another
    process's bind(0) before the group's rank 0 bound it."""
    port = group_master_port("job/r0-0")
    assert port in GROUP_PORTS and port < 32768
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        assert group_master_port("job/r0-0") != port  # the next free one

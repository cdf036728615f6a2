"""Which of a job's ranks a node starts, stops, lets leave or keeps, and where a replica
starts: the agent's reconcile rules on plain data, with no process and no bus (as torch
elastic's api_test.py tests its agent)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from agent_rules import carry_out, job_record

from phalanx.schemas.messages import JobRecord, JobState
from phalanx.services.agent.core import (
    Decision,
    Forget,
    Keep,
    Launch,
    Leave,
    Refusal,
    Refuse,
    SlotWait,
    Start,
    Stop,
    drop,
    reconcile,
    replacement,
    slots_for,
    stop_request,
)

ME = "n1"


def launches(placement: tuple[str, ...], *replicas: str) -> dict[int, Launch]:
    """``r<slot>-<n>`` launched for ``placement``, by slot."""
    return {int(r[1:].split("-")[0]): Launch(r, placement) for r in replicas}


OLD = (ME, "n2")  # the job's placement its ranks here were launched for
NEW = (ME, "n3")  # ... and the one its record says now: slot 0 still here


# --- following the record ------------------------------------------------------------------


@pytest.mark.parametrize(("job", "running", "launched", "elastic", "decisions"), [
    pytest.param(job_record(ME, "n2", ME), {}, {}, False,
                 [Start(0, "r0-0", (ME, "n2", ME)), Start(2, "r2-0", (ME, "n2", ME))],
                 id="first record: the slots placed here start their first replica"),
    pytest.param(job_record(ME, ME, slots=(4, 7)), {}, {}, False,
                 [Start(4, "r4-0", (ME, ME)), Start(7, "r7-0", (ME, ME))],
                 id="the record's slot numbers, not their positions"),
    pytest.param(job_record(*OLD), launches(OLD, "r0-0"), launches(OLD, "r0-0"), False, [],
                 id="the same record again: nothing"),
    pytest.param(job_record(*OLD), {}, launches(OLD, "r0-0"), False, [],
                 id="a rank that exited is not started again"),
    pytest.param(job_record(*OLD), launches(OLD, "r0-2"), launches(OLD, "r0-2"), True, [],
                 id="an elastic job's replacement is kept"),
    pytest.param(job_record(*NEW), launches(OLD, "r0-0"), launches(OLD, "r0-0"), False,
                 [Stop(0, "r0-0"), Forget((0,)), Start(0, "r0-0", NEW)],
                 id="a torchrun gang's new placement restarts it with the new world"),
    pytest.param(job_record(*NEW), {}, launches(OLD, "r0-0"), False,
                 [Forget((0,)), Start(0, "r0-0", NEW)],
                 id="a gang's slot whose rank exited starts again with the new world"),
    pytest.param(job_record(*NEW), launches(OLD, "r0-0"), launches(OLD, "r0-0"), True, [],
                 id="an elastic job's rank stays while its slot does"),
    pytest.param(job_record(ME, "n2", ME), launches(OLD, "r0-0"), launches(OLD, "r0-0"), True,
                 [Start(2, "r2-0", (ME, "n2", ME), elastic=True)],
                 id="an elastic job grown here: the new slot's replica joins"),
    pytest.param(job_record("n2", ME, slots=(0, 2), leave_s=5.0),
                 launches((ME, ME, ME), "r0-0", "r1-3", "r2-0"),
                 launches((ME, ME, ME), "r0-0", "r1-3", "r2-0"), True,
                 [Leave(0, "r0-0", 5.0), Leave(1, "r1-3", 5.0), Forget((0, 1))],
                 id="an elastic job shrunk off slots here: their ranks leave by themselves"),
    pytest.param(job_record("n2", "n3"), launches(OLD, "r0-0"), launches(OLD, "r0-0"), False,
                 [Stop(0, "r0-0"), Forget((0,))],
                 id="a gang moved off this node is stopped"),
    pytest.param(job_record(state=JobState.CANCELLED), launches(OLD, "r1-0", "r0-0"),
                 launches(OLD, "r0-0", "r1-0", "r2-0"), True,
                 [Stop(1, "r1-0"), Stop(0, "r0-0"), Forget((0, 1, 2))],
                 id="a job no longer admitted: every rank stops, in the order given, even "
                    "an elastic job's"),
    pytest.param(job_record(state=JobState.PENDING), {}, {}, False, [],
                 id="a job not admitted and never here: nothing"),
])
def test_reconcile(job: JobRecord, running: Mapping[int, Launch],
                   launched: Mapping[int, Launch], elastic: bool,
                   decisions: list[Decision]) -> None:
    assert reconcile(job, ME, running, launched, elastic=elastic, capacity=8) == decisions


def test_a_placement_larger_than_the_node_is_refused_whole_saying_the_numbers() -> None:
    too_big = job_record(ME, ME, ME, slots_per_replica=2)
    assert reconcile(too_big, ME, {}, {}, capacity=4) == [
        Refuse(Refusal.TOO_LARGE, "j places 3 replicas of 2 slots on n1, which has 4")]
    # It is refused before anything stops: what runs keeps running.
    assert reconcile(too_big, ME, launches(OLD, "r0-0"), launches(OLD, "r0-0"),
                     capacity=4) == reconcile(too_big, ME, {}, {}, capacity=4)
    fits = job_record(ME, ME, slots_per_replica=2)
    assert reconcile(fits, ME, {}, {}, capacity=4) == [
        Start(0, "r0-0", (ME, ME)), Start(1, "r1-0", (ME, ME))]
    assert reconcile(too_big, ME, {}, {}) == [  # a node of unbounded slots takes anything
        Start(s, f"r{s}-0", (ME, ME, ME)) for s in range(3)]


def test_a_job_gone_stops_every_rank_and_forgets_every_launch() -> None:
    running = launches(OLD, "r2-1", "r0-0")
    assert drop(running, launches(OLD, "r0-0", "r1-0", "r2-1")) == [
        Stop(2, "r2-1"), Stop(0, "r0-0"), Forget((0, 1, 2))]
    assert drop({}, {}) == []


@pytest.mark.parametrize("elastic", [False, True])
def test_carried_out_the_node_runs_exactly_the_record_and_the_next_pass_does_nothing(
        elastic: bool) -> None:
    running: dict[int, Launch] = {}
    launched: dict[int, Launch] = {}
    for job in (job_record(ME, "n2", ME), job_record(ME, "n3"), job_record("n2", ME, ME),
                job_record(ME, ME, slots=(1, 5)), job_record(state=JobState.PENDING)):
        carry_out(reconcile(job, ME, running, launched, elastic=elastic), running, launched)
        assert set(running) == {s for s, n in job.placement().items() if n == ME}
        assert reconcile(job, ME, running, launched, elastic=elastic) == []


# --- launch and stop requests --------------------------------------------------------------


PLACED = job_record(ME, "n2")


@pytest.mark.parametrize(("job", "slot", "replica", "running", "last", "decisions"), [
    pytest.param(PLACED, 1, "r1-1", None, None,
                 [Refuse(Refusal.NOT_PLACED_HERE, "slot 1 of j is not placed on n1")],
                 id="a slot placed elsewhere"),
    pytest.param(job_record(state=JobState.PENDING), 0, "r0-1", None, None,
                 [Refuse(Refusal.NOT_PLACED_HERE, "slot 0 of j is not placed on n1")],
                 id="a job not admitted"),
    pytest.param(PLACED, 0, "r0-1", Launch("r0-1", OLD), Launch("r0-1", OLD),
                 [Keep(0, "r0-1", running=True)], id="a repeated request: already running"),
    pytest.param(PLACED, 0, "r0-1", None, Launch("r0-1", OLD),
                 [Keep(0, "r0-1", running=False)],
                 id="a repeated request after the replica exited: not again"),
    pytest.param(PLACED, 0, "r0-1", Launch("r0-2", OLD), Launch("r0-2", OLD),
                 [Refuse(Refusal.OUTDATED,
                         "r0-1 is older than r0-2, launched in slot 0 of j already")],
                 id="an older incarnation"),
    pytest.param(PLACED, 0, "r0-2", Launch("r0-1", OLD), Launch("r0-1", OLD),
                 [Stop(0, "r0-1"), Start(0, "r0-2", (ME, "n2"), elastic=True)],
                 id="a replacement stops what runs in the slot first"),
    pytest.param(PLACED, 0, "r0-1", None, Launch("r0-0", OLD),
                 [Start(0, "r0-1", (ME, "n2"), elastic=True)],
                 id="a replacement of a rank that exited"),
    pytest.param(PLACED, 0, "r0-0", None, None,
                 [Start(0, "r0-0", (ME, "n2"), elastic=True)],
                 id="a slot never launched here"),
])
def test_a_launch_request(job: JobRecord, slot: int, replica: str, running: Launch | None,
                          last: Launch | None, decisions: list[Decision]) -> None:
    assert replacement(job, ME, slot, replica, running, last) == decisions


def test_a_gang_restart_is_no_joiner_and_warm_only_is_passed_on() -> None:
    running = Launch("r0-0", OLD)
    assert replacement(PLACED, ME, 0, "r0-1", running, running, gang=True) == [
        Stop(0, "r0-0"), Start(0, "r0-1", (ME, "n2"))]
    assert replacement(PLACED, ME, 0, "r0-1", None, running, warm_only=True) == [
        Start(0, "r0-1", (ME, "n2"), elastic=True, warm_only=True)]


def test_a_stop_request_stops_only_the_replica_it_names() -> None:
    assert stop_request(1, "r1-2", Launch("r1-2", OLD)) == [Stop(1, "r1-2")]
    assert stop_request(1, "r1-2", Launch("r1-3", OLD)) == []  # replaced meanwhile
    assert stop_request(1, "r1-2", None) == []


# --- where a replica starts ----------------------------------------------------------------


@pytest.mark.parametrize(("count", "held", "cordoned", "capacity", "stopping", "found"), [
    (1, set(), set(), 4, False, (0,)),
    (2, {0, 2}, set(), 4, False, (1, 3)),
    (1, {0}, {1}, 4, False, (2,)),  # a cordoned slot is passed over
    (1, {0}, {1}, 4, True, (2,)),  # a rank stopping elsewhere is no reason to wait
    (3, {0, 1, 2, 3}, set(), None, False, (4, 5, 6)),  # unbounded
    (2, {0, 1}, set(), 3, True, SlotWait.EXIT),
    (1, {0, 1}, {2, 3}, 4, False, SlotWait.CORDONED),
    (2, {0, 1}, {2}, 4, False, SlotWait.CORDONED),
    (1, {0, 1, 2, 3}, set(), 4, False, SlotWait.MOVED),
    (2, {0, 1, 2}, set(), 4, False, SlotWait.MOVED),
])
def test_where_a_replica_starts_or_why_it_waits(
        count: int, held: set[int], cordoned: set[int], capacity: int | None,
        stopping: bool, found: tuple[int, ...] | SlotWait) -> None:
    assert slots_for(count, held, cordoned, capacity, stopping) == found

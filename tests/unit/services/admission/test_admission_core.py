"""The gang admission rules of ``AdmissionCore``, case by case.

Each test builds a small cluster, feeds events through ``core.step`` (events,
then one admission pass) and asserts on the decisions returned and on
``core.explain``. ``check_invariants`` runs after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest

from phalanx.schemas.messages import JobSpec, JobState, Placement, ReasonCode, ReplicaRange
from phalanx.services.admission import preemption
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.core import AdmissionCore
from phalanx.services.admission.events import (
    Admit,
    Decision,
    Event,
    Evict,
    Fail,
    Grow,
    JobCancelled,
    JobFinished,
    JobRequeued,
    JobSubmitted,
    NodeRemoved,
    NodeUpdated,
    Reason,
    Shrink,
)
from phalanx.services.admission.lifecycle import SpecRejected
from phalanx.services.admission.model import Capacity, carry_slots
from phalanx.services.admission.policy import AdmissionPolicy, TeamQuota

T0 = 1_717_000_000.0


# --- helpers -------------------------------------------------------------------------------


def spec(team: str = "t", prio: str = "normal", mn: int = 1, mx: int | None = None, *,
         k: int = 1, s: int = 1, labels: dict[str, str] | None = None, spread: bool = False,
         timeout: float | None = None) -> JobSpec:
    return JobSpec(name="job", team=team, priority_class=prio,
                   replicas=ReplicaRange(min=mn, max=mn if mx is None else mx),
                   command=["python", "train.py"], slots_per_replica=k, ranks_per_replica=s,
                   placement=Placement(node_labels=labels or {}, spread_failure_domains=spread),
                   schedule_timeout_s=timeout)


def sub(job_id: str, at: float = T0, **kw: object) -> JobSubmitted:
    return JobSubmitted(job_id, spec(**kw), at)  # type: ignore[arg-type]


def node(node_id: str, slots: int, domain: str = "d1", labels: dict[str, str] | None = None,
         *, alive: bool = True, cordoned: bool = False) -> NodeUpdated:
    return NodeUpdated(node_id, slots, domain, labels or {}, alive=alive, cordoned=cordoned)


def make(*nodes: NodeUpdated, policy: AdmissionPolicy | None = None) -> AdmissionCore:
    core = AdmissionCore(policy or AdmissionPolicy())
    assert run(core, nodes) == []
    return core


def run(core: AdmissionCore, events: list[Event] | tuple[Event, ...] = (),
        now: float = T0) -> list[Decision]:
    decisions = core.step(events, now)
    core.check_invariants()
    return decisions


def admits(decisions: list[Decision]) -> dict[str, tuple[str, ...]]:
    return {d.job_id: d.nodes for d in decisions if isinstance(d, Admit)}


def kinds(decisions: list[Decision]) -> list[tuple[str, str]]:
    """The placement decisions (scaling announcements are tested in test_scaling_events)."""
    return [(type(d).__name__, d.job_id) for d in decisions if not isinstance(d, Announce)]


def state(core: AdmissionCore, job_id: str) -> JobState:
    return core.gangs[job_id].state


def nodes_of(core: AdmissionCore, job_id: str) -> Counter[str]:
    return Counter(core.gangs[job_id].nodes)


def explain(core: AdmissionCore, job_id: str) -> Reason:
    return core.explain(job_id)


# --- all or nothing ------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "running", "need", "admitted"), [
    ([4], 3, 2, False),
    ([4], 2, 2, True),
    ([2, 2], 3, 2, False),
    ([2, 2], 2, 2, True),
    ([1, 1, 1, 1], 1, 4, False),
    ([1, 1, 1, 1], 0, 4, True),
])
def test_gang_is_placed_whole_or_not_at_all(slots: list[int], running: int, need: int,
                                            admitted: bool) -> None:
    core = make(*(node(f"n{i}", s) for i, s in enumerate(slots)))
    if running:
        assert kinds(run(core, [sub("f", prio="high", mn=running)])) == [("Admit", "f")]
    used_before = {n.node_id: n.used for n in core.nodes.values()}
    decisions = run(core, [sub("g", mn=need)])
    if admitted:
        assert kinds(decisions) == [("Admit", "g")]
        assert len(decisions[0].nodes) == need  # type: ignore[union-attr]
    else:
        assert decisions == []
        assert state(core, "g") is JobState.PENDING
        assert core.gangs["g"].nodes == []
        assert {n.node_id: n.used for n in core.nodes.values()} == used_before
        assert explain(core, "g").code is ReasonCode.RESERVED


def test_blocked_gang_is_admitted_when_capacity_frees() -> None:
    core = make(node("n1", 4))
    run(core, [sub("f", prio="high", mn=3)])
    assert run(core, [sub("g", mn=2)]) == []
    why = explain(core, "g")
    assert why.code is ReasonCode.RESERVED
    assert "needs 2 replica(s) x 1 slot(s) = 2 slots" in why.message
    decisions = run(core, [JobFinished("f")], T0 + 1)
    assert kinds(decisions) == [("Evict", "f"), ("Admit", "g")]
    assert decisions[1] == Admit("g", ("n1", "n1"), "pass-4")
    assert explain(core, "g") == Reason(ReasonCode.ADMITTED, "running 2 replica(s) on 1 node(s)")


# --- slots_per_replica ---------------------------------------------------------------------


def test_a_replica_never_spans_nodes() -> None:
    core = make(*(node(f"n{i}", 3, f"d{i}") for i in range(4)))
    assert run(core, [sub("g", k=4)]) == []
    why = explain(core, "g")
    assert why.code is ReasonCode.UNSCHEDULABLE
    assert "needs 1 replica(s) x 4 slot(s) = 4 slots" in why.message
    assert "the 4 schedulable nodes offer 12 slots in all" in why.message
    assert all(n.used == 0 for n in core.nodes.values())


@pytest.mark.parametrize(("slots", "k", "mn", "expect"), [
    ([4, 2], 2, 3, {"n0": 2, "n1": 1}),
    ([8], 4, 2, {"n0": 2}),
    ([3, 3, 3], 2, 3, {"n0": 1, "n1": 1, "n2": 1}),
    ([5, 2], 2, 2, {"n0": 1, "n1": 1}),  # best fit: the fuller node first
])
def test_replicas_are_packed_per_node_by_slots(slots: list[int], k: int, mn: int,
                                               expect: dict[str, int]) -> None:
    core = make(*(node(f"n{i}", s) for i, s in enumerate(slots)))
    decisions = run(core, [sub("g", mn=mn, k=k)])
    assert kinds(decisions) == [("Admit", "g")]
    assert Counter(decisions[0].nodes) == expect  # type: ignore[union-attr]
    for n in core.nodes.values():
        assert n.used == expect.get(n.node_id, 0) * k <= n.slots


# --- ranks_per_replica: a replica is a group of ranks on one node -------------------------


@pytest.mark.parametrize(("slots", "s", "k", "mn", "expect"), [
    ([4, 4], 2, 1, 3, {"n0": 2, "n1": 1}),  # 2 groups of 2 slots fill a node
    ([3, 3, 3], 2, 1, 3, {"n0": 1, "n1": 1, "n2": 1}),  # 3 slots hold one group of 2
    ([8, 2], 2, 2, 2, {"n0": 2}),  # a group of 4 slots never goes on the node of 2
    ([6, 4], 3, 1, 2, {"n0": 1, "n1": 1}),  # best fit: the fuller node first
])
def test_a_group_takes_all_its_ranks_slots_on_one_node(
        slots: list[int], s: int, k: int, mn: int, expect: dict[str, int]) -> None:
    core = make(*(node(f"n{i}", count) for i, count in enumerate(slots)))
    decisions = run(core, [sub("g", mn=mn, k=k, s=s)])
    assert kinds(decisions) == [("Admit", "g")]
    assert Counter(decisions[0].nodes) == expect  # type: ignore[union-attr]
    for n in core.nodes.values():
        assert n.used == expect.get(n.node_id, 0) * s * k <= n.slots
    assert core.gangs["g"].slots == mn * s * k


def test_a_group_never_spans_nodes_and_its_need_counts_every_rank() -> None:
    core = make(*(node(f"n{i}", 3, f"d{i}") for i in range(4)))
    assert run(core, [sub("g", k=2, s=2)]) == []
    why = explain(core, "g")
    assert why.code is ReasonCode.UNSCHEDULABLE
    assert "needs 1 replica(s) x 4 slot(s) = 4 slots" in why.message
    assert all(n.used == 0 for n in core.nodes.values())


def test_preemption_frees_a_whole_group_for_a_higher_priority_one() -> None:
    core = make(node("n1", 4))
    assert kinds(run(core, [sub("low", prio="low", mn=2, s=2)])) == [("Admit", "low")]
    decisions = run(core, [sub("high", prio="high", mn=1, s=2, k=2)], T0 + 1)
    assert kinds(decisions) == [("Evict", "low"), ("Admit", "high")]
    assert core.nodes["n1"].used == 4


def test_blocked_on_per_node_room_not_on_total_free() -> None:
    # 4 nodes x 4 slots, one slot used on each: 12 free but no node has 4.
    core = make(*(node(f"n{i}", 4, labels={"id": str(i)}) for i in range(4)))
    decisions = run(core, [sub(f"f{i}", prio="high", labels={"id": str(i)}) for i in range(4)])
    assert {job: Counter(nodes) for job, nodes in admits(decisions).items()} == {
        f"f{i}": {f"n{i}": 1} for i in range(4)}
    assert run(core, [sub("g", k=4)]) == []
    assert explain(core, "g").code is ReasonCode.RESERVED
    decisions = run(core, [JobFinished("f2")])
    assert admits(decisions) == {"g": ("n2",)}


def test_best_fit_prefers_the_fullest_node_that_fits() -> None:
    core = make(node("big", 8), node("small", 2))
    assert admits(run(core, [sub("a", mn=2)])) == {"a": ("small", "small")}
    core = make(node("big", 8), node("mid", 4))
    run(core, [sub("f", prio="high", mn=1, labels={})])  # lands on mid (fullest that fits)
    assert core.gangs["f"].nodes == ["mid"]
    assert admits(run(core, [sub("b", mn=3)])) == {"b": ("mid", "mid", "mid")}


# --- labels and failure domains ------------------------------------------------------------


def test_node_labels_restrict_placement() -> None:
    core = make(node("a1", 4, labels={"gpu": "a100"}), node("h1", 2, labels={"gpu": "h100"}))
    assert admits(run(core, [sub("g", mn=2, labels={"gpu": "h100"})])) == {"g": ("h1", "h1")}
    assert run(core, [sub("x", mn=3, labels={"gpu": "h100"})]) == []
    why = explain(core, "x")
    assert why.code is ReasonCode.UNSCHEDULABLE
    assert "nodes labelled {'gpu': 'h100'}" in why.message
    assert run(core, [sub("y", mn=1, labels={"gpu": "tpu"})]) == []
    assert explain(core, "y").code is ReasonCode.UNSCHEDULABLE
    assert "the 0 nodes labelled" in explain(core, "y").message


@pytest.mark.parametrize(("domains", "mn", "cap"), [
    (3, 3, 1),
    (3, 4, 2),
    (2, 4, 2),
    (2, 3, 2),
    (4, 6, 2),
])
def test_spread_caps_replicas_per_domain(domains: int, mn: int, cap: int) -> None:
    core = make(*(node(f"n{i}", 8, f"d{i}") for i in range(domains)))
    decisions = run(core, [sub("g", mn=mn, spread=True)])
    placed = admits(decisions)["g"]
    assert len(placed) == mn
    per_domain = Counter(core.nodes[n].failure_domain for n in placed)
    assert max(per_domain.values()) == cap


def test_without_spread_a_gang_packs_into_one_domain() -> None:
    core = make(*(node(f"n{i}", 8, f"d{i}") for i in range(3)))
    placed = admits(run(core, [sub("g", mn=3)]))["g"]
    assert len({core.nodes[n].failure_domain for n in placed}) == 1


def test_spread_that_no_domain_layout_allows_is_unschedulable() -> None:
    core = make(node("n1", 8, "d1"), node("n2", 1, "d2"))
    assert run(core, [sub("g", mn=4, spread=True)]) == []
    why = explain(core, "g")
    assert why.code is ReasonCode.UNSCHEDULABLE
    assert "spread over failure domains" in why.message


def test_spread_gang_fitting_an_empty_cluster_is_not_called_unschedulable() -> None:
    """A domain whose nodes are all too small for one replica does not divide the cap.

    (Was a bug: ``_could_fit_empty`` counted d2, a 1-slot node where replicas need 2,
    as a domain, so 1 < 2 replicas "fit" and the gang was UNSCHEDULABLE, holding no
    reservation, although ``_place`` puts both replicas on n1 once it is free.)
    """
    core = make(node("n1", 4, "d1"), node("n2", 1, "d2"))
    run(core, [sub("x", mn=2, k=2)])
    assert run(core, [sub("g", mn=2, k=2, spread=True)]) == []
    pending_code = explain(core, "g").code
    decisions = run(core, [JobFinished("x")])
    assert admits(decisions) == {"g": ("n1", "n1")}  # it did fit after all
    assert pending_code is ReasonCode.RESERVED


# --- priority order, backfill and reservation ----------------------------------------------


def test_higher_priority_is_admitted_first_and_position_reported() -> None:
    # "spare" has one free slot no 2-slot replica can use, so the pass reaches every gang.
    core = make(node("n1", 4), node("spare", 1))
    run(core, [sub("f", prio="high", mn=2, k=2)])
    assert run(core, [sub("n", prio="normal", mn=2, k=2), sub("l", prio="low", mn=2, k=2),
                      sub("h", prio="high", mn=2, k=2)]) == []
    assert "(position 1 of 3)" in explain(core, "h").message
    assert explain(core, "h").code is ReasonCode.RESERVED
    assert "(position 2 of 3)" in explain(core, "n").message
    assert explain(core, "n").code is ReasonCode.INSUFFICIENT_CAPACITY
    assert "freed slots are reserved for h" in explain(core, "n").message
    assert "(position 3 of 3)" in explain(core, "l").message
    assert admits(run(core, [JobFinished("f")])) == {"h": ("n1",) * 2}
    assert admits(run(core, [JobFinished("h")])) == {"n": ("n1",) * 2}
    assert admits(run(core, [JobFinished("n")])) == {"l": ("n1",) * 2}


def test_same_priority_is_first_come_first_served() -> None:
    core = make(node("n1", 2))
    run(core, [sub("f", prio="high", mn=2)])
    assert run(core, [sub("first", mn=2, at=T0), sub("second", mn=2, at=T0)]) == []
    assert admits(run(core, [JobFinished("f")])) == {"first": ("n1", "n1")}


def test_backfill_into_capacity_the_blocked_gang_cannot_use() -> None:
    core = make(node("a", 4, labels={"gpu": "a100"}), node("b", 2))
    run(core, [sub("f", prio="high", mn=3, labels={"gpu": "a100"})])
    # big needs 4 a100 slots: blocked; it holds the one free a100 slot.
    assert run(core, [sub("big", mn=4, labels={"gpu": "a100"})]) == []
    assert explain(core, "big").code is ReasonCode.RESERVED
    assert "holding 1 freed slot(s) for it until 3 more free up" in explain(core, "big").message
    # A small low gang backfills node b, which big can never use ...
    decisions = run(core, [sub("small", prio="low", mn=2)])
    assert admits(decisions) == {"small": ("b", "b")}
    # ... but not the reserved a100 slot.
    assert run(core, [sub("small_a", labels={"gpu": "a100"})]) == []
    why = explain(core, "small_a")
    assert why.code is ReasonCode.INSUFFICIENT_CAPACITY
    assert "freed slots are reserved for big" in why.message
    assert core.nodes["a"].used == 3


def test_reservation_accumulates_freed_slots_for_the_head_gang() -> None:
    core = make(node("n1", 4), node("spare", 1))
    run(core, [sub("f1", prio="high", k=2), sub("f2", prio="high", k=2)])
    assert run(core, [sub("big", mn=2, k=2)]) == []
    assert "holding 0 freed slot(s) for it until 4 more free up" in explain(core, "big").message
    decisions = run(core, [JobFinished("f1")], T0 + 1)
    assert kinds(decisions) == [("Evict", "f1")]
    assert "holding 2 freed slot(s) for it until 2 more free up" in explain(core, "big").message
    # A later small gang (even of the same priority) does not take the held slots.
    assert run(core, [sub("small", k=2, at=T0 + 2)], T0 + 2) == []
    assert explain(core, "small").code is ReasonCode.INSUFFICIENT_CAPACITY
    assert core.nodes["n1"].used == 2
    decisions = run(core, [JobFinished("f2")], T0 + 3)
    assert kinds(decisions) == [("Evict", "f2"), ("Admit", "big")]
    assert state(core, "small") is JobState.PENDING


def test_without_reservations_small_gangs_backfill_freed_slots() -> None:
    core = make(node("n1", 4), node("spare", 1), policy=AdmissionPolicy(max_reservations=0))
    run(core, [sub("f1", prio="high", k=2), sub("f2", prio="high", k=2)])
    assert run(core, [sub("big", mn=2, k=2)]) == []
    why = explain(core, "big")
    assert why.code is ReasonCode.INSUFFICIENT_CAPACITY
    assert "1 unreserved slot(s) free in the cluster" in why.message
    assert "reserved for" not in why.message
    decisions = run(core, [JobFinished("f1"), sub("small", k=2)])
    assert admits(decisions) == {"small": ("n1",)}


def test_two_reservations_when_policy_allows() -> None:
    core = make(node("a", 2, labels={"z": "a"}), node("b", 2, labels={"z": "b"}),
                node("spare", 1), policy=AdmissionPolicy(max_reservations=2))
    run(core, [sub("fa", prio="high", labels={"z": "a"}),
               sub("fb", prio="high", labels={"z": "b"})])
    assert run(core, [sub("ga", mn=2, labels={"z": "a"}), sub("gb", mn=2, labels={"z": "b"}),
                      sub("s", k=2)]) == []
    assert explain(core, "ga").code is ReasonCode.RESERVED
    assert explain(core, "gb").code is ReasonCode.RESERVED
    assert "reserved for ga, gb" in explain(core, "s").message


def test_reservation_holds_a_partially_freed_node_for_a_multi_slot_replica() -> None:
    """Rule 5: no starvation behind a stream of small gangs, also for multi-slot replicas.

    A 2-slot node runs two 1-slot gangs; a 2-slot replica (same priority) waits at
    the head. (Was a bug: ``_reserve`` held only whole replicas' worth of room,
    ``room // k * k``, so each single freed slot was backfilled and big starved.)
    """
    core = make(node("n1", 2))
    run(core, [sub("s0"), sub("s1")])
    run(core, [sub("big", k=2, at=T0 + 1)], T0 + 1)
    running = ["s0", "s1"]
    for i in range(2, 8):
        now = T0 + i
        ended = [JobFinished(running.pop(0))] if running else []
        decisions = run(core, [*ended, sub(f"s{i}", at=now)], now)
        if "big" in admits(decisions):
            break
        running += list(admits(decisions))
    else:
        pytest.fail(f"big starved behind small gangs; running now: {running}")



def test_reservation_holds_freed_slots_in_the_domain_a_spread_gang_needs() -> None:
    """Rule 5 for a spread gang: it holds freed slots in the domain it still needs.

    big needs 4 replicas over 2 domains (at most 2 per domain). (Was a bug: it held the
    four free 1-slot nodes of d1, of which it can use 2, and never the slot freed on b
    in d2, so same-priority gangs pinned to b took every freed b slot.)
    """
    core = make(*(node(f"a{i}", 1, "d1") for i in range(4)), node("b", 2, "d2", {"z": "b"}))
    run(core, [sub("s0", labels={"z": "b"}), sub("s1", labels={"z": "b"})])
    run(core, [sub("big", mn=4, spread=True, at=T0 + 1)], T0 + 1)
    running = ["s0", "s1"]
    for i in range(2, 8):
        now = T0 + i
        ended = [JobFinished(running.pop(0))] if running else []
        decisions = run(core, [*ended, sub(f"s{i}", labels={"z": "b"}, at=now)], now)
        if "big" in admits(decisions):
            break
        running += list(admits(decisions))
    else:
        pytest.fail(f"big starved behind small gangs on b; running now: {running}")

# --- quotas --------------------------------------------------------------------------------


def test_team_ceiling_is_nominal_plus_borrow_limit() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(nominal=2, borrow_limit=1)})
    core = make(node("n1", 8), policy=policy)
    assert kinds(run(core, [sub("a1", team="a", mn=2)])) == [("Admit", "a1")]
    assert run(core, [sub("a2", team="a", mn=2)]) == []
    why = explain(core, "a2")
    assert why.code is ReasonCode.QUOTA
    assert "team a quota: 2/3 slots used (nominal 2 + borrow limit 1); needs 2 more" \
        in why.message
    assert kinds(run(core, [sub("a3", team="a", mn=1)])) == [("Admit", "a3")]
    assert core.usage["a"] == 3
    assert explain(core, "a2").code is ReasonCode.QUOTA


def test_borrowing_idle_capacity_up_to_the_limit() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(2, None), "b": TeamQuota(2, 3)})
    core = make(node("n1", 8), policy=policy)
    assert kinds(run(core, [sub("a1", team="a", mn=6)])) == [("Admit", "a1")]
    assert core.usage["a"] == 6
    assert admits(run(core, [sub("b1", team="b", mn=2, mx=8)])) == {"b1": ("n1", "n1")}
    decisions = run(core, [JobFinished("a1"), sub("b2", team="b", mn=2, mx=8)])
    assert admits(decisions) == {"b2": ("n1",) * 3}  # b: 2 + 3 = its ceiling of 5
    assert core.usage == {"a": 0, "b": 5}


def test_elastic_growth_stops_at_the_team_ceiling() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(1, 2)})
    core = make(node("n1", 8), policy=policy)
    assert admits(run(core, [sub("e", team="a", mn=1, mx=8)])) == {"e": ("n1",) * 3}


@pytest.mark.parametrize(("a_nominal", "b_nominal", "b_prio", "a_prio", "preempts"), [
    (4, 0, "high", "normal", True),    # reclaim: a within nominal, b borrowing
    (2, 0, "high", "normal", False),   # a would be above nominal: no reclaim of higher prio
    (2, 0, "low", "normal", True),     # b borrowing and lower priority
    (4, 4, "low", "high", False),      # b within its nominal: its slots are its own
    (0, 0, "normal", "normal", False),  # a has no nominal: equal priority is safe
])
def test_reclaim_and_cross_team_preemption(a_nominal: int, b_nominal: int, b_prio: str,
                                           a_prio: str, preempts: bool) -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(a_nominal, None),
                                    "b": TeamQuota(b_nominal, None)})
    core = make(node("n1", 4), policy=policy)
    assert kinds(run(core, [sub("bj", team="b", prio=b_prio, mn=4)])) == [("Admit", "bj")]
    decisions = run(core, [sub("aj", team="a", prio=a_prio, mn=4)], T0 + 1)
    if preempts:
        assert kinds(decisions) == [("Evict", "bj"), ("Admit", "aj")]
        evict = decisions[0]
        assert isinstance(evict, Evict) and evict.requeue
        assert evict.reason.code is ReasonCode.PREEMPTED
        assert f"preempted for aj (priority {a_prio}, team a)" in evict.reason.message
        assert state(core, "bj") is JobState.PENDING
    else:
        assert decisions == []
        assert state(core, "bj") is JobState.ADMITTED
        assert state(core, "aj") is JobState.PENDING


def test_reclaim_takes_only_what_the_borrower_borrowed() -> None:
    # b holds 2 gangs of 2 with nominal 2: only one is borrowed and may be reclaimed.
    policy = AdmissionPolicy(teams={"a": TeamQuota(4, None), "b": TeamQuota(2, None)})
    core = make(node("n1", 4), policy=policy)
    run(core, [sub("b1", team="b", prio="high", mn=2)])
    run(core, [sub("b2", team="b", prio="high", mn=2)])
    decisions = run(core, [sub("a1", team="a", mn=2)])
    assert kinds(decisions) == [("Evict", "b2"), ("Admit", "a1")]
    # b is now within nominal: a second a-gang cannot take b1.
    assert run(core, [sub("a2", team="a", mn=2)]) == []
    assert state(core, "b1") is JobState.ADMITTED


def test_preemption_may_combine_own_lower_gangs_and_reclaimed_slots() -> None:
    """Victims of a reclaiming gang: its team's lower gangs *plus* the borrowers' gangs.

    (The cheap bound once took max(lower, borrowed) = 2 < 4 and never tried the plan.)
    """
    policy = AdmissionPolicy(teams={"a": TeamQuota(6, 0)})
    core = make(node("n1", 4), policy=policy)
    run(core, [sub("la", team="a", prio="low", mn=2)])
    run(core, [sub("hb", team="b", prio="high", mn=2)])  # b: nominal 0, borrowing 2
    decisions = run(core, [sub("p", team="a", prio="normal", mn=4)])
    assert sorted(kinds(decisions)) == [("Admit", "p"), ("Evict", "hb"), ("Evict", "la")]


def test_gang_admitted_then_reclaimed_in_one_pass_gets_no_admit() -> None:
    """v (team b, borrowing) is admitted, then p (team a, within nominal) reclaims it
    later in the same pass: v ends the pass pending and gets no ``Admit`` (it once got
    ``Admit("v", ())``)."""
    policy = AdmissionPolicy(teams={"a": TeamQuota(4, 0)})
    core = make(node("n1", 4, "d1"), node("n2", 4, "d2"), policy=policy)
    run(core, [sub("w", team="b", mn=4)])
    decisions = run(core, [sub("v", team="b", mn=4), sub("p", team="a", mn=4)], T0 + 1)
    assert state(core, "v") is JobState.PENDING
    assert "v" not in admits(decisions), decisions
    assert admits(decisions) == {"p": ("n2",) * 4}
    assert explain(core, "v").code is ReasonCode.PREEMPTED


def test_gang_reclaimed_in_its_admission_pass_is_not_grown_while_pending() -> None:
    """Same pass, elastic v and spare room: v must not be grown while back in the queue."""
    policy = AdmissionPolicy(teams={"a": TeamQuota(4, 0)})
    core = make(node("n1", 4, "d1"), node("n2", 4, "d2"), policy=policy)
    run(core, [sub("w", team="b", mn=4)])
    core.step([sub("v", team="b", mn=4, mx=8), sub("p", team="a", mn=4),
               node("n3", 2, "d3")], T0 + 1)
    assert state(core, "v") is JobState.PENDING
    assert core.gangs["v"].nodes == []
    core.check_invariants()


def test_gang_passed_over_while_another_team_reclaims_is_not_told_the_pass_stopped() -> None:
    """A gang skipped while only reclaiming teams may go on still gets a reason.

    With nothing free the pass skips ja (its team cannot reclaim) and admits jb behind
    it by reclaim. (Was a bug: ja kept no reason for the pass, so explain said "QUEUED
    ... the last pass stopped before it", which was false.)
    """
    core = make(node("n1", 1), policy=AdmissionPolicy(teams={"b": TeamQuota(4, None)}))
    run(core, [sub("j0", team="a", prio="low")])  # team a (nominal 0) borrows the slot
    decisions = run(core, [sub("ja", team="a", prio="low"), sub("jb", team="b", prio="low")])
    assert admits(decisions) == {"jb": ("n1",)}
    why = explain(core, "ja")
    assert "stopped before it" not in why.message
    assert why.code in (ReasonCode.INSUFFICIENT_CAPACITY, ReasonCode.RESERVED)

def test_quota_blocked_gang_may_preempt_its_own_lower_gang() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(2, 0)})
    core = make(node("n1", 8), policy=policy)
    run(core, [sub("low", team="a", prio="low", mn=2)])
    decisions = run(core, [sub("hi", team="a", prio="high", mn=2)])
    assert kinds(decisions) == [("Evict", "low"), ("Admit", "hi")]
    assert explain(core, "low").code is ReasonCode.QUOTA


def test_a_gang_no_node_could_ever_hold_plans_no_preemption(
        monkeypatch: pytest.MonkeyPatch) -> None:
    core = make(*(node(f"n{i}", 4) for i in range(4)))
    run(core, [sub(f"low{i}", mn=4) for i in range(4)])
    assert all(state(core, f"low{i}") is JobState.ADMITTED for i in range(4))

    def planned(*_args: object) -> None:
        raise AssertionError("preemption planned for a gang no node could ever hold")

    monkeypatch.setattr(preemption, "plan", planned)
    assert run(core, [sub("high-nowhere", prio="high", mn=1, labels={"gpu": "tpu"}),
                      sub("high-too-big", prio="high", k=8)]) == []
    assert explain(core, "high-nowhere").code is ReasonCode.UNSCHEDULABLE
    assert explain(core, "high-too-big").code is ReasonCode.UNSCHEDULABLE


# --- preemption within a team --------------------------------------------------------------


def test_higher_priority_preempts_the_newest_lower_gang_only() -> None:
    core = make(node("n1", 4))
    run(core, [sub("l1", prio="low", mn=2)])
    run(core, [sub("l2", prio="low", mn=2)])
    decisions = run(core, [sub("h", prio="high", mn=2)])
    assert kinds(decisions) == [("Evict", "l2"), ("Admit", "h")]
    evict = decisions[0]
    assert evict == Evict("l2", Reason(ReasonCode.PREEMPTED,
                                       "preempted for h (priority high, team t)"),
                          requeue=True, cause="pass-4")
    assert state(core, "l1") is JobState.ADMITTED
    assert state(core, "l2") is JobState.PENDING


def test_lowest_priority_is_preempted_before_newer_higher() -> None:
    core = make(node("n1", 4))
    run(core, [sub("l", prio="low", mn=2)])
    run(core, [sub("n", prio="normal", mn=2)])
    assert kinds(run(core, [sub("h", prio="high", mn=2)])) == [("Evict", "l"), ("Admit", "h")]


def test_victims_are_taken_newest_first_until_enough() -> None:
    core = make(node("n1", 4))
    run(core, [sub("big", prio="low", mn=2)])
    run(core, [sub("s1", prio="low"), sub("s2", prio="low")])
    # newest first: s2 then s1 (2 slots) suffice; the older big is spared.
    decisions = run(core, [sub("h", prio="high", mn=2)])
    assert sorted(kinds(decisions)) == [("Admit", "h"), ("Evict", "s1"), ("Evict", "s2")]
    assert state(core, "big") is JobState.ADMITTED


def test_unnecessary_victims_are_spared() -> None:
    core = make(node("a", 2, labels={"gpu": "a"}), node("b", 2, labels={"gpu": "b"}))
    run(core, [sub("y", prio="normal", mn=2, labels={"gpu": "a"})])
    run(core, [sub("x", prio="low", mn=2, labels={"gpu": "b"})])
    # x (lowest) is taken first but frees nothing h can use; y is needed; x is spared.
    decisions = run(core, [sub("h", prio="high", mn=2, labels={"gpu": "a"})])
    assert kinds(decisions) == [("Evict", "y"), ("Admit", "h")]
    assert state(core, "x") is JobState.ADMITTED


def test_elastic_victim_is_shrunk_before_any_gang_is_evicted() -> None:
    core = make(node("n1", 4))
    run(core, [sub("rigid", prio="low", mn=2)])
    assert admits(run(core, [sub("e", prio="normal", mn=1, mx=2)])) == {"e": ("n1", "n1")}
    decisions = run(core, [sub("h", prio="high", mn=1)])
    assert kinds(decisions) == [("Shrink", "e"), ("Admit", "h")]
    shrink = decisions[0]
    assert isinstance(shrink, Shrink)
    assert shrink.nodes == ("n1",)
    assert shrink.reason.code is ReasonCode.PREEMPTED
    assert state(core, "e") is JobState.ADMITTED
    assert state(core, "rigid") is JobState.ADMITTED


def test_elastic_victim_keeps_its_min_and_is_evicted_only_if_that_is_not_enough() -> None:
    core = make(node("n1", 4))
    assert admits(run(core, [sub("e", prio="low", mn=2, mx=4)])) == {"e": ("n1",) * 4}
    decisions = run(core, [sub("h", prio="high", mn=2)])
    assert kinds(decisions) == [("Shrink", "e"), ("Admit", "h")]
    assert len(core.gangs["e"].nodes) == 2
    decisions = run(core, [sub("h2", prio="high", mn=2)])
    assert kinds(decisions) == [("Evict", "e"), ("Admit", "h2")]


@pytest.mark.parametrize(("running", "incoming"), [
    ("normal", "normal"), ("high", "normal"), ("high", "low"), ("low", "low")])
def test_never_preempts_equal_or_higher_priority_of_the_same_team(running: str,
                                                                   incoming: str) -> None:
    core = make(node("n1", 4))
    run(core, [sub("r", prio=running, mn=4)])
    assert run(core, [sub("i", prio=incoming, mn=4)]) == []
    assert state(core, "r") is JobState.ADMITTED


# --- elastic -------------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "mn", "mx", "got"), [
    (4, 2, 6, 4), (8, 2, 6, 6), (2, 2, 6, 2), (8, 1, 1, 1)])
def test_elastic_gang_grows_to_max_from_free_capacity(slots: int, mn: int, mx: int,
                                                      got: int) -> None:
    core = make(node("n1", slots))
    placed = admits(run(core, [sub("e", mn=mn, mx=mx)]))["e"]
    assert len(placed) == got


def test_elastic_growth_leaves_reserved_slots_alone() -> None:
    core = make(node("a", 4, labels={"gpu": "a"}), node("b", 4))
    run(core, [sub("f", prio="high", mn=2, labels={"gpu": "a"})])
    assert run(core, [sub("big", mn=4, labels={"gpu": "a"})]) == []
    placed = admits(run(core, [sub("e", prio="low", mn=1, mx=8)]))["e"]
    assert placed == ("b",) * 4
    assert core.nodes["a"].used == 2


def test_elastic_growth_respects_spread() -> None:
    core = make(node("n1", 8, "d1"), node("n2", 1, "d2"))
    placed = admits(run(core, [sub("e", mn=1, mx=8, spread=True)]))["e"]
    per_domain = Counter(core.nodes[n].failure_domain for n in placed)
    # ceil(3 / 2) = 2 per domain; a 4th replica would need a 2nd slot in d2.
    assert per_domain == {"d1": 2, "d2": 1}


def test_a_running_gang_below_its_max_grows_into_slots_freed_later() -> None:
    core = make(node("n1", 4))
    run(core, [sub("f", prio="high", mn=3)])
    assert admits(run(core, [sub("e", mn=1, mx=4)])) == {"e": ("n1",)}
    decisions = run(core, [JobFinished("f")])
    assert kinds(decisions) == [("Evict", "f"), ("Grow", "e")]
    assert decisions[1] == Grow("e", ("n1",) * 4, cause=decisions[1].cause)
    assert explain(core, "e").message == "running 4 replica(s) on 1 node(s)"


def test_a_gang_shrunk_by_a_lost_node_grows_back_on_a_new_one() -> None:
    core = make(node("a", 2), node("b", 2))
    assert admits(run(core, [sub("e", mn=2, mx=4)])) == {"e": ("a", "a", "b", "b")}
    assert kinds(run(core, [node("b", 2, alive=False)])) == [("Shrink", "e")]
    decisions = run(core, [node("c", 2)])
    assert kinds(decisions) == [("Grow", "e")]
    assert nodes_of(core, "e") == Counter({"a": 2, "c": 2})


def test_no_growth_while_a_gang_waits_for_capacity() -> None:
    core = make(node("n1", 4))
    run(core, [sub("e", mn=1, mx=8)])
    run(core, [sub("w", mn=3)])  # e holds all 4 slots and may keep them: w waits
    run(core, [node("n1", 6)])  # two slots more: not enough for w, and not e's either
    assert explain(core, "w").code in (ReasonCode.RESERVED, ReasonCode.INSUFFICIENT_CAPACITY)
    assert len(core.gangs["e"].nodes) == 4
    assert kinds(run(core, [JobCancelled("w")])) == [("Grow", "e")]  # w was only queued
    assert len(core.gangs["e"].nodes) == 6


def test_growth_goes_to_the_higher_priority_gang_first() -> None:
    core = make(node("n1", 2))
    run(core, [sub("lo", mn=1, mx=3)])
    assert kinds(run(core, [sub("hi", prio="high", mn=1, mx=3)])) == [
        ("Shrink", "lo"), ("Admit", "hi")]
    assert kinds(run(core, [node("n3", 1)])) == [("Grow", "hi")]


# --- timeouts ------------------------------------------------------------------------------


def test_pending_gang_fails_after_its_schedule_timeout() -> None:
    core = make(node("n1", 2), node("spare", 1))
    run(core, [sub("f", prio="high", k=2)])
    assert run(core, [sub("g", k=2, timeout=5.0)]) == []
    assert run(core, [], T0 + 5.0) == []  # exactly at the deadline: still waiting
    decisions = run(core, [], T0 + 5.5)
    assert len(decisions) == 1
    fail = decisions[0]
    assert isinstance(fail, Fail) and fail.job_id == "g"
    assert fail.reason.code is ReasonCode.TIMEOUT
    assert fail.reason.message.startswith(
        "not admitted within 5 s; last waiting for: needs 1 replica(s) x 2 slot(s)")
    assert "holding 0 freed slot(s)" in fail.reason.message
    assert state(core, "g") is JobState.FAILED
    assert explain(core, "g") == fail.reason
    assert core.queue == []
    assert run(core, [JobFinished("f")], T0 + 6) == [
        Evict("f", Reason(ReasonCode.FINISHED, "finished"), requeue=False)]


def test_expire_alone_fails_timed_out_gangs_with_their_last_reason() -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(1, 0)})
    core = make(node("n1", 4), policy=policy)
    run(core, [sub("g", team="a", mn=2, timeout=1.0), sub("h", team="a", mn=2, timeout=9.0)])
    assert core.expire(T0 + 1.0) == []
    decisions = core.expire(T0 + 2.0)
    assert [(type(d), d.job_id) for d in decisions] == [(Fail, "g")]
    assert "last waiting for: team a quota: 0/1 slots used" in decisions[0].reason.message
    assert state(core, "h") is JobState.PENDING
    core.check_invariants()


def test_admitted_gang_does_not_time_out() -> None:
    core = make(node("n1", 2))
    assert kinds(run(core, [sub("g", timeout=1.0)])) == [("Admit", "g")]
    assert run(core, [], T0 + 100) == []
    assert state(core, "g") is JobState.ADMITTED


def test_requeued_gang_is_not_failed_on_its_first_deadline() -> None:
    """Rule 7: the wait restarts when a gang is put back in the queue.

    g was admitted at once, lost its node at t+9 and was requeued. (Was a bug: it
    kept its first deadline and failed at t+11 after 2 s of waiting; had a pass run
    between t+10 and the loss, it would never have timed out.)
    """
    core = make(node("n1", 2), node("n2", 2))
    assert kinds(run(core, [sub("g", timeout=10.0)])) == [("Admit", "g")]
    lost = core.gangs["g"].nodes[0]
    other = "n2" if lost == "n1" else "n1"
    run(core, [sub("f", prio="high", k=2, at=T0 + 8)], T0 + 8)
    assert core.gangs["f"].nodes == [other]
    decisions = run(core, [node(lost, 2, alive=False)], T0 + 9)
    assert kinds(decisions) == [("Evict", "g")]
    assert not [d for d in run(core, [], T0 + 11) if isinstance(d, Fail)]
    assert run(core, [], T0 + 19) == []  # 10 s after the requeue: not yet *longer*
    decisions = run(core, [], T0 + 19.5)
    assert kinds(decisions) == [("Fail", "g")]
    assert "last waiting for: node" in decisions[0].reason.message  # type: ignore[union-attr]


# --- nodes ---------------------------------------------------------------------------------


def test_lost_node_requeues_rigid_gang_and_readmits_elsewhere() -> None:
    core = make(node("n1", 2, "d1"), node("n2", 4, "d2"))
    assert admits(run(core, [sub("g", mn=2)])) == {"g": ("n1", "n1")}
    decisions = run(core, [node("n1", 2, "d1", alive=False)], T0 + 1)
    assert decisions[0] == Evict("g", Reason(ReasonCode.NODE_LOST, "node n1 lost"),
                                 requeue=True)
    assert decisions[1:] == [Admit("g", ("n2", "n2"), "pass-3")]
    assert core.nodes["n1"].used == 0


def test_lost_node_evicted_gang_waits_with_node_lost_reason() -> None:
    core = make(node("n1", 2))
    run(core, [sub("g", mn=2)])
    decisions = core.handle(node("n1", 2, alive=False), T0 + 1)
    assert kinds(decisions) == [("Evict", "g")]
    assert explain(core, "g").code is ReasonCode.NODE_LOST
    core.check_invariants()
    assert core.schedule(T0 + 1) == []
    assert explain(core, "g").code is ReasonCode.QUEUED


@pytest.mark.parametrize(("mn", "expect"), [(2, "Shrink"), (3, "Evict")])
def test_lost_node_shrinks_elastic_gang_that_keeps_its_min(mn: int, expect: str) -> None:
    core = make(node("n1", 2, "d1"), node("n2", 2, "d2"))
    assert sorted(admits(run(core, [sub("e", mn=mn, mx=4)]))["e"]) == ["n1", "n1", "n2", "n2"]
    decisions = core.handle(node("n1", 2, "d1", alive=False), T0 + 1)
    core.check_invariants()
    assert kinds(decisions) == [(expect, "e")]
    if expect == "Shrink":
        assert decisions[0] == Shrink("e", ("n2", "n2"),
                                      Reason(ReasonCode.NODE_LOST, "node n1 lost"))
        assert state(core, "e") is JobState.ADMITTED
    else:
        assert isinstance(decisions[0], Evict) and decisions[0].requeue
        assert state(core, "e") is JobState.PENDING


def test_cordoned_node_keeps_running_gangs_but_takes_no_new_ones() -> None:
    core = make(node("n1", 4), node("small", 1))
    run(core, [sub("g", k=2)])
    assert run(core, [node("n1", 4, cordoned=True)]) == []
    assert state(core, "g") is JobState.ADMITTED
    assert core.gangs["g"].nodes == ["n1"]
    assert run(core, [sub("h", k=2)]) == []
    assert explain(core, "h").code is ReasonCode.UNSCHEDULABLE
    assert "the 1 schedulable nodes offer 1 slots" in explain(core, "h").message
    assert admits(run(core, [node("n1", 4)])) == {"h": ("n1",)}


def test_node_returning_after_loss_is_used_again() -> None:
    core = make(node("n1", 2))
    run(core, [sub("g", mn=2)])
    run(core, [node("n1", 2, alive=False)])
    assert state(core, "g") is JobState.PENDING
    assert admits(run(core, [node("n1", 2)])) == {"g": ("n1", "n1")}


def test_a_silent_node_still_counts_toward_what_could_ever_fit() -> None:
    """A submit while every node's heartbeat lags (a new leader under load) is queued
    with its reason, not refused as never fitting; only leaving the registry shrinks
    the cluster."""
    core = make(node("n1", 2, alive=False), node("n2", 2, alive=False))
    core.validate(spec(mn=4))
    assert run(core, [sub("g", mn=4)]) == []
    assert state(core, "g") is JobState.PENDING
    with pytest.raises(SpecRejected, match="whole cluster has 4"):
        core.validate(spec(mn=5))
    assert admits(run(core, [node("n1", 2), node("n2", 2)])) == {
        "g": ("n1", "n1", "n2", "n2")}


def test_validate_judges_against_the_registry_the_service_passes() -> None:
    """A node the registry already holds counts before its event reaches the core (the
    service's view, while a long pass holds the core's queue up), and the largest node
    decides what one replica may ask."""
    core = make(node("n1", 2))
    core.validate(spec(mn=5), Capacity.of([2, 4]))
    with pytest.raises(SpecRejected, match="whole cluster has 2"):
        core.validate(spec(mn=5))
    with pytest.raises(SpecRejected, match="whole cluster has 6"):
        core.validate(spec(mn=7), Capacity.of([2, 4]))
    with pytest.raises(SpecRejected, match="exceeds every node's slots"):
        core.validate(spec(mn=1, k=3), Capacity.of([2, 2]))
    core.validate(spec(mn=1, k=3), Capacity.of([2, 4]))
    with pytest.raises(SpecRejected, match="whole cluster has 0"):
        core.validate(spec(mn=1), Capacity.of([]))


def test_node_removed_requeues_and_forgets_the_node() -> None:
    core = make(node("n1", 2), node("n2", 2))
    run(core, [sub("g", mn=2, labels={})])
    on = core.gangs["g"].nodes[0]
    decisions = run(core, [NodeRemoved(on, event_id="ev-7")])
    assert decisions[0] == Evict("g", Reason(ReasonCode.NODE_LOST, f"node {on} lost"),
                                 requeue=True, cause="ev-7")
    assert on not in core.nodes
    assert kinds(decisions[1:]) == [("Admit", "g")]
    with pytest.raises(SpecRejected, match="whole cluster has 2"):
        core.validate(spec(mn=3))
    assert run(core, [NodeRemoved("nope")]) == []


def test_removing_an_idle_node_keeps_the_next_pass_working() -> None:
    """(Was a bug: NodeRemoved of an idle node did not bump ``_version``, so the cached
    free sizes kept 8 and the next pass raised KeyError: 8 in ``_candidates``.)"""
    core = make(node("a", 8), node("b", 4))
    assert run(core, [sub("y", labels={"gpu": "h100"})]) == []  # a pass that caches sizes
    assert run(core, [NodeRemoved("a")]) == []
    assert explain(core, "y").code is ReasonCode.UNSCHEDULABLE
    assert admits(run(core, [sub("z", mn=4)])) == {"z": ("b",) * 4}

def test_node_shrinking_below_use_gives_back_its_newest_gangs() -> None:
    core = make(node("n1", 4))
    run(core, [sub("old", prio="high", mn=2)])
    run(core, [sub("new", prio="low", mn=2)])
    decisions = run(core, [node("n1", 3)])
    assert kinds(decisions) == [("Evict", "new")]
    assert decisions[0].reason == Reason(ReasonCode.NODE_LOST,  # type: ignore[union-attr]
                                         "node n1 shrank to 3 slots")
    assert state(core, "old") is JobState.ADMITTED


# --- validate ------------------------------------------------------------------------------


@pytest.mark.parametrize(("kw", "message"), [
    ({"prio": "urgent"}, "priority_class 'urgent' is not one of: high, low, normal"),
    ({"mn": 5, "k": 2}, "replicas.min x slots_per_replica = 5 x 2 = 10 slots, but the whole "
                        "cluster has 8"),
    ({"k": 5}, "slots_per_replica 5 exceeds every node's slots"),
    ({"s": 3, "k": 2}, "ranks_per_replica x slots_per_replica = 3 x 2 = 6 slots on one node, "
                       "but the largest node has 4: a replica's ranks run on one node"),
    ({"s": 5}, "ranks_per_replica x slots_per_replica = 5 x 1 = 5 slots on one node, but the "
               "largest node has 4: a replica's ranks run on one node"),
    ({"mn": 3, "s": 2, "k": 2}, "replicas.min x ranks_per_replica x slots_per_replica = "
                                "3 x 2 x 2 = 12 slots, but the whole cluster has 8"),
    ({"team": "a", "mn": 5}, "needs 5 slots but team 'a' may hold at most 4"),
])
def test_validate_rejects_naming_the_field(kw: dict[str, object], message: str) -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(3, 1)})
    core = make(node("n1", 4), node("n2", 4), policy=policy)
    with pytest.raises(SpecRejected) as info:
        core.validate(spec(**kw))  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize("kw", [
    {"mn": 8}, {"mn": 2, "k": 4}, {"team": "a", "mn": 4}, {"prio": "low", "mx": 100},
    {"mn": 2, "s": 2, "k": 2}, {"s": 4}])
def test_validate_accepts_what_could_fit(kw: dict[str, object]) -> None:
    policy = AdmissionPolicy(teams={"a": TeamQuota(3, 1)})
    core = make(node("n1", 4), node("n2", 4, cordoned=True), policy=policy)
    core.validate(spec(**kw))  # type: ignore[arg-type]


def test_unknown_priority_class_fails_at_submission() -> None:
    core = make(node("n1", 4))
    decisions = run(core, [JobSubmitted("j", spec(prio="urgent"), T0, "ev-1")])
    assert decisions == [Fail("j", Reason(ReasonCode.UNSCHEDULABLE,
                                          "unknown priority class 'urgent'"), "ev-1")]
    assert state(core, "j") is JobState.FAILED


# --- restore -------------------------------------------------------------------------------


def test_restore_readmits_onto_the_given_nodes() -> None:
    core = make(node("n1", 4), node("n2", 4))
    assert core.restore(sub("g", mn=3, mx=3), ["n2", "n1", "n2"]) == []
    core.check_invariants()
    assert state(core, "g") is JobState.ADMITTED
    assert nodes_of(core, "g") == {"n2": 2, "n1": 1}
    assert (core.nodes["n1"].used, core.nodes["n2"].used) == (1, 2)
    assert core.restore(sub("g", mn=3), ["n1"]) == []  # replay of a known gang: no change
    assert run(core, [sub("h", mn=6)]) == []
    assert explain(core, "h").code is ReasonCode.RESERVED


@pytest.mark.parametrize(("setup", "nodes"), [
    ([], ["gone"]),
    ([node("n1", 4, alive=False)], ["n1"]),
    ([node("n1", 1)], ["n1", "n1"]),
])
def test_restore_requeues_when_a_node_is_gone_or_full(setup: list[NodeUpdated],
                                                      nodes: list[str]) -> None:
    core = make(node("n2", 4), *setup)
    decisions = core.restore(JobSubmitted("g", spec(mn=len(nodes)), T0, "ev-9"), nodes)
    core.check_invariants()
    assert len(decisions) == 1
    evict = decisions[0]
    assert isinstance(evict, Evict) and evict.job_id == "g" and evict.requeue
    assert evict.cause == "ev-9"
    assert evict.reason.code is ReasonCode.NODE_LOST
    assert "is gone or full after a leader change" in evict.reason.message
    assert state(core, "g") is JobState.PENDING
    assert len(admits(run(core))["g"]) == len(nodes)


def test_restore_without_nodes_just_queues() -> None:
    core = make(node("n1", 1))
    run(core, [sub("f", prio="high")])
    assert core.restore(sub("g"), []) == []
    assert state(core, "g") is JobState.PENDING


# --- explain -------------------------------------------------------------------------------


def test_explain_reports_position_and_queue_length() -> None:
    core = make(node("n1", 4), node("spare", 1))
    run(core, [sub("f", prio="high", mn=2, k=2)])
    run(core, [sub("a", prio="high", k=2), sub("b", k=2), sub("c", k=2)])
    assert explain(core, "a").message.endswith("(position 1 of 3)")
    assert explain(core, "b").message.endswith("(position 2 of 3)")
    assert explain(core, "c").message.endswith("(position 3 of 3)")
    run(core, [JobCancelled("a")])
    assert explain(core, "c").message.endswith("(position 2 of 2)")


def test_explain_says_queued_for_gangs_the_pass_did_not_reach() -> None:
    core = make(node("n1", 4))
    run(core, [sub("f", prio="low", mn=4)])
    assert run(core, [sub("x", prio="low"), sub("y", prio="low")]) == []
    why = explain(core, "y")
    assert why.code is ReasonCode.QUEUED
    assert why.message.startswith("position 2 of 2 in the queue; the last pass stopped before it")
    assert "priority low or lower" in why.message


def test_explain_before_any_pass_and_for_unknown_jobs() -> None:
    core = AdmissionCore(AdmissionPolicy())
    core.handle(sub("g"), T0)
    assert explain(core, "g").code is ReasonCode.QUEUED
    with pytest.raises(KeyError):
        core.explain("nope")


# --- cancel and finish ---------------------------------------------------------------------


@pytest.mark.parametrize(("event", "code"), [
    (JobCancelled("g", "ev-3"), ReasonCode.CANCELLED),
    (JobFinished("g", "ev-3"), ReasonCode.FINISHED),
])
def test_ending_an_admitted_gang_frees_its_slots(event: Event, code: ReasonCode) -> None:
    core = make(node("n1", 4))
    run(core, [sub("g", mn=4)])
    run(core, [sub("w", mn=4)])
    decisions = run(core, [event])
    assert decisions == [Evict("g", Reason(code, code.value), requeue=False, cause="ev-3"),
                         Admit("w", ("n1",) * 4, "pass-4")]
    assert state(core, "g").value == code.value
    # A cancel is the user's request; a finish is health's finding, its reason in the record.
    said = "cancelled by request" if code is ReasonCode.CANCELLED else code.value
    assert explain(core, "g") == Reason(code, said)
    assert core.usage["t"] == 4


def test_cancel_of_pending_removes_it_from_the_queue() -> None:
    core = make(node("n1", 1))
    run(core, [sub("f", prio="high")])
    run(core, [sub("a"), sub("b")])
    assert run(core, [JobCancelled("a")]) == []
    assert [g.job_id for g in core.queue] == ["b"]
    assert state(core, "a") is JobState.CANCELLED
    assert run(core, [JobCancelled("a"), JobFinished("a"), JobCancelled("zz")]) == []
    assert admits(run(core, [JobFinished("f")])) == {"b": ("n1",)}


def test_resubmitting_a_known_job_is_ignored() -> None:
    core = make(node("n1", 2))
    run(core, [sub("g", mn=2)])
    assert run(core, [sub("g", mn=1, prio="high")]) == []
    assert len(core.gangs["g"].nodes) == 2
    assert len(core.gangs) == 1


def test_requeued_running_gang_frees_its_slots_and_is_admitted_again() -> None:
    core = make(node("n1", 2))
    run(core, [sub("g", mn=2)])
    decisions = core.handle(JobRequeued("g", "below its minimum for 60 s", "el"), T0 + 1)
    assert kinds(decisions) == [("Evict", "g")] and decisions[0].requeue
    assert explain(core, "g").code is ReasonCode.MEMBERS_LOST
    assert core.nodes["n1"].used == 0
    core.check_invariants()
    assert admits(run(core, now=T0 + 2)) == {"g": ("n1", "n1")}
    assert core.handle(JobRequeued("nope", "x"), T0 + 3) == []


@pytest.mark.parametrize(("old", "slots", "new", "expected"), [
    (["a", "a", "b", "b"], [], ["b", "b"], [2, 3]),  # a node lost: the rest keep their slots
    (["a", "b", "a", "b"], [], ["a", "a"], [0, 2]),
    (["b", "b"], [2, 3], ["b", "b", "c"], [2, 3, 4]),  # grown: a fresh number
    (["a", "b"], [], ["a", "b"], [0, 1]),  # unchanged
])
def test_slots_that_stay_keep_their_numbers(old: list[str], slots: list[int], new: list[str],
                                            expected: list[int]) -> None:
    assert carry_slots(old, slots, new) == expected


def test_a_gang_growing_back_never_reuses_a_slot_number() -> None:
    # a, a, b, b -> b lost -> a, a keep 0, 1 -> grown on c: 4, 5, not b's 2, 3 again.
    assert carry_slots(["a", "a"], [0, 1], ["a", "a", "c", "c"], next_slot=4) == [0, 1, 4, 5]


def test_explain_names_the_cordoned_and_lost_nodes_a_waiting_gang_could_use() -> None:
    """Three chaos kills cordoned the user's own node, and explain blamed missing slots."""
    core = make(node("n1", 2), node("n2", 2, cordoned=True), node("n3", 2, alive=False))
    run(core, [sub("g", mn=4)])
    why = explain(core, "g")
    assert why.code is ReasonCode.UNSCHEDULABLE
    assert why.message.endswith("; not counted: 2 slot(s) on cordoned node(s) n2; 2 slot(s) "
                                "on lost node(s) n3 (position 1 of 1)"), why.message
    run(core, [node("n2", 2)])  # uncordoned: it fits
    assert state(core, "g") is JobState.ADMITTED


def test_a_records_admission_counts_each_time_the_job_is_admitted() -> None:
    from phalanx.services.admission.core import admission_number

    assert admission_number(None, 0, JobState.PENDING) == 0  # submitted
    assert admission_number(JobState.PENDING, 0, JobState.ADMITTED) == 1
    assert admission_number(JobState.ADMITTED, 1, JobState.ADMITTED) == 1  # written again
    assert admission_number(JobState.ADMITTED, 1, JobState.PENDING) == 1  # requeued
    assert admission_number(JobState.PENDING, 1, JobState.ADMITTED) == 2
    assert admission_number(JobState.ADMITTED, 2, JobState.FINISHED) == 2

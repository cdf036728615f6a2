"""Admission obeys an elastic gang's scaling rules under random event streams.

One low-priority elastic gang ``e`` (random min/max, increment step or
discrete sizes, growth cooldown) shares a random cluster with a stream of
rigid higher-priority jobs that arrive and finish, node losses and returns,
operator pins and releases, and time passing. After every batch, checked
against what the decisions said (not the core's word):

* ``e``'s size is never below its smallest allowed size, never above ``max``,
  never a size its rules do not allow, never above a pin;
* every growth of ``e`` comes at least its cooldown after its previous size
  change, and is preceded by a shrink or by capacity freed (a job finished, a
  node back, a pin released) since its previous growth (no oscillation: growth
  only refills what an event took or takes what an event gave);
* a pass that grows a gang leaves no gang waiting for capacity or holding a
  reservation in it (a waiting gang's slots are never taken for growth);
* a pass run again at once, with nothing new, decides nothing (a fixpoint);
* every size change of ``e`` is announced with its sizes; a planned change (its
  runtime, simulated, reports the world size when told) is done only when the
  reported size is its target, is never left in progress past its deadline, and
  an abandoned growth shrinks back to its size before.

A second test runs a steady arrival pattern (a rigid job every ``period``
seconds, each lasting ``duration``) and bounds how often ``e`` changes.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from phalanx.schemas.messages import (
    JobSpec,
    JobState,
    ReasonCode,
    ReplicaRange,
    ScalingEventKind,
    ScalingPolicy,
)
from phalanx.schemas.scaling import ScalingRules
from phalanx.services.admission.changes import Announce
from phalanx.services.admission.core import AdmissionCore
from phalanx.services.admission.events import (
    Admit,
    Decision,
    Evict,
    Grow,
    JobFinished,
    JobSubmitted,
    MembershipChanged,
    NodeUpdated,
    ScalePinned,
    Shrink,
)
from phalanx.services.admission.policy import AdmissionPolicy

T0 = 1_717_000_000.0
WAITING = {ReasonCode.RESERVED, ReasonCode.INSUFFICIENT_CAPACITY}


def elastic_spec(low: int, high: int, policy: ScalingPolicy) -> JobSpec:
    return JobSpec(name="e", team="t", priority_class="low",
                   replicas=ReplicaRange(min=low, max=high), command=["x"], scaling=policy)


def rigid_spec(size: int) -> JobSpec:
    return JobSpec(name="r", team="t", priority_class="high",
                   replicas=ReplicaRange(min=size, max=size), command=["x"])


@st.composite
def elastic_specs(draw: st.DrawFn) -> JobSpec:
    low = draw(st.integers(1, 3))
    high = draw(st.integers(low, 8))
    cooldown = draw(st.sampled_from([0.0, 0.0, 1.0, 5.0]))
    timeout = draw(st.sampled_from([2.0, 5.0, 600.0]))
    kind = draw(st.sampled_from(["every", "step", "discrete"]))
    if kind == "step":
        policy = ScalingPolicy(replica_increment_step=draw(st.integers(1, 3)),
                               scale_up_cooldown_s=cooldown, scaling_timeout_s=timeout)
    elif kind == "discrete":
        values = draw(st.sets(st.integers(low, high), min_size=1, max_size=4))
        policy = ScalingPolicy(replica_discrete_values=sorted(values),
                               scale_up_cooldown_s=cooldown, scaling_timeout_s=timeout)
    else:
        policy = ScalingPolicy(scale_up_cooldown_s=cooldown, scaling_timeout_s=timeout)
    return elastic_spec(low, high, policy)


OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 3)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("lose"), st.integers(0, 3)),
    st.tuples(st.just("revive"), st.integers(0, 3)),
    st.tuples(st.just("pin"), st.integers(1, 8)),
    st.tuples(st.just("unpin"), st.just(0)),
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 3.0, 10.0])),
    st.tuples(st.just("runtime"), st.just(0)),  # e's runtime reports its placement's size
), min_size=1, max_size=40)


class Watch:
    """What the decisions say about ``e``, and the checks."""

    def __init__(self, spec: JobSpec) -> None:
        self.rules = ScalingRules.of(spec)
        self.spec = spec
        self.size = 0
        self.changed_at: float | None = None
        self.shrunk_since_growth = True
        self.freed = False  # capacity freed since the last growth
        self.pin: int | None = None
        self.world_size: int | None = None  # what e's runtime last reported

    def see(self, decisions: list[Decision], core: AdmissionCore, now: float) -> None:
        grew = False
        abandoned_growth: int | None = None  # the size an abandoned growth shrinks back to
        for d in decisions:
            if isinstance(d, Grow):
                grew = True
            if d.job_id != "e":
                continue
            match d:
                case Admit(nodes=nodes):
                    self.size, self.changed_at = len(nodes), now
                case Grow(nodes=nodes):
                    assert len(nodes) > self.size
                    assert self.changed_at is not None
                    assert now >= self.changed_at + self.rules.cooldown_s, \
                        f"grew {now - self.changed_at:g} s after a change, cooldown " \
                        f"{self.rules.cooldown_s:g}"
                    assert self.shrunk_since_growth or self.freed, \
                        "grew twice without a shrink or freed capacity between"
                    self.shrunk_since_growth = self.freed = False
                    self.size, self.changed_at = len(nodes), now
                case Shrink(nodes=nodes):
                    assert len(nodes) < self.size
                    self.shrunk_since_growth = True
                    self.size, self.changed_at = len(nodes), now
                case Evict():
                    self.size, self.shrunk_since_growth = 0, True
                    self.world_size = None
                case Announce(kind=ScalingEventKind.GROW | ScalingEventKind.SHRINK):
                    assert d.to_replicas == self.size, f"announced {d}, size {self.size}"
                    if d.kind is ScalingEventKind.SHRINK and abandoned_growth is not None:
                        assert d.to_replicas == abandoned_growth, d
                        abandoned_growth = None
                case Announce(kind=ScalingEventKind.DONE):
                    assert d.to_replicas == self.world_size, f"{d} at {self.world_size}"
                case Announce(kind=ScalingEventKind.TIMEOUT):
                    assert d.deadline is not None and now >= d.deadline, d
                    if d.from_replicas < d.to_replicas and self.size > d.from_replicas:
                        abandoned_growth = d.from_replicas
        assert abandoned_growth is None, "an abandoned growth kept its slots"
        change = core.gangs["e"].change
        assert change is None or now < change.deadline, f"{change} past its deadline"
        if self.size:
            assert self.rules.smallest <= self.size <= self.spec.replicas.max
            assert self.rules.allows(self.size), f"size {self.size} not in {self.rules.sizes}"
            assert self.pin is None or self.size <= self.pin, f"{self.size} above pin {self.pin}"
        if grew:
            waiting = [g.job_id for g in core.queue
                       if g.reason_pass == core.pass_no and g.reason.code in WAITING]
            assert not waiting, f"a pass grew a gang while {waiting} waited for capacity"


@settings(max_examples=300, deadline=None)
@given(spec=elastic_specs(), nodes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
       ops=OPS)
# A node lost shrinks e and it regrows on the other node's free slot at once; the node
# back lets it grow again, with no shrink between (capacity freed).
@example(spec=elastic_spec(1, 5, ScalingPolicy()), nodes=[2, 4],
         ops=[("lose", 0), ("revive", 0)])
def test_admission_obeys_the_scaling_rules(spec: JobSpec, nodes: list[int],
                                           ops: list[tuple]) -> None:
    core = AdmissionCore(AdmissionPolicy())
    now = T0
    for i, slots in enumerate(nodes):
        core.handle(NodeUpdated(f"n{i}", slots, f"d{i % 2}", {}), now)
    if sum(nodes) < ScalingRules.of(spec).smallest:
        return  # validate() would refuse it
    watch = Watch(spec)
    watch.see(core.step([JobSubmitted("e", spec, now)], now), core, now)
    arrivals = 0
    for op, arg in ops:
        events: list = []
        match op:
            case "arrive":
                if arg <= sum(nodes):
                    events.append(JobSubmitted(f"r{arrivals}", rigid_spec(arg), now))
                    arrivals += 1
            case "finish":
                if arrivals:
                    events.append(JobFinished(f"r{arg % arrivals}"))
                    watch.freed = True
            case "lose" | "revive":
                node = arg % len(nodes)
                events.append(NodeUpdated(f"n{node}", nodes[node], f"d{node % 2}", {},
                                          alive=op == "revive"))
                watch.freed |= op == "revive"
            case "pin" | "unpin":
                replicas = None if op == "unpin" else arg
                if core.pin_problem("e", replicas) is None:
                    events.append(ScalePinned("e", replicas))
                    watch.pin = replicas
                    watch.freed |= replicas is None or replicas > watch.size
            case "tick":
                now += arg
            case "runtime":
                watch.world_size = watch.size or None
                events.append(MembershipChanged("e", watch.world_size))
        decisions = core.step(events, now)
        watch.see(decisions, core, now)
        core.check_invariants()
        assert not [d for d in core.schedule(now) if isinstance(d, (Grow, Shrink))], \
            "a second pass with nothing new changed a size"


@settings(max_examples=100, deadline=None)
@given(spec=elastic_specs(), period=st.sampled_from([1.0, 2.0, 5.0]),
       share=st.sampled_from([0.2, 0.5, 0.8]), size=st.integers(1, 3),
       rounds=st.integers(3, 20))
def test_a_steady_arrival_pattern_changes_the_size_at_a_bounded_rate(
        spec: JobSpec, period: float, share: float, size: int, rounds: int) -> None:
    core = AdmissionCore(AdmissionPolicy())
    now = T0
    for i in range(2):
        core.handle(NodeUpdated(f"n{i}", 4, f"d{i}", {}), now)
    watch = Watch(spec)
    watch.see(core.step([JobSubmitted("e", spec, now)], now), core, now)
    changes = 0
    for k in range(rounds):
        for event, at in ((JobSubmitted(f"r{k}", rigid_spec(size), now), now),
                          (JobFinished(f"r{k}"), now + share * period)):
            now = at
            watch.freed = isinstance(event, JobFinished)
            decisions = core.step([event], now)
            watch.see(decisions, core, now)
            changes += sum(1 for d in decisions if d.job_id == "e"
                           and isinstance(d, (Grow, Shrink)))
        # Time passes until the next arrival, the shell's ticks running passes.
        for _ in range(4):
            now += (1 - share) * period / 4
            decisions = core.schedule(now)
            watch.see(decisions, core, now)
            changes += sum(1 for d in decisions if d.job_id == "e"
                           and isinstance(d, (Grow, Shrink)))
    # Each arrival may cost one shrink and one growth; growth only every cooldown.
    cooldown = ScalingRules.of(spec).cooldown_s
    growths_bound = rounds if cooldown == 0 else 1 + int(rounds * period / cooldown)
    assert changes <= rounds + min(rounds, growths_bound)
    assert core.gangs["e"].state in (JobState.ADMITTED, JobState.PENDING)

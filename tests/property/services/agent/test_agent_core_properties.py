"""Two live agents never share a node id, under any interleaving.

The bus is modelled purely: one shared ``NodeRecord | None`` (the KV entry,
updated atomically as ``TypedKV.modify`` does), a monotone clock, and agents
that register, heartbeat, stop cleanly (conditional delete, as in
``AgentService.teardown``), crash (record left behind) and restart with a new
pid. An agent *believes* it holds the id from a successful register until a
``NodeIdTaken`` or its stop; it is *alive* while its last successful write is
at most ``lost_after_s`` old by the true clock. Each agent stamps its records by a
clock of its own, off by up to an hour; one that finds another agent's record
may watch it (:func:`silent_holder`) and register with what it watched once
more than ``lost_after_s`` has passed.
"""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from phalanx.schemas.messages import NodeInfo, NodeRecord
from phalanx.services.agent.core import NodeIdTaken, heartbeat, register, silent_holder

T0 = 1_717_000_000.0
LOST = 3.0
NODE = "gpu-07"


@dataclasses.dataclass
class Agent:
    host: str
    pid: int
    clock_off: float = 0.0  # its stamps: the true time plus this
    holds: bool = False
    last_ok: float = -1.0
    watched: tuple[NodeRecord, float] | None = None  # a holder's record, and since when

    @property
    def info(self) -> NodeInfo:
        return NodeInfo(node_id=NODE, host=self.host, slots=4, failure_domain="d",
                        agent_pid=self.pid)

    def owns(self, record: NodeRecord | None) -> bool:
        return (record is not None and record.node.host == self.host
                and record.node.agent_pid == self.pid)


AGENT = st.integers(0, 1)
STEPS = st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, LOST, LOST + 0.1, 5.0, 30.0]) | st.floats(
    0.0, 10.0)


class NodeIdMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.record: NodeRecord | None = None
        # Two agents on the same host: only the pid tells them apart. Their clocks
        # disagree by more than any timeout.
        self.agents = [Agent("host-a", 100, -3600.0), Agent("host-a", 200, 1800.0)]
        self.next_pid = 1000

    def alive(self, agent: Agent) -> bool:
        return agent.holds and self.now - agent.last_ok <= LOST

    @rule(dt=STEPS)
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(i=AGENT)
    def watch(self, i: int) -> None:
        agent = self.agents[i]
        agent.watched = None if self.record is None else (self.record, self.now)

    @rule(i=AGENT)
    def start_or_re_register(self, i: int) -> None:
        agent = self.agents[i]
        silent = None
        if agent.watched is not None and self.now - agent.watched[1] > LOST:
            silent = agent.watched[0]  # watched long enough (each read it made is moot)
        try:
            self.record = register(self.record, agent.info, self.now + agent.clock_off,
                                   silent=silent)
        except NodeIdTaken:
            agent.holds = False
            assert not silent_holder(silent, self.record)
        else:
            agent.holds, agent.last_ok = True, self.now
            assert self.record.heartbeat_seq == 0

    @precondition(lambda self: any(a.holds for a in self.agents))
    @rule(i=AGENT)
    def beat(self, i: int) -> None:
        agent = self.agents[i]
        if not agent.holds:
            return
        before = self.record
        try:
            self.record = heartbeat(self.record, agent.info, self.now + agent.clock_off)
        except NodeIdTaken:
            assert not agent.owns(before)
            agent.holds = False
        else:
            agent.last_ok = self.now
            if before is not None:
                assert self.record.heartbeat_seq == before.heartbeat_seq + 1

    @rule(i=AGENT)
    def stop(self, i: int) -> None:
        agent = self.agents[i]
        if agent.holds and agent.owns(self.record):
            self.record = None  # delete conditional on our revision
        agent.holds = False

    @rule(i=AGENT)
    def crash_and_restart_with_new_pid(self, i: int) -> None:
        agent = self.agents[i]
        self.next_pid += 1
        agent.pid, agent.holds = self.next_pid, False

    @invariant()
    def at_most_one_live_holder(self) -> None:
        live = [a for a in self.agents if self.alive(a)]
        assert len(live) <= 1, (self.now, self.record, live)

    @invariant()
    def a_live_holder_owns_the_record(self) -> None:
        for agent in self.agents:
            if self.alive(agent):
                assert agent.owns(self.record)
                assert self.record is not None
                assert self.record.heartbeat_at == agent.last_ok + agent.clock_off


NodeIdMachine.TestCase.settings = settings(
    derandomize=True, database=None, deadline=None, max_examples=150,
    stateful_step_count=40,
)
TestNodeIdMachine = NodeIdMachine.TestCase

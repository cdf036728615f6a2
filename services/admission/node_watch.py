"""Which nodes admission's leader judges alive: the registry's rule, applied to the
heartbeats as this leader heard them, and only to the silence it could have heard.

A heartbeat is timed by when the leader first read it, by its own clock, not by the
agent's stamp (the Kubernetes node controller times a node's lease the same way): an
agent whose clock is off by any amount is judged as one whose clock agrees. A record
rewritten without a new heartbeat (a cordon, a resync after a reconnection) times
nothing.

The registry's rule (:func:`phalanx.schemas.registry.view`) judges a node lost after
``lost_after_s`` of silence since the reader began watching. A leader cannot hear
before its term begins, while its bus connection is down (and for one timeout after
it, while the agents' first writes may be refused), or while its event loop is held
up. Each of these blinds it to every node alike (:meth:`NodeWatch.blind_until`).

It cannot tell either during a *mass silence* (:func:`~phalanx.schemas.registry.mass_silence`):
a node times out while no other node has been heard for half a timeout. That is more
likely the leader's fault or the network's than every node's, so no judgement
changes until some node is heard again. Then each node the leader believed alive is
credited the span in which no node was heard, and nothing more, as health's detector
does (:func:`phalanx.services.health.detect.resumed`). A node that was already silent
before that span stays that much nearer its timeout. With a full timeout from the end
instead, a dead node's requeue was put off at each of its deadlines where its
survivors' heartbeats happened to arrive late.

Pure: the caller passes each record it reads and the time, and keeps what it last
judged each node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from phalanx.schemas.messages import NodeRecord
from phalanx.schemas.registry import Heard, NodeState, heard, mass_silence, view


@dataclasses.dataclass
class NodeWatch:
    """One leader's judgement of the nodes' silence (see the module)."""

    lost_after_s: float
    #: Silence before this proves nothing about any node.
    watching_since: float = float("-inf")
    #: Per node: its newest heartbeat, as read.
    heard: dict[str, Heard] = dataclasses.field(default_factory=dict)
    #: Per node: silence before this proves nothing (the credit of a mass silence).
    credited: dict[str, float] = dataclasses.field(default_factory=dict)
    #: A mass silence under way: since when.
    silent_since: float | None = None
    #: When a node was last heard before the mass silence under way.
    unheard_since: float = float("-inf")

    def blind_until(self, at: float) -> None:
        """Nothing before ``at`` could have been heard."""
        self.watching_since = max(self.watching_since, at)

    def judged_from(self, node_id: str) -> float:
        """The time from which ``node_id``'s silence counts against it (at its latest
        heartbeat; that one if later)."""
        return max(self.watching_since, self.credited.get(node_id, float("-inf")))

    def read(self, record: NodeRecord, believed_alive: Callable[[], Iterable[NodeRecord]],
             now: float) -> float | None:
        """``record`` was read at ``now``. If it holds a new heartbeat that ends a mass
        silence, credit each other node ``believed_alive()`` gives (asked only then: a
        heartbeat is read for every node every second) the span in which no node was
        heard, and return how long the silence was held; otherwise None."""
        node_id = record.node.node_id
        known = self.heard.get(node_id)
        self.heard[node_id] = heard(known, record, now)
        if self.heard[node_id] is known:
            return None  # rewritten, not a heartbeat
        if self.silent_since is None:
            return None
        span = now - self.unheard_since
        for other in believed_alive():
            other_id = other.node.node_id
            if other_id != node_id:
                self.credited[other_id] = self._heard_or_judged(other_id) + span
        held, self.silent_since = now - self.silent_since, None
        return held

    def alive(self, record: NodeRecord, now: float, was_alive: bool | None) -> bool:
        """Whether ``record``'s node is alive at ``now`` (a record not read before counts
        as read now). During a mass silence a node keeps the judgement it had
        (``was_alive``; None: it has none yet)."""
        if self.silent_since is not None and was_alive is not None:
            return was_alive
        node_id = record.node.node_id
        read = self.heard.setdefault(node_id, heard(None, record, now))
        return view(record, now, self.lost_after_s, watching_since=self.judged_from(node_id),
                    heard_at=read.at).state is NodeState.ALIVE

    def hold(self, believed_alive: Iterable[NodeRecord], now: float) -> bool:
        """Whether a mass silence begins at ``now``, among the nodes believed alive."""
        if self.silent_since is not None:
            return False
        last = [self._heard_or_judged(r.node.node_id) for r in believed_alive]
        falling = any(now - at > self.lost_after_s for at in last)
        if not falling or not mass_silence(last, now, self.lost_after_s):
            return False
        self.silent_since = now
        self.unheard_since = max(last)
        return True

    def forget(self, node_id: str) -> None:
        """``node_id`` left the registry."""
        self.heard.pop(node_id, None)
        self.credited.pop(node_id, None)

    def _heard_or_judged(self, node_id: str) -> float:
        read = self.heard.get(node_id)
        return max(float("-inf") if read is None else read.at, self.judged_from(node_id))

"""The node registry's rule: is a node alive, and what does it offer.

A node is *alive* while its agent's last heartbeat is at most
``lost_after_s`` old and *lost* after that; a lost node's slots are not
offered. Cordoned nodes stay listed but offer no slots for new work, and a
node's cordoned slots (a GPU that failed) are not offered either. Pure:
the caller passes the records and ``now``.

A reader that could not see heartbeats for a while (its own bus connection
was down, or it has just started judging) passes ``watching_since``: silence
before that proves nothing, so a node is lost only after ``lost_after_s`` of
silence the reader could have heard — a bus outage never looks like every
node dying.

A *mass silence* is the same proof of nothing (:func:`mass_silence`): a node that
times out while no other node was heard within half a timeout either is more likely
the reader's fault (its server cut off from the agents, its heartbeat readers starved)
or the network's than every node's at once; the Kubernetes node controller stops
evicting a fully disrupted zone for the same reason. Admission and health then judge
nothing until a node is heard again, and then credit each node the span in which no
node was heard; a lone node's silence is its own.

A reader that follows the registry passes ``heard_at``, when it read each heartbeat by
its own clock (:func:`heard`), as the Kubernetes node controller times a node's lease
by when it saw it renewed: then an agent's clock may be off by any amount. A one-off
reader has only the agent's stamp, good while the clocks agree.

Every reader of the registry (admission, the agent, checkpoint placement, ``phalanx
nodes`` and ``top``) applies this one rule, so it lives in the contract they share.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

from phalanx.schemas.messages import GpuInfo, NodeRecord

DEFAULT_LOST_AFTER_S = 3.0


class NodeState(enum.StrEnum):
    ALIVE = "alive"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class NodeView:
    node_id: str
    host: str
    state: NodeState
    slots: int
    slots_used: int
    failure_domain: str
    labels: dict[str, str]
    cordoned: bool
    heartbeat_age_s: float
    agent_pid: int
    cordoned_slots: dict[int, str] = dataclasses.field(default_factory=dict)
    gpus: tuple[GpuInfo, ...] = ()

    @property
    def schedulable_slots(self) -> int:
        """Free slots new work may use: none on a lost or cordoned node, and never a
        cordoned slot."""
        if self.state is not NodeState.ALIVE or self.cordoned:
            return 0
        return max(0, self.slots - len(self.cordoned_slots) - self.slots_used)


@dataclasses.dataclass(frozen=True)
class Heard:
    """A node's newest heartbeat as a reader following the registry has it: the agent's
    stamp, and when the reader first read it, by its own clock."""

    stamp: float
    at: float


def heard(known: Heard | None, record: NodeRecord, now: float) -> Heard:
    """``record`` read at ``now``: its heartbeat, timed by the first read that held it. A
    record rewritten with the same stamp (a cordon, a resync) times nothing."""
    if known is not None and known.stamp == record.heartbeat_at:
        return known
    return Heard(record.heartbeat_at, now)


def view(record: NodeRecord, now: float, lost_after_s: float = DEFAULT_LOST_AFTER_S, *,
         watching_since: float = float("-inf"), heard_at: float | None = None) -> NodeView:
    """How ``record`` looks at time ``now`` to a reader watching since ``watching_since``
    that read its heartbeat at ``heard_at`` by its own clock (None: the agent's stamp,
    which holds only while the two clocks agree)."""
    heard = record.heartbeat_at if heard_at is None else heard_at
    age = max(0.0, now - heard)
    silence = now - max(heard, watching_since)
    node = record.node
    return NodeView(
        node_id=node.node_id, host=node.host,
        state=NodeState.ALIVE if silence <= lost_after_s else NodeState.LOST,
        slots=node.slots, slots_used=record.slots_used, failure_domain=node.failure_domain,
        labels=dict(node.labels), cordoned=record.cordoned, heartbeat_age_s=age,
        agent_pid=node.agent_pid, cordoned_slots=dict(record.cordoned_slots),
        gpus=tuple(node.gpus),
    )


def mass_silence(heard_at: Iterable[float], at: float, timeout_s: float) -> bool:
    """Whether the nodes not judged lost (by when each was last heard, or judged as
    heard), at least two of them, are all silent at ``at``: none heard within half of
    ``timeout_s`` before it. A lone node's silence is its own."""
    heard = list(heard_at)
    return len(heard) >= 2 and all(at - when > timeout_s / 2 for when in heard)


def views(records: Iterable[NodeRecord], now: float,
          lost_after_s: float = DEFAULT_LOST_AFTER_S) -> list[NodeView]:
    """Every record's view, ordered by node id."""
    return sorted((view(r, now, lost_after_s) for r in records), key=lambda v: v.node_id)

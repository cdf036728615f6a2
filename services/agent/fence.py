"""The fencing rule of a node cut from the bus. Pure.

A node the control plane cannot hear is judged lost after the node timeout
(``lost_after_s``), and its ranks hung after their job's hang timeout; their jobs then
go on without them: the members elsewhere leave their generation, replacements start.
The ranks themselves hear nothing of it: cut from the bus, they may still reach each
other and train on in the generation the job left, a second line of the same job
writing snapshots and durable steps of its own (seen in issue 53: a node cut for 20 s
idled unfenced until the heal).

So the agent fences its own node: each heartbeat interval it makes a round trip with
the bus (a PING the server answers; not counted from a server found cut from its NATS
cluster's majority, which still answers: :mod:`phalanx.bus.majority`), and once no
round trip has succeeded for ``fence_after_s`` (the node timeout by default) it
SIGKILLs every rank it runs, with no grace period, and reports each lost (its job still
wants it: health counts it an infrastructure fault). Measured from the cut, every rank
is dead within ``fence_after_s`` plus two heartbeat intervals (:func:`bound_s`): the last round trip
confirmed may have been sent up to one interval before the cut, and a round trip waits
at most one interval for its answer. The node's agent keeps running and heartbeating;
when the link heals, the node is new capacity, and nothing of the old generation comes
back (its ranks are gone).

The rule cannot tell a node cut off from a bus that is down for everyone: a bus
outage longer than ``fence_after_s`` stops every rank of every node too, and the jobs
resume from their snapshots once the bus is back, where without the rule they would
have trained on through it. Shorter outages (a nats-server restarted in about a second,
a NATS cluster's failover, which reconnects to another server) stop nothing.
``fence_after_s`` 0 turns the rule off.
"""

from __future__ import annotations

import dataclasses


def bound_s(fence_after_s: float, heartbeat_interval_s: float) -> float:
    """The longest a rank of a node cut from the bus runs on after the cut."""
    return fence_after_s + 2 * heartbeat_interval_s


@dataclasses.dataclass(frozen=True)
class Fence:
    """Stop every rank: the bus has not answered for ``unconfirmed_s``."""

    unconfirmed_s: float
    fence_after_s: float

    @property
    def message(self) -> str:
        return (f"no round trip with the bus for {self.unconfirmed_s:.1f} s (fence_after_s "
                f"{self.fence_after_s:g}): stopping every rank of this node")


@dataclasses.dataclass
class BusWatch:
    """When the bus last answered this agent, and whether its ranks were fenced since.

    Times are one monotonic clock's (the agent's); no other clock is compared.
    """

    fence_after_s: float
    confirmed_at: float
    fenced: bool = False

    def confirmed(self, sent_at: float) -> None:
        """A round trip sent at ``sent_at`` was answered: the bus heard the node then."""
        self.confirmed_at = max(self.confirmed_at, sent_at)
        self.fenced = False

    def verdict(self, now: float, ranks: int) -> Fence | None:
        """At ``now``, with ``ranks`` ranks running here: fence them (once an outage),
        or None."""
        unconfirmed = now - self.confirmed_at
        if self.fence_after_s <= 0 or self.fenced or ranks == 0 \
                or unconfirmed < self.fence_after_s:
            return None
        self.fenced = True
        return Fence(unconfirmed, self.fence_after_s)

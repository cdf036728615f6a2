"""The agent's registration rules, pure.

An agent may take a node id when no record holds it, when the record is its
own (same host and pid: a re-registration), when the holder is lost (its
heartbeat is older than ``lost_after_s``), or when the holder ran on the same
host and its process is gone: a restarted agent takes its node back at once.
Two live agents never share an id. Each heartbeat bumps the sequence and time
and keeps what others set on the record (``cordoned``).
"""

from __future__ import annotations

from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import NodeInfo, NodeRecord
from phalanx.services.registry.core import NodeState, view


class NodeIdTaken(PhalanxError, RuntimeError):
    """Another live agent holds this node id."""


def register(existing: NodeRecord | None, info: NodeInfo, now: float,
             lost_after_s: float, *, holder_dead: bool = False) -> NodeRecord:
    """The record to store when ``info``'s agent registers at ``now``.

    Args:
        holder_dead: the holder ran on this host and its process is gone (the caller
            checked), so a restarted agent takes its node back at once.

    Raises:
        NodeIdTaken: a different agent holds the id and is alive.
    """
    if existing is not None:
        held = existing.node
        same_agent = held.host == info.host and held.agent_pid == info.agent_pid
        if (not same_agent and not (holder_dead and held.host == info.host)
                and view(existing, now, lost_after_s).state is NodeState.ALIVE):
            age = max(0.0, now - existing.heartbeat_at)
            raise NodeIdTaken(
                f"node id {info.node_id!r} is held by a live agent (pid {held.agent_pid} on "
                f"{held.host}, last heartbeat {age:.1f} s ago); pick another --node-id"
            )
    cordoned = existing.cordoned if existing is not None else False
    return NodeRecord(node=info, heartbeat_seq=0, heartbeat_at=now, cordoned=cordoned)


def heartbeat(record: NodeRecord | None, info: NodeInfo, now: float,
              slots_used: int = 0) -> NodeRecord:
    """``record`` after a heartbeat at ``now`` (re-created if someone removed it).

    Raises:
        NodeIdTaken: another agent registered this id meanwhile (this one was
            taken for lost); the agent must stop rather than fight over the id.
    """
    if record is None:
        return NodeRecord(node=info, heartbeat_at=now, slots_used=slots_used)
    if record.node.host != info.host or record.node.agent_pid != info.agent_pid:
        raise NodeIdTaken(
            f"node id {info.node_id!r} was taken over by pid {record.node.agent_pid} on "
            f"{record.node.host} while this agent's heartbeats were late"
        )
    return NodeRecord(node=info, heartbeat_seq=record.heartbeat_seq + 1, heartbeat_at=now,
                      slots_used=slots_used, cordoned=record.cordoned)

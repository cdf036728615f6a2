"""The agent's shell: registry entry, heartbeats and the status endpoint over NATS."""

from __future__ import annotations

import logging
import os
import socket
import time

from phalanx.bus.client import Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import Conflict
from phalanx.bus.kv import TypedKV
from phalanx.schemas import __version__, subjects
from phalanx.schemas.messages import NodeHeartbeat, NodeInfo, NodeRecord, NodeStatusRequest
from phalanx.services.agent import core
from phalanx.services.agent.config import AgentConfig
from phalanx.services.base import Service

log = logging.getLogger("phalanx.agent")


class AgentService(Service):
    """One per machine: keeps its node registered and alive in the registry."""

    description = "phalanx node agent"

    def __init__(self, config: AgentConfig, bus_config: BusConfig | None = None) -> None:
        super().__init__("phalanx-agent", config.node_id, bus_config,
                         shutdown_timeout_s=config.shutdown_timeout_s)
        self.config = config
        self.info = NodeInfo(
            node_id=config.node_id, host=socket.gethostname(), slots=config.slots,
            failure_domain=config.failure_domain, labels=config.labels,
            agent_pid=os.getpid(), agent_version=__version__, started_at=time.time(),
        )
        self.nodes: TypedKV[NodeRecord] | None = None
        self.record: NodeRecord | None = None
        self.revision = 0

    async def setup(self) -> None:
        assert self.bus is not None
        self.nodes = await TypedKV.open(self.bus.js, subjects.NODES_BUCKET, NodeRecord)
        entry = await self.nodes.modify(
            self.config.node_id,
            lambda existing: core.register(existing, self.info, time.time(),
                                           self.config.lost_after_s))
        self.record, self.revision = entry.value, entry.revision
        await self.add_endpoint("status", subjects.agent_status(self.config.node_id),
                                NodeStatusRequest, self.on_status)
        self.spawn(self.heartbeat_loop(), "heartbeat")
        log.info("registered", extra={"node": self.config.node_id, "slots": self.config.slots,
                                      "failure_domain": self.config.failure_domain})

    async def on_status(self, request: NodeStatusRequest, delivery: Delivery) -> NodeRecord:
        assert self.record is not None
        return self.record

    async def heartbeat_loop(self) -> None:
        """Refresh the registry entry and publish a heartbeat every interval.

        A bus outage is logged and retried at the next beat; losing the node id
        to another agent stops this one.
        """
        assert self.bus is not None and self.nodes is not None
        subject = subjects.node_heartbeat(self.config.node_id)
        while not await self.sleep_or_stop(self.config.heartbeat_interval_s):
            now = time.time()
            try:
                entry = await self.nodes.modify(
                    self.config.node_id,
                    lambda record, now=now: core.heartbeat(record, self.info, now))
                self.record, self.revision = entry.value, entry.revision
                await self.bus.publish(subject, NodeHeartbeat(
                    node_id=self.config.node_id, seq=entry.value.heartbeat_seq, sent_at=now,
                    slots_used=entry.value.slots_used))
            except core.NodeIdTaken:
                raise
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    async def teardown(self) -> None:
        """Deregister: a cleanly stopped node leaves the registry at once.

        The delete is conditional on our last revision, so an agent that lost
        its id to another never removes the other's entry.
        """
        if self.nodes is None or self.record is None:
            return
        try:
            await self.nodes.delete(self.config.node_id, revision=self.revision)
        except Conflict:
            log.warning("not deregistering: the entry is no longer ours")
            return
        log.info("deregistered", extra={"node": self.config.node_id})

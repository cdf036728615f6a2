"""The job-events stream: the events that drive decisions, kept so none is missed.

A plain NATS publish reaches only the subscribers connected at that moment. Rank
starts and exits, faults, readiness and applied generations drive health's and
elasticity's decisions, so the JetStream stream ``PHALANX_JOB_EVENTS`` keeps them.
Publishers go on publishing plainly: a stream stores every core publish on its
subjects, and nats-py buffers publishes while it reconnects, so a short bus
outage loses nothing either.

A service reads the stream from a *cursor*, the sequence after the last event it
has acted on, which it stores with the state that event produced. A new leader,
or the same service restarted, reads on from its predecessor's cursor: every
event is acted on at least once, and the cores make acting twice harmless
(events carry ids; a replayed decision is idempotent where it lands).

:class:`EventReader` delivers events in stream order with their sequence, skips
any sequence it has already delivered, and after a reconnection starts a new
consumer at the sequence after the last one it delivered (the old consumer may
not have survived a server restart). Progress ticks and heartbeats are not in
the stream: losing one is harmless, and they are most of the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors as jse
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from phalanx.bus.client import Bus, Delivery, replicas_for, subscribed
from phalanx.bus.failover import through_failover
from phalanx.bus.tasks import raise_if_cancelled
from phalanx.schemas import subjects
from phalanx.schemas.codec import decode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import (
    Fault,
    GenerationApplied,
    GenerationGivenUp,
    RankExited,
    RankStarted,
    ReplicaReady,
)

log = logging.getLogger("phalanx.bus.stream")

JOB_EVENTS = subjects.JOB_EVENTS_STREAM
#: A message the stream keeps: each is about one job (its ``job_id``).
JobEvent = (RankStarted | RankExited | Fault | ReplicaReady | GenerationApplied
            | GenerationGivenUp)
#: The job event kinds the stream keeps, and the message each carries.
KINDS: dict[str, type[JobEvent]] = {
    "started": RankStarted, "exited": RankExited, "fault": Fault, "ready": ReplicaReady,
    "applied": GenerationApplied, "given_up": GenerationGivenUp,
}
MAX_AGE_S = 7 * 24 * 3600.0
MAX_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """One stored job event: its stream sequence, kind and decoded message."""

    seq: int
    kind: str
    message: JobEvent
    delivery: Delivery
    stored_at: float = 0.0  # Unix time the stream stored it (0: not known)


async def ensure_job_events(bus: Bus) -> None:
    """Create the stream if it does not exist yet (idempotent; any service may call it),
    with as many replicas as the bus is configured for. A stream made by a build that
    knew fewer kinds is given the missing subjects: an event no stream keeps would be
    retried by its publisher for ever, and lost to a leader that reads the stream."""
    wanted = [subjects.job_events(kind) for kind in KINDS]
    config = StreamConfig(
        name=JOB_EVENTS, subjects=wanted,
        storage=StorageType.FILE, max_age=MAX_AGE_S, max_bytes=MAX_BYTES,
        discard=DiscardPolicy.OLD, num_replicas=replicas_for(bus.js))

    async def ensure() -> None:
        try:
            info = await bus.js.stream_info(JOB_EVENTS)
            have = list(info.config.subjects or [])
            if not set(wanted) <= set(have):
                await bus.js.update_stream(dataclasses.replace(
                    info.config, subjects=have + [x for x in wanted if x not in have]))
        except jse.NotFoundError:
            try:
                await bus.js.add_stream(config)
            except jse.BadRequestError as exc:  # created by another service meanwhile
                if exc.err_code != 10058:  # "stream name already in use"
                    raise

    # Through a JetStream leader election (a NATS cluster starting): an agent that gave up
    # after one request's timeout failed its start ("nats: timeout").
    await through_failover(ensure, f"stream {JOB_EVENTS}")


async def last_seq(bus: Bus) -> int:
    """The stream's last sequence now (0 when empty): a fresh reader's cursor."""
    info = await through_failover(lambda: bus.js.stream_info(JOB_EVENTS),
                                  f"stream {JOB_EVENTS}")
    return info.state.last_seq


class EventReader:
    """Job events of some kinds, in stream order, from sequence ``start`` on.

    Use as an async iterator; :meth:`close` ends it. Undecodable stored messages
    are counted as bad messages on the bus and skipped.
    """

    def __init__(self, bus: Bus, start: int, kinds: frozenset[str] | None = None) -> None:
        if start < 1:
            raise ValueError(f"a stream sequence starts at 1, got {start}")
        self.bus = bus
        self.kinds = frozenset(KINDS) if kinds is None else kinds
        unknown = self.kinds - set(KINDS)
        if unknown:
            raise ValueError(f"not job event kinds the stream keeps: {sorted(unknown)}")
        self.delivered = start - 1  # the last sequence handed out
        self._queue: asyncio.Queue[Msg | None] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._closed = False
        self._resubscribing = asyncio.Lock()  # one new consumer at a time
        bus.on_reconnect(self._resubscribe)

    async def start(self) -> EventReader:
        await through_failover(self._subscribe, f"stream {JOB_EVENTS} consumer")
        return self

    async def _subscribe(self) -> None:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=self.delivered + 1)
        self._sub = await subscribed(self.bus.js.subscribe(
            subjects.jobs_all(), stream=JOB_EVENTS, ordered_consumer=True,
            idle_heartbeat=1.0, config=config, cb=self._queue.put),
            lambda subscription: subscription.unsubscribe())  # a JetStream one's own

    async def _resubscribe(self) -> None:
        """After a reconnection: a new consumer from the sequence after the last one
        delivered, retried until the server makes one. A JetStream cluster electing a
        leader answers with timeouts for seconds, and a reader left without a consumer
        reads nothing more: health then never saw a rank's exit again (the NATS-cluster
        e2e test's job trained to its last step and was never finished)."""
        async with self._resubscribing:
            delay = 0.1
            while not self._closed:
                await self._drop()
                try:
                    await self._subscribe()
                    return
                except (nats.errors.Error, TimeoutError) as exc:
                    log.warning("no job-events consumer yet (%s); retrying in %.1f s", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 2.0)

    async def _drop(self) -> None:
        old, self._sub = self._sub, None
        if old is not None:
            with contextlib.suppress(nats.errors.Error, TimeoutError):  # already forgotten
                await old.unsubscribe()

    async def close(self) -> None:
        """Stop reading (idempotent); the iterator ends."""
        if self._closed:
            return
        self._closed = True
        await self._drop()
        self._queue.put_nowait(None)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[StreamEvent]:
        while (msg := await self._queue.get()) is not None:
            raise_if_cancelled()
            seq = msg.metadata.sequence.stream
            if seq <= self.delivered:
                continue  # a consumer started again delivered it twice
            self.delivered = seq
            kind = msg.subject.rsplit(".", 1)[-1]
            if kind not in self.kinds:
                continue
            try:
                message = decode(msg.data, KINDS[kind], subject=msg.subject)
            except (WireError, KeyError) as exc:
                self.bus.counters.bad_message(str(exc))
                log.warning("skipping a stored job event: %s", exc)
                continue
            yield StreamEvent(seq, kind, message,
                              Delivery(msg.subject, dict(msg.headers or {}), ""),
                              msg.metadata.timestamp.timestamp())

"""Calls to JetStream retried while it cannot answer: a stream's leader election.

On a NATS cluster a bucket or stream is a replicated stream with a leader. When the
server that leads it dies, JetStream cannot answer for it until the survivors have
elected another (4-9 s measured on nats-server 2.15), and a client whose server died
needs a moment to reconnect to another. :func:`through_failover` retries what fails
for want of an answer (a timeout, "no response from stream", 503, no responders) until
its time has passed, and then raises the last error: a caller sees the election as a
slow call, not as a failure. The KV layer (:mod:`.kv`) and the chunks of large values
(:mod:`.spill`) call the bus through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors as jse

from phalanx.bus.tasks import raise_if_cancelled

T = TypeVar("T")
log = logging.getLogger("phalanx.bus.kv")

#: How long a call keeps retrying while JetStream cannot answer for a bucket (a leader
#: election takes 4-9 s); the last attempt may add its own timeout (5 s) to this.
FAILOVER_S = 15.0
_RETRY_S = 0.2
# Failures that mean "nobody answered for the bucket yet", not "the answer is no".
_UNANSWERED = (TimeoutError, nats.errors.NoRespondersError, jse.NoStreamResponseError,
               jse.ServiceUnavailableError)


async def through_failover(call: Callable[[], Awaitable[T]], what: str,
                           failover_s: float = FAILOVER_S) -> T:
    """``await call()``, retried every 0.2 s while it fails unanswered (see the module
    docstring) until ``failover_s`` has passed; then the last error is raised."""
    deadline = time.monotonic() + failover_s
    while True:
        try:
            result = await call()
            raise_if_cancelled()
            return result
        except _UNANSWERED as exc:
            raise_if_cancelled()
            if time.monotonic() >= deadline:
                raise
            log.debug("%s unanswered (%r); retrying", what, exc)
        await asyncio.sleep(_RETRY_S)

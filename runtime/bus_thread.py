"""A bus client on a background thread, for synchronous training loops.

A training loop is synchronous; the bus client is asyncio. :class:`BusThread`
runs its own event loop on a daemon thread and connects there. Publishing
only hands a message to that loop, so it never blocks a step; if the bus is
unreachable, progress reports are dropped and counted while the client
reconnects (forever), and training goes on, while events that drive decisions
(readiness, an applied generation) are retried until a stream stores them.
Subscriptions call back on the bus thread: callbacks must only record what
arrived (set an event, store a value).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import Message

log = logging.getLogger("phalanx.runtime.bus")
M = TypeVar("M", bound=Message)
T = TypeVar("T")
#: How often a caller waiting on :meth:`BusThread.request` is called back.
POLL_S = 0.1


class BusThread:
    """One bus connection on its own thread.

    Args:
        bus_config: where the bus is.
        name: the connection's name (shows in the server's connection list).
        connect_timeout_s: how long :meth:`start` waits for the first connection.
    """

    def __init__(self, bus_config: BusConfig, name: str, *,
                 connect_timeout_s: float = 10.0) -> None:
        self.bus_config = bus_config
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.dropped = 0
        self.bus: Bus | None = None
        self._loop = asyncio.new_event_loop()
        # The sends in flight. The loop keeps only a weak reference to a task, so one that
        # nothing else holds may be collected before it ends; touched on the bus thread only.
        self._sending: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"phalanx-{name}",
                                        daemon=True)

    def start(self) -> BusThread:
        """Start the thread and connect.

        Raises:
            BusUnavailable: no connection within ``connect_timeout_s``.
        """
        self._thread.start()
        self.bus = self.run(Bus.connect(self.bus_config, name=self.name),
                            self.connect_timeout_s + 1)
        return self

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coroutine`` on the bus thread and wait for its result (blocks the caller)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def request(self, subject: str, message: Message, reply_type: type[M], timeout_s: float,
                waiting: Callable[[], None]) -> M:
        """:meth:`Bus.request` from the caller's thread, calling ``waiting`` every
        :data:`POLL_S` until the reply (a rank heartbeats meanwhile: it is not hung).

        Raises:
            PhalanxError: as :meth:`Bus.request` (no reply in ``timeout_s``: RequestTimeout).
        """
        assert self.bus is not None
        future = asyncio.run_coroutine_threadsafe(
            self.bus.request(subject, message, reply_type, timeout_s=timeout_s), self._loop)
        while True:
            try:
                return future.result(POLL_S)
            except concurrent.futures.TimeoutError:
                waiting()

    def publish(self, subject: str, message: Message) -> None:
        """Publish without waiting; a failure is counted in :attr:`dropped`, never raised."""
        async def send() -> None:
            assert self.bus is not None
            try:
                await self.bus.publish(subject, message)
            except (PhalanxError, OSError, TimeoutError) as exc:
                self.dropped += 1
                log.debug("dropped a message on %s: %s", subject, exc)

        self._send(send())

    def publish_event(self, subject: str, message: Message, event_id: str) -> None:
        """Publish an event that drives decisions, without waiting: it is retried on the
        bus thread until a stream has stored it (:meth:`Bus.publish_event`), so a bus
        outage delays it but does not lose it (unless this process ends, or
        :meth:`close` is called, first)."""
        async def send() -> None:
            assert self.bus is not None
            await self.bus.publish_event(subject, message, event_id=event_id)

        self._send(send())

    def _send(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Start ``coroutine`` on the bus thread without waiting for it; it is held in
        :attr:`_sending` until it ends, and an error it ends with is logged."""
        def start() -> None:
            task = self._loop.create_task(coroutine)
            self._sending.add(task)
            task.add_done_callback(self._sent)

        self._loop.call_soon_threadsafe(start)

    async def _abandon(self) -> None:
        """Cancel the sends still in flight once the bus is closed, and wait for them to
        end: an event no stream has stored yet is lost, as it is when the process ends."""
        for task in self._sending:
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("a message for the bus was not sent: %r", exc)

    def subscribe(self, subject: str, message_type: type[M],
                  callback: Callable[[M, Delivery], None]) -> None:
        """Call ``callback`` (on the bus thread) for each valid message on ``subject``."""
        async def handler(message: M, delivery: Delivery) -> None:
            callback(message, delivery)

        assert self.bus is not None
        self.run(self.bus.subscribe(subject, message_type, handler), self.connect_timeout_s)

    def close(self) -> None:
        """Flush, disconnect and stop the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        if self.bus is not None:
            try:
                self.run(self.bus.close(), 5)
            except (PhalanxError, OSError, TimeoutError) as exc:
                log.debug("closing the bus: %s", exc)
        try:
            self.run(self._abandon(), 5)
        except TimeoutError:
            log.debug("sends still running as the bus thread stops")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

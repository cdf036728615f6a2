"""The NATS client every phalanx process uses: typed, traced, never killed by input.

:class:`Bus` wraps one ``nats.aio.client.Client``. Outgoing messages are
encoded with the wire codec and carry W3C trace context in their headers;
incoming ones are decoded and validated before a handler sees them. A payload
that does not decode is a *bad message*: it is counted, logged and, if it was
a request, answered with a ``400`` service error; a handler that raises is
counted and answered with ``500``. Neither ever reaches the subscription's
task, so one bad peer cannot take a service down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from phalanx.bus import spill, telemetry
from phalanx.bus.config import BusConfig
from phalanx.bus.errors import (
    BusUnavailable,
    NoResponders,
    PermissionDenied,
    RemoteError,
    RequestRefused,
    RequestTimeout,
)
from phalanx.bus.majority import Majority
from phalanx.bus.tasks import raise_if_cancelled, within
from phalanx.schemas import settings
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES, decode, encode
from phalanx.schemas.errors import WireError
from phalanx.schemas.messages import MAX_SPILLED_BYTES, Message

log = logging.getLogger("phalanx.bus")

M = TypeVar("M", bound=Message)
S = TypeVar("S")  # a subscription of some kind (core, JetStream, KV watcher)
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"
DEFAULT_REQUEST_TIMEOUT_S = 2.0
#: How long a round trip's PING waits for its PONG in the background (see
#: :meth:`Bus.round_trip`): a reconnection drops its PONG for good, and only then does
#: this wait end by the deadline.
_PONG_WAIT_S = 600
#: How long a close waits for its drain: nats-py's drain gives the subscriptions' callbacks
#: 30 s to finish, then flushes for up to 10 s.
_DRAIN_WAIT_S = 45.0
#: How long a close whose drain failed waits for nats-py to close the connection.
_CLOSE_WAIT_S = 5.0
# How nats-server words a refused publish or subscription (sent as -ERR, connection kept).
_DENIAL = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"',
                     re.IGNORECASE)


async def subscribed(subscribe: Awaitable[S], unsubscribe: Callable[[S], Awaitable[Any]]) -> S:
    """``await subscribe``; if the task is cancelled meanwhile, the subscription is still
    made whole and then undone by ``unsubscribe``, and the cancellation raised.

    nats-py cannot be cancelled halfway through a subscription: a KV watch or
    JetStream subscription cancelled after its core subscription was made but before
    its consumer answered left that subscription behind (and the server's consumer),
    and one whose consumer request swallowed the cancellation
    (:func:`raise_if_cancelled`) went on waiting for changes, while whoever cancelled
    it (a generator closed, a service stopping) waited forever: a ``TypedKV.follow``
    whose close never returned, in CI. So nats-py's part runs in a task of its own
    that is never cancelled; it ends within nats-py's request timeouts.
    """
    making = asyncio.ensure_future(subscribe)
    try:
        return await asyncio.shield(making)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # it failed, or the connection is gone
            await unsubscribe(await making)
        raise


@dataclasses.dataclass(frozen=True)
class Delivery:
    """Where a handled message came from."""

    subject: str
    headers: dict[str, str]
    reply: str


Handler = Callable[[M, Delivery], Awaitable[Message | None]]


class Failed(Exception):
    """Raised by :func:`process`: answer the request with service error ``code``.

    400 for a payload that does not decode, 500 for a handler that raised, or
    the code of a :class:`~phalanx.bus.errors.RequestRefused` the handler raised.
    """

    def __init__(self, code: str, description: str) -> None:
        self.code = code
        self.description = description[:1024]
        super().__init__(f"{code}: {description}")


@dataclasses.dataclass
class Counters:
    """What went wrong on this connection (endpoint, bucket), for logs and ``$SRV.STATS``.

    Each count is also added to :data:`TOTALS`, the whole process's, which its metrics
    export (``phalanx.services.metrics``).
    """

    bad_messages: int = 0
    handler_errors: int = 0
    last_error: str = ""
    denials: int = 0
    """Publishes and subscriptions the server refused this identity (permissions)."""

    def bad_message(self, error: str) -> None:
        """A delivery or stored value that did not decode."""
        self.bad_messages += 1
        self.last_error = error
        if self is not TOTALS:
            TOTALS.bad_message(error)

    def handler_error(self, error: str) -> None:
        """A handler that raised."""
        self.handler_errors += 1
        self.last_error = error
        if self is not TOTALS:
            TOTALS.handler_error(error)

    def denial(self, error: str) -> None:
        """A publish or subscription the server refused."""
        self.denials += 1
        self.last_error = error
        if self is not TOTALS:
            TOTALS.denial(error)


#: Every count of this process's connections, endpoints and buckets together.
TOTALS = Counters()


async def process(delivery: Delivery, data: bytes, message_type: type[M], handler: Handler[M],
                  counters: Counters, queue: str | None = None, *,
                  limit: int = MAX_PAYLOAD_BYTES) -> Message | None:
    """Decode ``data`` (at most ``limit`` bytes: more for a value put together from its
    chunks), run ``handler`` inside a consumer span, and return its reply.

    Raises:
        Failed: the payload was bad, the handler refused or raised (already counted).
    """
    subject = delivery.subject
    with telemetry.consumer_span(subject, delivery.headers, len(data), queue) as span:
        try:
            message = decode(data, message_type, subject=subject, limit=limit)
        except WireError as exc:
            counters.bad_message(str(exc))
            span.record_exception(exc)
            log.warning("bad message dropped: %s", exc)
            raise Failed("400", str(exc)) from None
        try:
            return await handler(message, delivery)
        except asyncio.CancelledError:
            raise
        except RequestRefused as exc:
            span.record_exception(exc)
            raise Failed(exc.code, exc.description) from None
        except Exception as exc:
            counters.handler_error(f"{type(exc).__name__}: {exc}")
            span.record_exception(exc)
            log.exception("handler for %s failed", subject)
            raise Failed("500", counters.last_error) from exc


class JetStream(JetStreamContext):
    """The JetStream context of a :class:`Bus`: nats-py's, plus how many replicas the
    buckets and streams created through it get (``BusConfig.jetstream_replicas``), so
    code that is handed only the context creates them like the rest of phalanx."""

    def __init__(self, nc: Client, replicas: int) -> None:
        super().__init__(nc)
        self.replicas = replicas


def replicas_for(js: JetStreamContext) -> int:
    """How many replicas a bucket or stream created through ``js`` gets: the configured
    count for a :class:`Bus`'s context, 1 for a bare nats-py one. Every place that creates
    a stream or bucket passes this (``num_replicas`` / ``replicas``)."""
    return js.replicas if isinstance(js, JetStream) else 1


def _quiet_tls_close(record: logging.LogRecord) -> bool:
    """Drop asyncio's warning that nats-py's protocol asks to half-close a TLS connection
    (printed at every close of one, it says nothing to a user)."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()


class Bus:
    """A connected NATS client speaking phalanx's wire contract.

    Use :meth:`connect`; ``async with`` drains the connection on exit.
    """

    def __init__(self, nc: Client, config: BusConfig, majority: Majority) -> None:
        self.nc = nc
        self.config = config
        #: Whether the server answers for its cluster's majority; it moves this
        #: connection off one that does not (:mod:`.majority`).
        self.majority = majority
        self.counters = Counters()
        self.js = JetStream(nc, config.jetstream_replicas)
        self.connected_since: float | None = time.time()
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._resyncs: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()
        self._disconnects: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()
        self._refusal_waiters: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        self._round_trips: set[asyncio.Task[None]] = set()
        self.chunks = spill.ChunkStore(self.js, config.jetstream_replicas)

    @property
    def connected(self) -> bool:
        """Whether the connection is up now (False while reconnecting)."""
        return self.connected_since is not None

    @property
    def in_majority(self) -> bool:
        """False while this connection's server is found cut from its cluster's majority
        (:mod:`.majority`: it answers no probe while a majority of the servers answer
        through others), until the connection has moved. A leader acts, an agent counts
        its round trips, only while it holds."""
        return self.majority.in_majority

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Await ``callback`` after every reconnection (after nats-py re-subscribed).

        A process that judges others by their silence, or follows state through plain
        publishes, was blind while disconnected: this is where it resyncs and gives
        everyone a fresh grace period. A callback that raises is logged.
        """
        self._on_reconnect.append(callback)

    def resync_event(self) -> asyncio.Event:
        """A new event that every reconnection sets, e.g. for :meth:`TypedKV.follow`
        (which clears it when it starts over); one per follower."""
        event = asyncio.Event()
        self._resyncs.add(event)
        return event

    def _denied(self, error: str) -> None:
        """The server refused a publish or subscription: count it, say so, and set the
        futures waiting for that refusal (:meth:`refusal`)."""
        self.counters.denial(error)
        log.warning("the bus refused: %s", error)
        if (match := _DENIAL.search(error)) is not None:
            for waiter in self._refusal_waiters.get((match[1].lower(), match[2].lower()), ()):
                if not waiter.done():
                    waiter.set_result(None)

    @contextlib.contextmanager
    def refusal(self, subject: str, what: str = "publish") -> Iterator[asyncio.Future[None]]:
        """A future that is set if the server refuses this identity ``what`` (``publish``
        or ``subscription``) on ``subject`` while the block runs.

        The server reports a refusal asynchronously (an ``-ERR``, possibly after later
        replies), so this is how to learn of one for sure.
        """
        # nats-py lowercases the server's error, subject included.
        key = (what, subject.lower())
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._refusal_waiters.setdefault(key, set())
        waiters.add(refused)
        try:
            yield refused
        finally:
            waiters.discard(refused)
            if not waiters:
                self._refusal_waiters.pop(key, None)

    async def _unless_denied(self, request: Awaitable[Msg], subject: str) -> Msg:
        """Await ``request`` unless the server refuses the publish to ``subject`` first
        (it answers a refused request with an error, never a reply: without this, the
        caller would wait for its whole timeout, and retry).

        Raises:
            PermissionDenied: this identity may not publish to ``subject``.
        """
        with self.refusal(subject) as refused:
            task = asyncio.ensure_future(request)
            try:
                either: set[asyncio.Future[Any]] = {task, refused}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if task.done() and not task.cancelled():
            return task.result()
        raise PermissionDenied(subject)

    def disconnect_event(self) -> asyncio.Event:
        """A new event that every disconnection sets (the server closed the connection,
        or the network failed; nats-py then reconnects)."""
        event = asyncio.Event()
        self._disconnects.add(event)
        return event

    def _disconnected(self) -> None:
        self.connected_since = None
        for event in list(self._disconnects):
            event.set()

    async def _reconnected(self) -> None:
        self.connected_since = time.time()
        self.majority.connected()
        for event in list(self._resyncs):
            event.set()
        for callback in list(self._on_reconnect):
            try:
                await callback()
            except Exception:
                log.exception("a reconnect callback failed")

    @classmethod
    async def connect(cls, config: BusConfig | None = None, *, name: str = "phalanx") -> Bus:
        """Connect to the first reachable server of ``config``.

        Reconnects forever once connected; the *first* connection must succeed
        within ``config.connect_timeout_s``.

        Raises:
            BusUnavailable: no server answered in time; names the URLs and the last error.
        """
        config = config or BusConfig.load()
        last_error: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            if _DENIAL.search(str(exc)) is not None and bus:
                bus[0]._denied(str(exc))
                return
            last_error.append(exc)
            log.debug("nats error: %r", exc)

        bus: list[Bus] = []  # set once connected: the callbacks below only fire after that

        async def on_disconnect() -> None:
            for b in bus:
                b._disconnected()
            if not (nc.is_closed or nc.is_draining):
                log.warning("disconnected from NATS; reconnecting")

        async def on_reconnect() -> None:
            url = nc.connected_url
            log.info("reconnected to NATS at %s", url.netloc if url else "?")
            for b in bus:
                await b._reconnected()

        nc = Client()
        options: dict[str, Any] = dict(
            servers=list(config.servers), name=name,
            connect_timeout=max(1, int(config.connect_timeout_s)),
            reconnect_time_wait=config.reconnect_wait_s, max_reconnect_attempts=-1,
            user=config.user, password=config.password, token=config.token,
            user_credentials=config.creds_file, nkeys_seed=config.nkey_seed_file,
            inbox_prefix=config.inbox_prefix,
        )
        if config.uses_tls:
            logging.getLogger("asyncio").addFilter(_quiet_tls_close)
            context = ssl.create_default_context(cafile=config.tls_ca_file)
            if config.tls_cert_file:
                context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
            options["tls"] = context
        majority = Majority(options, config.reconnect_wait_s)
        try:
            await within(nc.connect(
                **options, error_cb=on_error, disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect, reconnect_to_server_handler=majority.choose),
                config.connect_timeout_s)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            with contextlib.suppress(TimeoutError):  # what is raised is the connect's
                await within(nc.close(), config.connect_timeout_s)
            cause = last_error[-1] if last_error else exc
            raise BusUnavailable(
                f"cannot reach NATS at {', '.join(config.servers)} within "
                f"{config.connect_timeout_s:g} s ({type(cause).__name__}: {cause}); "
                f"is `phalanx up` running, or is {settings.NATS_URL} set?"
            ) from None
        bus.append(cls(nc, config, majority))
        majority.start(nc)
        return bus[0]

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Drain subscriptions and close the connection (idempotent).

        Ends within :data:`_DRAIN_WAIT_S` + :data:`_CLOSE_WAIT_S` whatever the server does:
        nats-py flushes what is unsent before it closes, and against a server that stopped
        reading (hung, cut off) that flush waited for good.
        """
        self.majority.stop()
        if self.nc.is_closed:
            return
        try:
            await within(self._drain(), _DRAIN_WAIT_S)
        except (nats.errors.Error, TimeoutError, OSError):
            # The drain fails when the connection is down or the server stopped reading:
            # what is unsent cannot reach it, and waiting to send it would never end.
            self._drop_unsent()
            try:
                await within(self.nc.close(), _CLOSE_WAIT_S)
            except TimeoutError:
                log.warning("closing the NATS connection did not end within %g s",
                            _CLOSE_WAIT_S)
        for ping in self._round_trips:  # closed: no PONG can come and trip the read loop
            ping.cancel()

    async def _drain(self) -> None:
        # A subscription read with next_msg has no callback to take what is left in its
        # queue, and the drain waited its whole timeout (30 s) for it: dropped first.
        for sub in list(self.nc._subs.values()):
            if sub._cb is None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        await self.nc.drain()

    def _drop_unsent(self) -> None:
        """Forget what nats-py has not written yet and drop the socket under it."""
        self.nc._pending = []
        self.nc._pending_data_size = 0
        writer = getattr(self.nc._transport, "_io_writer", None)
        if writer is not None:
            writer.transport.abort()

    async def round_trip(self, timeout_s: float) -> bool:
        """Whether the server answered a PING within ``timeout_s``: then everything
        published here before has reached it, and everything it sent before is in the
        subscriptions' queues.

        Use this, never ``nc.flush``: a flush that times out (or whose caller is
        cancelled) cancels its PONG's future but leaves it queued in nats-py (2.16), and
        when the late PONG comes the read loop fails on it (``InvalidStateError``) and
        stops reading for good — the connection receives nothing until the ping timer
        calls it stale. Under load that is exactly when a flush times out: health went
        blind through a whole crash storm (bench/scale.py). So the PING's wait is never
        cancelled; it goes on in the background, and only this call gives up.
        """
        if self.nc.is_closed:
            return False
        # nats-py's own deadline only ends a wait whose PONG never comes (the connection
        # then fails anyway, which fails the future too).
        ping = asyncio.create_task(self.nc.flush(timeout=_PONG_WAIT_S))
        self._round_trips.add(ping)
        ping.add_done_callback(self._round_trip_done)
        done, _ = await asyncio.wait({ping}, timeout=timeout_s)
        return ping in done and not ping.cancelled() and ping.exception() is None

    def _round_trip_done(self, ping: asyncio.Task[None]) -> None:
        self._round_trips.discard(ping)
        if not ping.cancelled():
            ping.exception()  # retrieved: a failed PING is the caller's False, not a warning

    async def publish(self, subject: str, message: Message,
                      headers: dict[str, str] | None = None) -> None:
        """Publish ``message`` on ``subject`` with the current trace context.

        A value too large for one payload is published as the
        :class:`~phalanx.schemas.messages.Spilled` pointer under which it was stored
        (:meth:`~phalanx.bus.kv.TypedKV.pointer`); subscribers get the value itself.
        """
        data = encode(message)
        with telemetry.producer_span(subject, len(data)):
            await self.nc.publish(subject, data, headers=telemetry.inject(headers))
        raise_if_cancelled()

    async def publish_event(self, subject: str, message: Message, *, event_id: str,
                            retry_s: float = 0.2) -> int:
        """Publish an event that drives decisions and wait until a stream has stored it.

        A plain publish written just as the server dies is lost with the socket; this
        one is retried (every ``retry_s`` seconds, through any outage, until the
        caller is cancelled) until JetStream acknowledges it. ``event_id`` goes in
        the ``Nats-Msg-Id`` header, so a retry of a publish that was stored but whose
        acknowledgement was lost is not stored twice (within the stream's duplicate
        window, two minutes by default). Subscribers see it as a plain message.

        Returns:
            The stream sequence it was stored at.
        """
        data = encode(message)
        with telemetry.producer_span(subject, len(data)):
            headers = telemetry.inject({"Nats-Msg-Id": event_id})
            while True:
                try:
                    ack = await self.js.publish(subject, data, timeout=max(retry_s, 1.0),
                                                headers=headers)
                    raise_if_cancelled()
                    return ack.seq
                except (nats.errors.Error, TimeoutError, OSError) as exc:
                    raise_if_cancelled()
                    log.debug("event %s not stored yet (%r); retrying", event_id, exc)
                await asyncio.sleep(retry_s)

    async def request(self, subject: str, message: Message, reply_type: type[M], *,
                      timeout_s: float | None = None) -> M:
        """Send a request and decode its reply.

        Args:
            timeout_s: how long to wait; ``None`` means :data:`DEFAULT_REQUEST_TIMEOUT_S`.

        Raises:
            RequestTimeout: no reply within the timeout.
            NoResponders: nobody listens on ``subject``.
            PermissionDenied: the server refused this identity the publish to ``subject``.
            RemoteError: the responder answered with a service error.
            WireError: the reply is not a valid ``reply_type``.
        """
        timeout_s = DEFAULT_REQUEST_TIMEOUT_S if timeout_s is None else timeout_s
        data = encode(message)
        with telemetry.producer_span(subject, len(data), request=True):
            try:
                reply = await self._unless_denied(
                    self.nc.request(subject, data, timeout=timeout_s, headers=telemetry.inject()),
                    subject)
            except nats.errors.NoRespondersError:
                raise NoResponders(f"no service listens on {subject}") from None
            except nats.errors.TimeoutError:
                raise_if_cancelled()
                raise RequestTimeout(f"no reply on {subject} within {timeout_s:g} s") from None
        raise_if_cancelled()
        raise_for_error(reply, subject)
        return decode(reply.data, reply_type, subject=subject)

    async def subscribe(self, subject: str, message_type: type[M], handler: Handler[M], *,
                        queue: str | None = None, concurrent: bool = False) -> Subscription:
        """Run ``handler`` for each valid ``message_type`` on ``subject``.

        Messages are handled one after another unless ``concurrent``, which runs
        each in its own task (for handlers that wait on I/O, such as KV writes).

        A reply returned by the handler is sent if the message was a request.
        Bad payloads and handler failures are counted (:attr:`counters`) and,
        for requests, answered with a 400 / 500 service error (or the code of a
        :class:`~phalanx.bus.errors.RequestRefused` the handler raised).
        """
        async def on_message(msg: Msg) -> None:
            delivery = Delivery(msg.subject, dict(msg.headers or {}), msg.reply)
            try:
                data = await self._unspilled(msg.subject, msg.data)
            except WireError as exc:
                self.counters.bad_message(str(exc))
                log.warning("bad message dropped: %s", exc)
                await self._respond_error(msg, "400", str(exc))
                return
            if data is None:
                return
            try:
                reply = await process(delivery, data, message_type, handler, self.counters,
                                      queue, limit=MAX_SPILLED_BYTES)
            except Failed as exc:
                await self._respond_error(msg, exc.code, exc.description)
            else:
                if reply is not None and msg.reply:
                    await self.nc.publish(msg.reply, encode(reply), headers=telemetry.inject())

        running: set[asyncio.Task[None]] = set()

        async def spawn(msg: Msg) -> None:
            task = asyncio.create_task(on_message(msg))
            running.add(task)
            task.add_done_callback(running.discard)

        return await subscribed(
            self.nc.subscribe(subject, queue=queue or "", cb=spawn if concurrent else on_message),
            Subscription.unsubscribe)

    async def _unspilled(self, subject: str, data: bytes) -> bytes | None:
        """``data``, or, when it is a pointer to a value stored in chunks
        (:mod:`~phalanx.bus.spill`), that value's encoding; a value replaced since it was
        published is read as the key holds it now (None: the key is gone).

        Raises:
            WireError: a bad pointer, or chunks that do not make its value.
        """
        spilled = spill.pointer(data, subject=subject)
        if spilled is None:
            return data
        try:
            return await self.chunks.load(spilled)
        except spill.Superseded:
            return await self.chunks.current(spilled)

    async def _respond_error(self, msg: Msg, code: str, description: str) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, b"", headers={
                ERROR_CODE_HEADER: code, ERROR_HEADER: description})


def raise_for_error(reply: Msg, subject: str) -> None:
    """Raise :class:`RemoteError` if ``reply`` carries service error headers."""
    headers = reply.headers or {}
    if ERROR_CODE_HEADER in headers:
        raise RemoteError(headers[ERROR_CODE_HEADER], headers.get(ERROR_HEADER, ""), subject)

"""The shell every phalanx service runs in.

A :class:`Service` connects to the bus, registers with the NATS service API
(``$SRV.PING/INFO/STATS`` via ``nats.micro``), exposes typed request
endpoints, runs background tasks (a failed loop is started again, a failed one-off
task logged: only :class:`~phalanx.schemas.errors.MustStop` stops a service), and
shuts down in a fixed order on SIGTERM
or SIGINT: stop taking requests, give background loops ``shutdown_timeout_s``
to notice the stop and finish, cancel what is left, run
:meth:`Service.teardown` while still connected, drain the connection.
:meth:`Service.stop` is idempotent.

A request whose payload does not decode is answered ``400`` and counted as a
bad message; a handler that raises is answered ``500`` and counted. Both
counts appear in each endpoint's ``$SRV.STATS`` ``data``; the service keeps
running either way. Subclasses put I/O here and their rules in a pure core.
With ``PHALANX_METRICS_PORT`` set it serves ``/metrics`` (:mod:`phalanx.services.metrics`)
from before it connects until it has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import EndpointConfig, EndpointStats, ServiceConfig
from nats.micro.service import Service as MicroService

from phalanx.bus import telemetry
from phalanx.bus.client import Bus, Counters, Delivery, Failed, Handler, process
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import __version__
from phalanx.schemas.codec import encode
from phalanx.schemas.errors import MustStop
from phalanx.schemas.messages import Message
from phalanx.services import metrics
from phalanx.services.deadline import wait_set

log = logging.getLogger("phalanx.service")
M = TypeVar("M", bound=Message)
#: A failed background loop's back-off before it starts again: the first, the most, and
#: how long a run must last for the next failure to start from the first again.
RESTART_FIRST_S, RESTART_MAX_S, RESTART_RESET_S = 0.5, 30.0, 60.0
#: The collector's thresholds in a service process (Python's are 700, 10, 10). A full
#: collection holds every thread, the lease's renewal thread too (`lease.py`): with a
#: leader's 12,000 restored jobs they ran every second or so, for 0.1-0.8 s each (2.3 s
#: once), and deposed it. Collected 50,000 allocations apart, short-lived objects die
#: before they are promoted, and full collections are rare.
GC_THRESHOLDS = (50_000, 20, 20)


class Service:
    """Base of every phalanx service; subclass and override :meth:`setup`/:meth:`teardown`.

    Args:
        name: service name for ``$SRV`` (letters, digits, ``-``, ``_``).
        instance: what tells this instance apart in logs (node id, host).
        bus_config: how to reach NATS; ``None`` loads it from the environment.
        shutdown_timeout_s: how long background loops get to finish on stop.
    """

    description = "phalanx service"
    #: The metric families this service exports besides the bus's (registered at start).
    metric_families: metrics.Families = ()

    def __init__(self, name: str, instance: str, bus_config: BusConfig | None = None, *,
                 shutdown_timeout_s: float = 5.0) -> None:
        self.name = name
        self.instance = instance
        self.bus_config = bus_config
        self.shutdown_timeout_s = shutdown_timeout_s
        self.bus: Bus | None = None
        self.micro: MicroService | None = None
        self._counters: dict[str, Counters] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_requested = asyncio.Event()
        self._stopped = False
        self.metrics_server: WSGIServer | None = None

    # --- to override -------------------------------------------------------------------

    async def setup(self) -> None:
        """Add endpoints and start loops; runs once connected."""

    async def teardown(self) -> None:
        """Release what :meth:`setup` took; runs on stop after the loops ended, still connected."""

    # --- building blocks ----------------------------------------------------------------

    async def bucket(self, name: str, message_type: type[M]) -> TypedKV[M]:
        """The KV bucket ``name`` of ``message_type`` records, created if it does not exist."""
        assert self.bus is not None, "buckets are opened from setup()"
        return await TypedKV.open(self.bus.js, name, message_type)

    async def add_endpoint(self, name: str, subject: str, request_type: type[M],
                           handler: Handler[M], *, queue: str | None = None,
                           concurrent: bool = False) -> None:
        """Serve typed requests on ``subject`` as endpoint ``name`` of the NATS service API.

        Requests are handled one at a time unless ``concurrent``: then each runs in
        its own task, and failures are counted only in the endpoint's stats ``data``
        (``bad_messages``, ``handler_errors``), not in the API's ``num_errors``.
        """
        assert self.micro is not None, "add_endpoint is called from setup()"
        counters = self._counters.setdefault(name, Counters())

        async def on_request(request: Request) -> None:
            delivery = Delivery(request.subject, dict(request.headers or {}), "")
            try:
                reply = await process(delivery, request.data, request_type, handler, counters,
                                      queue)
            except Failed as exc:
                raise ServiceError(exc.code, exc.description) from None
            if reply is None:
                raise ServiceError("500", f"handler of {name} returned no reply")
            await request.respond(encode(reply), headers=telemetry.inject())

        async def in_task(request: Request) -> None:
            try:
                try:
                    await on_request(request)
                except ServiceError as exc:
                    await request.respond_error(exc.code, exc.description)
            except Exception as exc:  # e.g. the connection closed under us: never fatal
                log.warning("could not answer a %s request: %s", name, exc)

        async def spawn(request: Request) -> None:
            self.spawn(in_task(request), f"{name} request")

        await self.micro.add_endpoint(EndpointConfig(
            name=name, subject=subject, handler=spawn if concurrent else on_request,
            queue_group=queue or None))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a one-off task in the background. Its failure is logged and counted
        (``phalanx_task_failures{task}``, the first word of ``name``) and the service goes
        on, unless it is :class:`~phalanx.schemas.errors.MustStop`: that stops the service."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            failure = None if t.cancelled() else t.exception()
            if failure is not None:
                self._failed(name, failure)

        task.add_done_callback(done)
        return task

    def keep_running(self, loop: Callable[[], Coroutine[Any, Any, Any]],
                     name: str) -> asyncio.Task[Any]:
        """Run ``loop()`` in the background until the service stops, starting it again
        after a failure (logged and counted as in :meth:`spawn`) once a back-off has
        passed: 0.5 s, doubling to 30 s while it keeps failing within a minute of its
        start. A loop's bug or an outage it did not expect must not stop the service."""
        async def supervised() -> None:
            pause = RESTART_FIRST_S
            while not self.stopping:
                started = time.monotonic()
                try:
                    await loop()
                    return
                except Exception as exc:  # what the supervision is for
                    self._failed(name, exc)
                if time.monotonic() - started >= RESTART_RESET_S:
                    pause = RESTART_FIRST_S
                if await self.sleep_or_stop(pause):
                    return
                pause = min(2 * pause, RESTART_MAX_S)

        return self.spawn(supervised(), name)

    def _failed(self, name: str, exc: BaseException) -> None:
        if isinstance(exc, MustStop):
            log.error("%s: %s; stopping", name, exc)
            self.request_stop()
            return
        metrics.TASK_FAILURES.labels(name.split()[0]).inc()
        log.error("background task %s failed; the service goes on", name, exc_info=exc)

    def stats_data(self, endpoint: EndpointStats) -> dict[str, Any]:
        counters = self._counters.get(endpoint.name, Counters())
        return {"bad_messages": counters.bad_messages, "handler_errors": counters.handler_errors,
                "last_error": counters.last_error}

    # --- lifecycle ----------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def start(self) -> None:
        """Connect, register with the service API and run :meth:`setup`."""
        telemetry.setup_tracing(self.name)
        metrics.register((*metrics.BUS, *self.metric_families))
        self.metrics_server = metrics.serve()
        self.bus = await Bus.connect(self.bus_config, name=f"{self.name}:{self.instance}")
        self.bus.on_reconnect(_count_reconnect)
        bus = self.bus
        metrics.BUS_CONNECTED.set_function(lambda: float(bus.connected))
        self.micro = await add_service(self.bus.nc, ServiceConfig(
            name=self.name, version=__version__, description=self.description,
            metadata={"instance": self.instance}, stats_handler=self.stats_data))
        await self.setup()
        # Once start returns, the server holds every subscription made so far: a request
        # sent the next moment ($SRV.PING, an endpoint) finds its responder. (A test's
        # PING from another connection was refused as having no responders in CI.)
        if not await self.bus.round_trip(5.0):
            log.warning("the server did not confirm the service's subscriptions within 5 s")
        log.info("started", extra={"service_id": self.micro.id})

    async def stop(self) -> None:
        """Shut down in order (idempotent): endpoints, loops, teardown, connection."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        if self.micro is not None:
            await self.micro.stop()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.shutdown_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        try:
            await self.teardown()
        except Exception:
            log.exception("teardown failed")
        if self.bus is not None:
            await self.bus.close()
        telemetry.shutdown_tracing()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        log.info("stopped")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT or :meth:`request_stop`, then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            await self._stop_requested.wait()
        finally:
            await self.stop()

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    async def sleep_or_stop(self, seconds: float) -> bool:
        """Wait ``seconds`` unless a stop is requested first; returns True if stopping."""
        return await wait_set(self._stop_requested, seconds)

    async def until_stopped(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` until it ends or a stop is requested, which cancels it: for a loop
        that waits on the bus, where :meth:`stop` would otherwise wait out its timeout."""
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (task, stopped):
                waiting.cancel()
            await asyncio.wait({task, stopped})
        if not task.cancelled():
            task.result()  # its failure is the caller's


async def _count_reconnect() -> None:
    metrics.BUS_RECONNECTS.inc()


def run_service(service: Service) -> int:
    """Run ``service`` on uvloop (when available) until it is told to stop; exit code."""
    gc.freeze()  # what start-up made lives as long as the process: never scanned again
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(service.run())
    except Exception as exc:  # start-up failures: say what and exit non-zero
        log.error("%s failed: %s", service.name, exc)
        return 1
    return 0

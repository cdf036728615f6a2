"""The Prometheus metrics phalanx's services and agents export, and the endpoint serving them.

Every service process and node agent serves its metrics over HTTP in the Prometheus
exposition format (``prometheus_client``, the maintained reference library; nothing here
writes the format) when ``PHALANX_METRICS_PORT`` names a port: ``GET /metrics`` on
``PHALANX_METRICS_ADDR`` (default ``0.0.0.0``). Unset or empty, there is no endpoint; ``0``
takes any free port (the process logs which). ``phalanx up`` instead hands each process a
listening socket of its own (``PHALANX_METRICS_FD``, inherited, as systemd's socket
activation does): a port picked by number and bound later by the child could be taken in
between (by any outgoing connection's source port), and the child would fail at start; the
supervisor keeps the socket, so a restarted process serves on the same port again. The
ports are listed in ``up.json`` (``metrics``).

The metrics are defined here, once, and updated only in the service shells from what
their pure cores decided and what they sent (a core never imports this). They are defined
unregistered, in groups: :data:`BUS` (every process), :data:`LEADERSHIP` (every instance
of a leader service), :data:`ADMISSION`, :data:`HEALTH`, :data:`ELASTICITY`, :data:`AGENT`,
:data:`CALLOUT`.
A process exports the groups it registers (:func:`register`, which the service shell calls
at start with the service's ``metric_families``), so a scrape of the health service shows
faults and no admission queue, and an agent's shows its ranks and nothing of a leader. A
counter is
counted by the process that acted: the leader, so after a takeover the new leader's
counters start from zero, as Prometheus's ``rate()`` and ``increase()`` expect of a
restarted process. docs/observability.md lists them with their labels.

A job's series carry it as ``phalanx_job``, not ``job``: ``job`` is the label Prometheus
gives every target itself (the scrape job's name), and a target's own ``job`` label is
renamed ``exported_job`` on scrape, so a query for ``{job="..."}`` would find nothing.
The bus's failure counts (bad messages, failed handlers, refusals) are kept by the bus
layer, which knows nothing of Prometheus (:data:`phalanx.bus.client.TOTALS`), and read
as counters at each scrape.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import (
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from phalanx.bus.client import TOTALS
from phalanx.schemas import settings
from phalanx.schemas.errors import PhalanxError

log = logging.getLogger("phalanx.metrics")

PORT_ENV = settings.METRICS_PORT
ADDR_ENV = settings.METRICS_ADDR
FD_ENV = settings.METRICS_FD

#: Seconds, from a scheduling pass to a pause of several seconds.
_SHORT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Seconds a gang waits for admission: from at once to hours in a busy queue.
_QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)

# --- every process ---------------------------------------------------------------------------

BUS_RECONNECTS = Counter("phalanx_bus_reconnects", "Times the bus connection came back after a "
                         "loss", registry=None)
BUS_CONNECTED = Gauge("phalanx_bus_connected", "1 while this process is connected to the bus, "
                     "else 0", registry=None)
#: The label of a job's series (see above for why not ``job``).
JOB_LABEL = "phalanx_job"
#: A group of metric families that a process exports together.
Families = tuple[Collector, ...]


class _BusFailures(Collector):
    """The bus layer's failure counts of this process, as counters, read at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, text, value in (
                ("phalanx_bus_bad_messages", "Deliveries and stored values that did not "
                 "decode (dropped, or answered 400)", TOTALS.bad_messages),
                ("phalanx_bus_handler_errors", "Handlers of a delivery or request that "
                 "raised (answered 500)", TOTALS.handler_errors),
                ("phalanx_bus_denials", "Publishes and subscriptions the server refused this "
                 "identity", TOTALS.denials)):
            yield CounterMetricFamily(name, text, value=value)


#: Every process's families: the bus connection's.
TASK_FAILURES = Counter("phalanx_task_failures", "Background tasks of this process that failed "
                        "and went on or were started again, by task", ["task"], registry=None)
BUS: Families = (BUS_CONNECTED, BUS_RECONNECTS, _BusFailures(), TASK_FAILURES)

# --- every leader service (admission, health, elasticity, checkpoint) ------------------------

LEADER = Gauge("phalanx_leader", "1 while this instance holds its service's lease, else 0",
               ["service"], registry=None)
#: Every instance of a leader service: whether it leads.
LEADERSHIP: Families = (LEADER,)

#: Admission's and health's: whether a mass silence holds their judgement of the nodes.
MASS_SILENCE = Gauge("phalanx_mass_silence", "1 while this leader judges no node lost, every "
                     "node having fallen silent at once (a mass silence), else 0", ["service"],
                     registry=None)

# --- admission (the leader) ------------------------------------------------------------------

QUEUE_DEPTH = Gauge("phalanx_admission_queue_depth", "Gangs waiting for admission after the "
                    "latest pass", registry=None)
ADMISSION_LATENCY = Histogram("phalanx_admission_latency_seconds", "From a gang's submission "
                              "to its admission (a requeued gang's too)",
                              buckets=_QUEUE_BUCKETS, registry=None)
ADMITTED = Counter("phalanx_admission_admitted", "Gangs admitted", registry=None)
PREEMPTED = Counter("phalanx_admission_preempted", "Running gangs that gave slots to others: "
                    "evicted whole or shrunk", ["how"], registry=None)
REQUEUED = Counter("phalanx_admission_requeued", "Running gangs sent back to the queue",
                   ["reason"], registry=None)
ADMISSION: Families = (QUEUE_DEPTH, ADMISSION_LATENCY, ADMITTED, PREEMPTED,
                                    REQUEUED, MASS_SILENCE)

# --- health (the leader) ---------------------------------------------------------------------

FAULTS = Counter("phalanx_faults", "Faults raised", ["kind"], registry=None)
DETECTION = Histogram("phalanx_fault_detection_seconds", "From a rank's exit, as its agent "
                      "saw it, to the fault health raised for it (crash faults)", ["kind"],
                      buckets=_SHORT_BUCKETS, registry=None)
JOB_STEP = Gauge("phalanx_job_step", "A running job's highest committed step", [JOB_LABEL],
                 registry=None)
JOB_STEP_RATE = Gauge("phalanx_job_step_rate", "A running job's steps per second over the "
                      "last 30 s", [JOB_LABEL], registry=None)
HEALTH: Families = (FAULTS, DETECTION, JOB_STEP, JOB_STEP_RATE, MASS_SILENCE)

# --- elasticity (the leader) -----------------------------------------------------------------

GENERATIONS = Counter("phalanx_generations", "Generations (memberships) decided", ["reason"],
                      registry=None)
RECOVERY = Histogram("phalanx_recovery_seconds", "What a generation change cost a member that "
                     "trained before and after it (GenerationApplied.pause_s)", ["reason"],
                     buckets=_SHORT_BUCKETS, registry=None)
RECOVERY_PHASE = Histogram("phalanx_recovery_phase_seconds", "A member's time in each phase "
                           "of applying a generation: rebuild (process group), state_copy",
                           ["phase"], buckets=_SHORT_BUCKETS, registry=None)
JOB_WORLD_SIZE = Gauge("phalanx_job_world_size", "A running job's world size in its current "
                       "generation", [JOB_LABEL], registry=None)
JOB_GENERATION = Gauge("phalanx_job_generation", "A running job's current generation",
                       [JOB_LABEL], registry=None)
ELASTICITY: Families = (GENERATIONS, RECOVERY, RECOVERY_PHASE, JOB_WORLD_SIZE,
                                     JOB_GENERATION)

# --- agents ----------------------------------------------------------------------------------

RANKS = Gauge("phalanx_agent_ranks", "Ranks running on this node", registry=None)
RANK_EXITS = Counter("phalanx_agent_rank_exits", "Ranks on this node that ended, by how",
                     ["cause"], registry=None)
AGENT: Families = (RANKS, RANK_EXITS)

# --- the auth callout (Kubernetes) ------------------------------------------------------------

CALLOUT_DECISIONS = Counter("phalanx_callout_decisions", "Connections the auth callout "
                            "answered: admitted, or the refusal's reason", ["outcome"],
                            registry=None)
CALLOUT_REVOCATIONS = Counter("phalanx_callout_revocations", "Open rank connections the "
                              "callout's revoker closed, by why their job may not be on "
                              "the bus", ["reason"], registry=None)
CALLOUT: Families = (CALLOUT_DECISIONS, CALLOUT_REVOCATIONS)

_registered: set[Collector] = set()
_register_lock = threading.Lock()


def register(families: Iterable[Collector]) -> None:
    """Export ``families`` from this process's ``/metrics`` from now on; each once, however
    often it is asked (several services may run in one process, as in tests)."""
    with _register_lock:
        for family in families:
            if family not in _registered:
                REGISTRY.register(family)
                _registered.add(family)


class MetricsConfigError(PhalanxError, ValueError):
    """The metrics port or address in the environment is not usable."""


def port_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``PHALANX_METRICS_PORT`` as a port, None when unset or empty (no endpoint).

    Raises:
        MetricsConfigError: it is not a number from 0 to 65535.
    """
    raw = (os.environ if env is None else env).get(PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise MetricsConfigError(f"{PORT_ENV} must be a port number from 0 to 65535 "
                                 f"(0: any free port), got {raw!r}")
    return port


def fd_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``PHALANX_METRICS_FD`` as a file descriptor, None when unset or empty.

    Raises:
        MetricsConfigError: it is not a non-negative number.
    """
    raw = (os.environ if env is None else env).get(FD_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise MetricsConfigError(f"{FD_ENV} must be an inherited socket's file descriptor, "
                                 f"got {raw!r}")
    return int(raw)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged: one line per scrape would drown the service's own."""


def _serve_inherited(fd: int) -> WSGIServer:
    """Serve on a listening socket the parent bound (``fd``), on a daemon thread."""
    try:
        sock = socket.socket(fileno=fd)
        host, port = sock.getsockname()[:2]
        sock.set_inheritable(False)  # this process's own: not for the children it starts
    except OSError as exc:
        raise MetricsConfigError(f"{FD_ENV}={fd} is not an open socket: {exc}") from None
    server = ThreadingWSGIServer((host, port), _QuietHandler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_address = (host, port)
    server.server_name, server.server_port = host, port
    server.setup_environ()
    server.set_app(make_wsgi_app())
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def serve(env: Mapping[str, str] | None = None) -> WSGIServer | None:
    """Serve ``/metrics`` on a daemon thread as the environment asks; None when it does not.

    An inherited socket (``PHALANX_METRICS_FD``) comes first, then a port to bind
    (``PHALANX_METRICS_PORT`` on ``PHALANX_METRICS_ADDR``). The caller stops it with
    ``shutdown()`` and ``server_close()``; its port is ``server_address[1]``.

    Raises:
        MetricsConfigError: the descriptor or the port is malformed.
        OSError: the port cannot be bound (in use, say): a process asked for metrics it
            cannot export fails at start, rather than running unobserved.
    """
    fd = fd_from_env(env)
    if fd is not None:
        server = _serve_inherited(fd)
    else:
        port = port_from_env(env)
        if port is None:
            return None
        addr = (os.environ if env is None else env).get(ADDR_ENV, "").strip() or "0.0.0.0"
        server, _ = start_http_server(port, addr=addr)
    host, port = server.socket.getsockname()[:2]
    log.info("metrics", extra={"address": f"http://{host}:{port}/metrics"})
    return server


def forget_job(job_id: str, *gauges: Gauge) -> None:
    """Drop an ended job's series from ``gauges`` (absent ones are fine)."""
    for gauge in gauges:
        with contextlib.suppress(KeyError):
            gauge.remove(job_id)

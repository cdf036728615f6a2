"""A connection whose nats-server is cut from its cluster's majority moves to another.

On a NATS cluster a server cut from the others goes on serving its clients: it answers
their PINGs and takes their publishes, but nothing it takes reaches the majority, and
JetStream — each bucket and stream a Raft group, the JetStream API the meta group's
leader — cannot answer through it (503 "JetStream system temporarily unavailable", or
nothing). nats-py reconnects only when its server stops answering, so a client there
stayed there: a leader flapped its lease, an agent's heartbeats went nowhere while its
own round trips told it all was well (issue 53).

So every :class:`~phalanx.bus.client.Bus` on a cluster (its server pool, configured and
discovered through the servers' ``connect_urls``, holds more than one server) asks the
JetStream API for the account's info (``$JS.API.INFO``, answered by the meta leader:
a round trip through the cluster) every :data:`PROBE_EVERY_S`, and right after each
(re)connection. Once none has been answered for :data:`CUT_AFTER_S` (a 503 or no
responders is no answer), it asks each other server of the pool the same, over a
connection made for the question. **Its server is cut from the majority when a majority
of the pool answers through the others** (:func:`cut_off`); the connection then leaves
it for one of those (``force_reconnect``: the same client, its subscriptions replayed,
its inbox and credentials unchanged, as after a server's death), and every server that
did not answer is *shunned* for :data:`SHUN_S`: no reconnection picks it while another
is not shunned. From the judgement until the reconnection,
:attr:`MajorityWatch.in_majority` is False: a leader does not act, an agent does not
count its round trips. The move comes within ``CUT_AFTER_S + PROBE_EVERY_S + 2 *
PROBE_TIMEOUT_S`` (3 s) of the moment its server stopped answering.

Why a majority must answer elsewhere: when the meta leader itself is cut off, it goes on
answering through its own server (measured on nats-server 2.15: for 19 s, until Raft
deposes it) while the majority elects another (4.4 s), so during the election a lone
answer comes from the wrong side. Limits: the clients of a cut meta leader stay with it
until it is deposed; no client moves while no majority answers anywhere (an election, an
outage: nothing to gain), nor when it can reach no other server (then its agent's round
trips still count: a node that reaches only a minority's server is not fenced by its
agent; health loses it by its silence). A lone server is not probed. The probe is two small
requests a second per connection to the meta leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client, Server

from phalanx.schemas import subjects

log = logging.getLogger("phalanx.bus")

#: How often a connection on a cluster asks the JetStream API whether it answers.
PROBE_EVERY_S = 0.5
#: How long one probe waits for its answer.
PROBE_TIMEOUT_S = 0.5
#: How long no probe may go unanswered before the server counts as cut from the majority.
CUT_AFTER_S = 1.5
#: How long a server found cut is passed over when a connection picks where to go.
SHUN_S = 30.0
#: The probe's subject: the account's JetStream info, which the meta leader answers.
PROBE_SUBJECT = subjects.js_account_info()
# The JetStream API's word for "no leader to answer": the cluster is not reachable here.
_UNAVAILABLE = 503


def answered(reply: bytes) -> bool:
    """Whether a JetStream API reply is the cluster's answer, not its 503 (anything that
    is not a 503, an error included, came from a JetStream that could answer)."""
    try:
        body = json.loads(reply)
    except ValueError:
        return True
    error = body.get("error") if isinstance(body, dict) else None
    return not (isinstance(error, dict) and error.get("code") == _UNAVAILABLE)


def next_server(servers: Sequence[Server], left: str | None, shunned: Mapping[str, float],
                now: float, wait_s: float) -> tuple[Server, float]:
    """Where a reconnection goes from the pool ``servers`` (never empty), and how long it
    waits first: a server not shunned at ``now`` (all of them when every one is), of
    those the ones with the fewest failed attempts, and of those one other than ``left``
    (the server just left) if there is one; it waits ``wait_s`` only for a server that
    failed already, so a dead server's clients try each other server once at once."""
    live = [s for s in servers if shunned.get(s.uri.netloc, 0.0) <= now] or list(servers)
    fewest = min(s.reconnects for s in live)
    least = [s for s in live if s.reconnects == fewest]
    chosen = next((s for s in least if s.uri.netloc != left), least[0])
    return chosen, (wait_s if chosen.reconnects > 0 else 0.0)


def cut_off(answering: Sequence[str], pool: Sequence[str]) -> bool:
    """Whether a server that answers no probe is cut from its cluster's majority, the
    servers of ``answering`` (of ``pool``, its own not among them) answering through
    others: a majority of the pool answers without it. Fewer answering is an election
    of the meta leader or an outage, which no move mends (and a server that answers
    while the others do not may be a deposed leader that has not noticed yet)."""
    return len(set(answering) & set(pool)) > len(pool) // 2


@dataclasses.dataclass
class MajorityWatch:
    """Whether this connection's server answers for the cluster, and the servers found
    cut from it. Times are one monotonic clock's; pure but for the clock passed in."""

    #: When the last probe answered was sent, or when the connection (re)started.
    answered_at: float
    #: False once the server was found cut from the majority (:func:`cut_off`), until
    #: the connection (re)starts.
    in_majority: bool = True
    #: Server (``host:port``) -> until when a reconnection passes it over.
    shunned: dict[str, float] = dataclasses.field(default_factory=dict)
    #: The server connected to now, or last.
    server: str | None = None

    def connected(self, server: str | None, now: float) -> None:
        """The connection (re)started at ``now`` on ``server``: judged afresh."""
        self.server = server
        self.answered_at = now
        self.in_majority = True

    def probed(self, sent_at: float, ok: bool, now: float) -> bool:
        """A probe sent at ``sent_at`` was answered (``ok``) or not; whether no probe has
        been answered for :data:`CUT_AFTER_S`: then ask the other servers
        (:meth:`compared`)."""
        if ok:
            self.answered_at = max(self.answered_at, sent_at)
            return False
        return now - self.answered_at >= CUT_AFTER_S

    def compared(self, answering: Sequence[str], pool: Sequence[str], now: float, *,
                 answered_here: bool = False) -> bool:
        """The other servers of ``pool`` were asked, those of ``answering`` answered, and
        this connection's server asked again at the same time (``answered_here``):
        whether this server is cut from the majority (:func:`cut_off`, and it did not
        answer) and the connection must move. It, and every other server that did not
        answer, is then shunned until ``now + SHUN_S``.

        A server that answers as the others are asked is not cut off, whoever else
        answers: under load, a majority's server whose probes were slow while the
        majority elected a meta leader saw the new leader answer through a peer and the
        cut-off old one through its own server, a majority by count, and moved."""
        if answered_here:
            self.answered_at = now
            return False
        if not cut_off(answering, pool):
            return False
        self.in_majority = False
        for server in {*pool, *([self.server] if self.server else [])} - set(answering):
            self.shunned[server] = now + SHUN_S
        return True


class Majority:
    """The shell of :class:`MajorityWatch` for one nats-py client: the probes, through
    its own server and through the others, the move, and the reconnection handler that
    passes shunned servers over.

    Args:
        options: how the client connects (``nats.connect``'s arguments, callbacks
            left out): the other servers are asked over connections made alike.
        reconnect_wait_s: the pause before retrying a server that failed.
        clock: a monotonic clock (tests give their own).
    """

    def __init__(self, options: Mapping[str, Any], reconnect_wait_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = dict(options)
        self.reconnect_wait_s = reconnect_wait_s
        self.clock = clock
        self.watch = MajorityWatch(clock())
        self.moves = 0
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._probe_now = asyncio.Event()

    @property
    def in_majority(self) -> bool:
        """:attr:`MajorityWatch.in_majority` (a lone server is never judged)."""
        return self.watch.in_majority

    def choose(self, servers: list[Server], _info: dict[str, Any]) -> tuple[Server, float]:
        """nats-py's ``reconnect_to_server_handler``: :func:`next_server`."""
        return next_server(servers, self.watch.server, self.watch.shunned, self.clock(),
                           self.reconnect_wait_s)

    def start(self, nc: Client) -> None:
        """Watch ``nc`` (connected) from now until :meth:`stop`."""
        self._nc = nc
        self.connected()
        self._task = asyncio.create_task(self._watching(nc), name="nats majority")

    def connected(self) -> None:
        """The connection (re)started: judge the new server afresh, probing at once."""
        url = self._nc.connected_url if self._nc is not None else None
        self.watch.connected(url.netloc if url is not None else None, self.clock())
        self._probe_now.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watching(self, nc: Client) -> None:
        while not nc.is_closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PROBE_EVERY_S):
                    await self._probe_now.wait()
            self._probe_now.clear()
            if not nc.is_connected or len(nc.servers) < 2:
                continue
            sent = self.clock()
            ok = await _probe(nc)
            if not (nc.is_connected and self.watch.probed(sent, ok, self.clock())):
                continue
            pool = [url.netloc for url in nc.servers]
            # Its own server asked again meanwhile: it counts if it answered by the time
            # the others had (waiting longer would hold a cut-off connection's move).
            again = asyncio.create_task(_probe(nc, PROBE_TIMEOUT_S * 2))
            answering = await self._others(pool)
            here = again.done() and again.result()
            again.cancel()
            if nc.is_connected and self.watch.compared(answering, pool, self.clock(),
                                                       answered_here=here):
                log.warning("the JetStream majority answers through %s, not through %s: "
                            "moving", answering, self.watch.server)
                self.moves += 1
                await nc.force_reconnect()
            else:  # nothing to gain now: ask again a whole CUT_AFTER_S on
                self.watch.answered_at = self.clock()

    async def _others(self, pool: Sequence[str]) -> list[str]:
        """The servers of ``pool`` other than this connection's that answer a probe, each
        over a connection of its own made for it."""
        others = [server for server in pool if server != self.watch.server]
        answers = await asyncio.gather(*(self._ask(server) for server in others))
        return [server for server, ok in zip(others, answers, strict=True) if ok]

    async def _ask(self, server: str) -> bool:
        scheme = "tls" if "tls" in self.options else "nats"
        nc = Client()
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S * 2):
                await nc.connect(**{**self.options, "servers": [f"{scheme}://{server}"],
                                    "allow_reconnect": False, "connect_timeout": 1,
                                    "error_cb": _unheard})
                return await _probe(nc)
        except (nats.errors.Error, TimeoutError, OSError):
            return False
        finally:
            with contextlib.suppress(Exception):  # the probe's answer is what counts
                await nc.close()


async def _unheard(_: Exception) -> None:
    """A probe's connection's errors: what counts is whether it was answered."""


async def _probe(nc: Client, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the JetStream API answers through ``nc``'s server within ``timeout_s``."""
    try:
        reply = await nc.request(PROBE_SUBJECT, b"", timeout=timeout_s)
    except (nats.errors.Error, TimeoutError, OSError):
        return False  # unanswered, no responders, or the connection is going
    return answered(reply.data)

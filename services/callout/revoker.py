"""The revoker: closes every open connection of a job that ended, on every server.

Run by the auth callout (:class:`~phalanx.services.callout.service.CalloutService`)
when it holds the seed of a user of the servers' system account
(``PHALANX_CALLOUT_SYSTEM_SEED_FILE``). It looks over the servers' rank connections
(:mod:`~phalanx.services.auth.revocation` says which to close):

* as soon as the jobs bucket's watch shows a job's record ended (or deleted): that
  job's connections alone, or every job's where several ended since the last look
  (a burst of ends costs a look or two, not one each);
* over every job, when it starts and then every ``revoke_interval_s``: that catches
  what the watch cannot — an end recorded while no callout ran, a connection admitted
  in the instant its job ended (the callout read the record just before), a watch lost
  to a reconnection, a server that answered a look too late.

A look acts on each server's listing as it arrives, and stops waiting for more
:data:`QUIET_S` after the last one (none says how many servers there are). So an ended
job's connection is closed within ``revoke_interval_s`` (plus one look) of its record's
end, by the durable record alone: a callout restarted, or another replica, reaches the
same answer; usually within milliseconds, by the watch. Both replicas revoke; a
connection closed twice is harmless (the second kick finds no such client). A failed
look is logged and tried again at the next; nothing here stops the callout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas.messages import JobRecord, JobState
from phalanx.services import metrics
from phalanx.services.auth import revocation
from phalanx.services.auth.revocation import Connection, ConnzError, Kick
from phalanx.services.deadline import wait_set

log = logging.getLogger("phalanx.callout.revoker")
#: The longest a look waits for the servers' listings, and how long after the last one
#: it stops waiting for another.
GATHER_S, QUIET_S = 0.5, 0.1
#: How long one server gets to answer a page or a kick.
REQUEST_TIMEOUT_S = 2.0


class Revoker:
    """Closes ended jobs' connections, speaking as a user of the system account.

    Args:
        system: connected as that user (its requests reach every server).
        jobs: the jobs bucket (each connection's job's state).
        interval_s: how often to look over every job.
        gather_s: the longest a look waits for the servers' listings.
        quiet_s: how long after a listing a look stops waiting for another.
    """

    def __init__(self, system: Bus, jobs: TypedKV[JobRecord], *, interval_s: float,
                 gather_s: float = GATHER_S, quiet_s: float = QUIET_S) -> None:
        self.system = system
        self.jobs = jobs
        self.interval_s = interval_s
        self.gather_s = gather_s
        self.quiet_s = quiet_s
        #: Connections closed, by the reason (:class:`~.callout.Refusal`'s value).
        self.kicked: collections.Counter[str] = collections.Counter()
        self._ended: set[str] = set()  # seen ended by the watch, not looked at yet
        self._woken = asyncio.Event()

    async def watch_ends(self) -> None:
        """Wake :meth:`close_ended` whenever a job's record ends or goes (forever)."""
        first_pass = True
        async for change in self.jobs.watch():
            if change is None:
                first_pass = False  # what ended before is the full look's
            elif not first_pass and (change.value is None or change.value.state.terminal):
                self._ended.add(change.key)
                self._woken.set()

    async def close_ended(self) -> None:
        """Look over every job now and every ``interval_s``, and at the jobs that
        :meth:`watch_ends` saw end as soon as it does (forever)."""
        clock = asyncio.get_running_loop().time
        full_at = clock()
        while True:
            if not self._ended and (wait_s := full_at - clock()) > 0:
                await wait_set(self._woken, wait_s)
            self._woken.clear()
            ended, self._ended = self._ended, set()
            full = clock() >= full_at or len(ended) > 1
            try:
                await self.look(None if full else ended.pop())
            except Exception:  # the next look tries again; the callout goes on
                log.exception("could not look over the servers' rank connections")
            if full:
                full_at = clock() + self.interval_s

    async def look(self, job_id: str | None = None) -> list[Kick]:
        """Close the connections, on every server, of every job that ended (of
        ``job_id`` alone when given), each server's as soon as its listing arrives;
        returns what it closed."""
        states: dict[str, JobState | None] = {}  # each job read once per look
        kicks = []
        async for connections in self._listings(job_id):
            for job in revocation.jobs_of(connections) - set(states):
                try:
                    entry = await self.jobs.get(job)
                except Exception as exc:  # unreadable: its connections wait for a later look
                    log.warning("could not read job %s's record: %s", job, exc)
                    continue
                states[job] = entry.value.state if entry is not None else None
            for kick in revocation.to_close(connections, states):
                if await self._kick(kick):
                    kicks.append(kick)
        return kicks

    async def _listings(self, job_id: str | None) -> AsyncIterator[list[Connection]]:
        """Each server's (rank) connections, a server's at a time as its answer arrives,
        until ``gather_s`` after the request, or ``quiet_s`` after the last answer."""
        nc = self.system.nc
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        try:
            await nc.publish(revocation.CONNZ_ALL, revocation.connz_request(job_id=job_id),
                             reply=inbox)
            clock = asyncio.get_running_loop().time
            deadline = clock() + self.gather_s
            while (left := deadline - clock()) > 0:
                try:
                    msg = await replies.next_msg(timeout=left)
                except TimeoutError:
                    return
                if not msg.data:
                    continue  # a no-responders status
                try:
                    page = revocation.read_page(msg.data)
                    connections = page.connections
                    while (offset := page.next_offset) is not None:  # its next page
                        reply = await nc.request(
                            revocation.connz_server(page.server_id),
                            revocation.connz_request(offset=offset, job_id=job_id),
                            timeout=REQUEST_TIMEOUT_S)
                        page = revocation.read_page(reply.data)
                        connections = [*connections, *page.connections]
                except ConnzError as exc:  # that server's connections wait for a later look
                    log.warning("a server's connection listing: %s", exc)
                    continue
                yield connections  # acted on (its kicks) before the next is read
                deadline = min(deadline, clock() + self.quiet_s)
        finally:
            await replies.unsubscribe()

    async def _kick(self, kick: Kick) -> bool:
        """Have the connection's server close it; whether it did."""
        where = kick.connection
        try:
            reply = await self.system.nc.request(
                revocation.kick_subject(where.server_id), revocation.kick_request(where.cid),
                timeout=REQUEST_TIMEOUT_S)
            error = revocation.kick_error(reply.data)
        except Exception as exc:  # a later look finds it again if it is still open
            error = str(exc) or type(exc).__name__
        if error is not None:
            # "no such client": closed meanwhile (the other replica's kick, its own end).
            log.info("did not close connection %d on server %s of job %s: %s",
                     where.cid, where.server_id, kick.job_id, error)
            return False
        self.kicked[str(kick.refusal)] += 1
        metrics.CALLOUT_REVOCATIONS.labels(reason=str(kick.refusal)).inc()
        log.info("closed connection %d on server %s: %s: %s", where.cid, where.server_id,
                 kick.refusal, kick.message)
        return True

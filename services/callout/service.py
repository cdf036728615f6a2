"""The auth callout service: answers nats-server's authorization requests for ranks.

It connects as its own identity (``callout``, one of the server config's
``auth_users``, so the server never asks about it), subscribes to
``$SYS.REQ.USER.AUTH`` in a queue group (any number of instances run; each request
is answered by one) and answers each request with what
:func:`~phalanx.services.auth.callout.decide` returns, after reading the token's job
from the jobs bucket (``phalanx_jobs``, one direct read per request, so a job that
ended is refused from the moment its record says so). Requests are answered one at a
time, in arrival order.

Nothing a client sends can stop it: a request that does not read is answered with an
empty reply (the server refuses the connection at once), a job record that cannot be
read refuses the connection (``unavailable``), and any other failure is logged and the
request left unanswered (the server refuses the connection at its auth timeout).
Every answer is logged and counted (``phalanx_callout_decisions_total{outcome}``);
tokens never are.

With the seed of a user of the servers' system account it also runs the revoker
(:mod:`.revoker`), which closes the open connections of every job that ended.

Only a Kubernetes deployment runs it (``phalanx auth kubernetes`` configures the
server for it, deploy/k8s/base/callout.yaml runs two): bare metal's ``phalanx up
--secure`` gives each job an NKEY identity in ``nats.conf`` instead, so it is not in
:data:`~phalanx.services.control_plane.SERVICES`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.msg import Msg

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.errors import ConfigError
from phalanx.schemas.messages import JobRecord
from phalanx.services import metrics
from phalanx.services.auth import callout, nats_jwt
from phalanx.services.auth.replication_key import load_key
from phalanx.services.auth.roles import SERVICE_NAMES, Role
from phalanx.services.base import Service
from phalanx.services.callout.config import CalloutConfig
from phalanx.services.callout.revoker import Revoker
from phalanx.services.leader import instance_name

log = logging.getLogger("phalanx.callout")
#: The queue group every instance answers in: one answer per request.
QUEUE = "phalanx-callout"
ADMITTED = "admitted"


class CalloutService(Service):
    """One instance of the auth callout.

    Args:
        config: its keys and the connection lifetime.
        bus_config: how to reach NATS as the ``callout`` identity.
        instance: its name in logs and ``$SRV`` (default host-pid-random).
        clock: Unix seconds (tests pass their own).

    Raises:
        ConfigError: a key file unreadable, or not an account seed / a key of 32 bytes.
    """

    description = "auth callout: admits each job's ranks as their job while it is live"
    metric_families = metrics.CALLOUT

    def __init__(self, config: CalloutConfig, bus_config: BusConfig | None = None, *,
                 instance: str | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(SERVICE_NAMES[Role.CALLOUT], instance or instance_name(), bus_config)
        self.config = config
        self.clock = clock
        try:
            self.issuer_seed = Path(config.issuer_seed_file).read_bytes().strip()
            self.issuer = nats_jwt.public_key_of(self.issuer_seed, nats_jwt.ACCOUNT)
        except (OSError, nats_jwt.JWTError) as exc:
            raise ConfigError(f"callout issuer seed {config.issuer_seed_file}: {exc}") from None
        self.key = load_key(config.token_key_file, "rank token key")
        self.jobs: TypedKV[JobRecord] | None = None
        #: The revoker and its connection (with ``config.system_seed_file``).
        self.system: Bus | None = None
        self.revoker: Revoker | None = None
        #: Answers given, by outcome (``admitted`` or a refusal's value).
        self.decisions: collections.Counter[str] = collections.Counter()

    async def setup(self) -> None:
        assert self.bus is not None
        self.jobs = await self.bucket(subjects.JOBS_BUCKET, JobRecord)
        await self.bus.nc.subscribe(subjects.auth_callout(), queue=QUEUE, cb=self._on_request)
        if self.config.system_seed_file:
            # A connection of its own: the system account's user may use no subject of
            # the jobs' account, the callout's identity none of the system account's.
            system = dataclasses.replace(self.bus_config or BusConfig.load(),
                                         nkey_seed_file=self.config.system_seed_file,
                                         inbox_prefix="_INBOX")
            self.system = await Bus.connect(system, name=f"{self.name}-revoker:{self.instance}")
            revoker = self.revoker = Revoker(self.system, self.jobs,
                                             interval_s=self.config.revoke_interval_s)
            self.keep_running(lambda: self.until_stopped(revoker.close_ended()), "revoker")
            self.keep_running(lambda: self.until_stopped(revoker.watch_ends()),
                              "revoker watch")

    async def teardown(self) -> None:
        if self.system is not None:
            await self.system.close()

    async def _on_request(self, msg: Msg) -> None:
        try:
            decision = await self.answer(msg.data)
            if msg.reply:
                await msg.respond(decision.response)
        except Exception:  # never fatal: the server refuses at its auth timeout
            self._count("error")
            log.exception("could not answer an authorization request")

    async def answer(self, request: bytes) -> callout.Decision:
        """The decision on one authorization request (counted and logged)."""
        assert self.jobs is not None
        examined = callout.examine(request, issuer=self.issuer, key=self.key, now=self.clock())
        state = None
        if examined.token is not None and examined.refusal is None:
            try:
                entry = await self.jobs.get(examined.token.job_id)
                state = entry.value.state if entry is not None else None
            except Exception as exc:  # unreadable or undecodable: refuse, say why
                examined = dataclasses.replace(
                    examined, refusal=callout.Refusal.UNAVAILABLE,
                    message=f"the record of job {examined.token.job_id} could not be read: "
                            f"{exc}")
        decision = callout.decide(examined, state, issuer_seed=self.issuer_seed,
                                  now=self.clock(), connection_ttl_s=self.config.connection_ttl_s,
                                  account=self.config.account)
        client = examined.request.client if examined.request is not None else "?"
        if decision.job_id is not None:
            self._count(ADMITTED)
            log.info("admitted %s as the ranks of job %s until %s", client, decision.job_id,
                     decision.expires_at)
        else:
            self._count(str(decision.refusal))
            log.warning("refused %s: %s: %s", client, decision.refusal, decision.message)
        return decision

    def _count(self, outcome: str) -> None:
        self.decisions[outcome] += 1
        metrics.CALLOUT_DECISIONS.labels(outcome=outcome).inc()

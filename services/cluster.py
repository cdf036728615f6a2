"""A whole phalanx cluster on this machine: the engine behind ``phalanx up``.

:class:`LocalCluster` starts an embedded ``nats-server`` with JetStream (unless
it is pointed at an existing server), every service of the control plane
(:data:`~phalanx.services.control_plane.SERVICES`), and N node
agents as child processes, each logging to ``<data-dir>/logs/``. It returns
from :meth:`LocalCluster.start` once every agent has heartbeated, records
itself in ``<data-dir>/up.json`` so ``phalanx down`` and ``phalanx nodes`` can
find it, and stops everything in reverse order. Children are started with a
parent-death signal, so even a SIGKILLed ``phalanx up`` leaves nothing behind.

Every process it starts serves Prometheus metrics on a port of 127.0.0.1 of its own
(:mod:`phalanx.services.metrics`): the supervisor binds a listening socket for each and
hands it down (``PHALANX_METRICS_FD``), so no other process can take the port between its
choice and its use, and a restarted process serves on the same port. ``up.json`` lists
them by log name (``metrics``: ``{"health": 40123, "agent-local-0": 40127, ...}``).

A service or agent that exits while the cluster starts fails ``phalanx up`` at once,
with the end of its log in the error, instead of a wait for a readiness that cannot come.

Agents that die are *not* restarted: a killed agent must show as lost, as it
would on a real machine. With ``supervised_agents`` (``phalanx up
--supervised-agents``) each agent runs as a Kubernetes DaemonSet runs it, under
``phalanx agent --supervised`` (:mod:`~phalanx.services.agent.supervisor`): one
that dies is started again in place and adopts the ranks that outlived it.

With ``nats_servers=N`` (``phalanx up --nats-cluster N``) the bus is a NATS cluster
of N servers (:class:`~phalanx.services.natsd.NatsCluster`) and every process is
given all N URLs and ``PHALANX_NATS_REPLICAS`` (3, or N when smaller), so every
bucket and stream is replicated and the cluster rides out the loss of a server;
a member that dies is started again on its ports and store.

With an auth directory (``phalanx up --secure``, docs/security.md) the server
runs with its config — NKEY users with per-role permissions, TLS on the client
port — and every process connects as its own identity: each service as its
role, each agent as its node, this supervisor as the operator (cli), and ranks
as their job (agents read the jobs' seeds from the directory's ``ranks/``). A
job's identity is made when it is submitted (``phalanx submit``) and revoked by
this supervisor when the job's record says it ended: the server reloads and
closes whatever connection the job's ranks still hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig, with_identity
from phalanx.bus.errors import RemoteError
from phalanx.schemas import settings, subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import JobRecord, NodeHeartbeat
from phalanx.services import control_plane, metrics
from phalanx.services.agent import cpus
from phalanx.services.agent.zygote import Template
from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.roles import Role
from phalanx.services.client import AdmissionClient
from phalanx.services.deadline import wait_set
from phalanx.services.manifest import MANIFEST, running_in_manifest, start_ticks
from phalanx.services.natsd import (
    NatsCluster,
    NatsServer,
    NatsServerError,
    die_with_parent,
    reload_config,
)

log = logging.getLogger("phalanx.cluster")
STATE_FILE = "up.json"
#: Replicas of buckets and streams on an embedded NATS cluster (fewer if it is smaller).
CLUSTER_REPLICAS = 3


class ClusterError(PhalanxError, RuntimeError):
    """The local cluster cannot start or is already running."""


@dataclasses.dataclass(frozen=True)
class ClusterState:
    """What ``up.json`` records about a running local cluster."""

    pid: int
    nats_url: str
    nats_pid: int | None
    agents: dict[str, int]  # node id -> pid
    started_at: float
    services: dict[str, int] = dataclasses.field(default_factory=dict)  # instance -> pid
    auth_dir: str | None = None  # the auth directory of a secured cluster
    nats_pids: list[int] = dataclasses.field(default_factory=list)  # an embedded NATS cluster
    nats_replicas: int = 1  # replicas of the buckets and streams phalanx creates
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)  # log name -> port

    @classmethod
    def read(cls, data_dir: Path) -> ClusterState | None:
        """The recorded cluster, or None if there is none or its supervisor is gone."""
        path = data_dir / STATE_FILE
        try:
            raw = json.loads(path.read_text())
            state = cls(**raw)
        except (OSError, ValueError, TypeError):
            return None
        return state if pid_alive(state.pid) else None

    def write(self, data_dir: Path) -> None:
        tmp = data_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        tmp.replace(data_dir / STATE_FILE)


def pid_alive(pid: int) -> bool:
    """Running (a zombie is dead for our purposes)."""
    return start_ticks(pid) is not None


class LocalCluster:
    """NATS + agents on this machine.

    Args:
        data_dir: where JetStream data, logs and ``up.json`` live.
        agents: how many node agents to start.
        slots_per_agent: slots each agent offers.
        nats_url: use this server instead of starting one (comma-separated URLs).
        nats_port: port of the embedded server (0 = any free port); of the first member of
            an embedded cluster, the others taking the next ones.
        nats_servers: how many servers the embedded NATS has: 1, or a cluster of N with
            replicated JetStream.
        heartbeat_interval_s / lost_after_s: passed to each agent.
        ready_timeout_s: how long :meth:`start` waits for every agent's first heartbeat.
        auth_dir: run secured with this auth directory (made if missing): the embedded
            server with its config, every process as its own identity.
        supervised_agents: each agent under its supervisor, started again when it dies.
        pin_cpus: each agent on a share of this machine's cores of its own, its CPU slots'
            ranks pinned to shares of that (``agent.cpus``, :mod:`.agent.cpus`).
    """

    def __init__(self, data_dir: Path, *, agents: int = 2, slots_per_agent: int = 2,
                 nats_url: str | None = None, nats_port: int = 4222, nats_servers: int = 1,
                 heartbeat_interval_s: float = 0.5, lost_after_s: float = 3.0,
                 admission_instances: int = 1, health_instances: int = 1,
                 elasticity_instances: int = 1, config_path: str | None = None,
                 ready_timeout_s: float = 30.0, auth_dir: Path | None = None,
                 supervised_agents: bool = False, pin_cpus: bool = False) -> None:
        if agents < 0:
            raise ClusterError(f"--agents must be >= 0, got {agents}")
        if slots_per_agent < 1:
            raise ClusterError(f"--slots-per-agent must be >= 1, got {slots_per_agent}")
        if nats_servers < 1:
            raise ClusterError(f"--nats-cluster must be >= 1, got {nats_servers}")
        for flag, count in (("--admission", admission_instances),
                            ("--health", health_instances),
                            ("--elasticity", elasticity_instances)):
            if count < 0:
                raise ClusterError(f"{flag} must be >= 0, got {count}")
        self.data_dir = data_dir
        self.n_agents = agents
        self.slots_per_agent = slots_per_agent
        self.nats_url = nats_url
        self.nats_port = nats_port
        self.nats_servers = nats_servers
        self.nats_replicas = min(nats_servers, CLUSTER_REPLICAS) if nats_url is None else 1
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lost_after_s = lost_after_s
        self.ready_timeout_s = ready_timeout_s
        self.supervised_agents = supervised_agents
        #: Each agent's CPU set, in the order they are started (empty: not pinned).
        self.agent_cpus = cpus.shares(sorted(os.sched_getaffinity(0)), agents) \
            if pin_cpus and agents else ()
        # Instances of each service the flags count; one of every other.
        self.instances = {"admission": admission_instances, "health": health_instances,
                          "elasticity": elasticity_instances}
        self.config_path = config_path
        self.nats: NatsServer | None = None
        self.nats_cluster: NatsCluster | None = None
        self.agents: dict[str, asyncio.subprocess.Process] = {}
        self.services: dict[str, asyncio.subprocess.Process] = {}
        # log name -> what it was started with: arguments, the variables it gets beside
        # the supervisor's (its identity's, an agent's config), the command it runs under
        self._argv: dict[str, tuple[tuple[str, ...], dict[str, str], dict[str, str],
                                    tuple[str, ...]]] = {}
        # log name -> the listening socket its /metrics is served on (kept across restarts)
        self.metrics_sockets: dict[str, socket.socket] = {}
        self.auth = AuthDir(auth_dir) if auth_dir is not None else None
        self.bus: Bus | None = None
        # The agents' zygotes are forked from one template: the machine imports torch
        # once for all of them. One given in the environment is used instead.
        self.zygote_template: Template | None = None

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    async def start(self) -> None:
        """Start NATS and the agents; return when every agent has heartbeated.

        Raises:
            ClusterError: a cluster already runs here, or an agent died / was not ready in time.
            NatsServerError: the embedded server could not start (e.g. the port is busy).
        """
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        running = ClusterState.read(self.data_dir)
        if running is not None:
            raise ClusterError(
                f"a local cluster already runs from {self.data_dir} (pid {running.pid}, "
                f"{running.nats_url}); stop it with `phalanx down`"
            )
        if self.auth is not None:
            if not self.auth.exists:
                await asyncio.to_thread(AuthDir.init, self.auth.root)
            for i in range(self.n_agents):  # known before the server starts: no reload
                self.auth.add(Role.AGENT, f"local-{i}")
        if self.nats_url is None and self.nats_servers > 1:
            self.nats_cluster = NatsCluster(
                self.data_dir / "jetstream-cluster", self.nats_servers, port=self.nats_port,
                log_dir=self.logs_dir,
                config_file=self.auth.config_path if self.auth else None,
                secured=self.auth.route_security() if self.auth else None)
            await asyncio.to_thread(self.nats_cluster.start)
            self.nats_url = ",".join(self.nats_cluster.urls)
        elif self.nats_url is None:
            self.nats = self._nats_server(self.nats_port)
            await asyncio.to_thread(self.nats.start)
            self.nats_url = self.nats.url
        self.bus = await Bus.connect(BusConfig.load(
            env=self._identity(Role.CLI), servers=self.nats_url,
            jetstream_replicas=self.nats_replicas), name="phalanx-up")
        if self.auth is not None:
            await self.bus.subscribe(subjects.job_states(), JobRecord, self._revoke_ended)
        seen: set[str] = set()
        all_seen = asyncio.Event()

        async def on_heartbeat(beat: NodeHeartbeat, _: Delivery) -> None:
            seen.add(beat.node_id)
            if seen >= set(self.agents):
                all_seen.set()

        sub = await self.bus.subscribe(subjects.node_heartbeats(), NodeHeartbeat, on_heartbeat)
        # Every service of the control plane: one instance leads, the others stand by;
        # the first keeps the plain name (logs/health.log).
        for service in control_plane.SERVICES:
            for i in range(self.instances.get(service, 1)):
                await self._spawn_service(service, service if i == 0 else f"{service}-{i}")
        if self.n_agents and settings.AGENT("zygote_template") not in os.environ:
            self.zygote_template = Template(self.logs_dir / "zygote-template.log")
            if not await asyncio.to_thread(self.zygote_template.wait_listening):
                log.warning("the zygote template exited at its start: each agent starts "
                            "its own zygote (see %s)", self.logs_dir / "zygote-template.log")
        for i in range(self.n_agents):
            await self.start_agent(f"local-{i}", f"domain-{i % 2}")
        if not self.agents:
            all_seen.set()

        async def heartbeats() -> None:
            if not await wait_set(all_seen, self.ready_timeout_s):
                raise ClusterError(f"agents {sorted(set(self.agents) - seen)} did not "
                                   f"heartbeat within {self.ready_timeout_s:g} s")

        try:
            try:
                await self._while_all_run(heartbeats())
            finally:
                await sub.unsubscribe()
            if self.services:
                await self._while_all_run(self._admission_answers())
        except ClusterError:
            await self.stop()
            raise
        self.state().write(self.data_dir)

    async def _while_all_run(self, ready: Coroutine[Any, Any, None]) -> None:
        """Await ``ready`` while every process started so far runs.

        Raises:
            ClusterError: a service or agent exited first (named, with the end of its log),
                or ``ready`` failed.
        """
        children = {**self.services, **{f"agent-{n}": p for n, p in self.agents.items()}}
        exits = {asyncio.create_task(p.wait()): name for name, p in children.items()}
        waiting = asyncio.create_task(ready)
        try:
            done, _ = await asyncio.wait([waiting, *exits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiting, *exits):
                task.cancel()
            await asyncio.gather(waiting, *exits, return_exceptions=True)
        if waiting in done and waiting.exception() is None:
            return
        if waiting in done:
            raise ClusterError(f"{waiting.exception()}; see {self.logs_dir}")
        name = next(name for task, name in exits.items() if task in done)
        raise ClusterError(f"{name} exited with {children[name].returncode} while the cluster "
                           f"started; the end of {self.logs_dir / name}.log:\n"
                           f"{self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 12, width: int = 400) -> str:
        try:
            text = (self.logs_dir / f"{name}.log").read_text(errors="replace")
        except OSError as exc:
            return f"  (unreadable: {exc})"
        return "\n".join(f"  {line[:width]}" for line in text.splitlines()[-lines:])

    async def _admission_answers(self) -> None:
        """Return once an admission leader answers (a probe job is unknown to it: 404).

        Raises:
            ClusterError: none did within the ready timeout.
        """
        assert self.bus is not None
        client = AdmissionClient(self.bus, timeout_s=2.0)
        try:
            await client.explain("phalanx-ready-probe", retry_s=self.ready_timeout_s)
        except RemoteError as exc:
            if exc.code == "404":
                return
            cause: Exception = exc
        except PhalanxError as exc:
            cause = exc
        raise ClusterError(f"no admission leader within {self.ready_timeout_s:g} s ({cause})")

    def _nats_server(self, port: int) -> NatsServer:
        return NatsServer(self.data_dir / "jetstream", port=port,
                          log_path=self.logs_dir / "nats.log",
                          config_file=self.auth.config_path if self.auth else None)

    async def _revoke_ended(self, record: JobRecord, _: Delivery) -> None:
        """Revoke the identity of a job that ended (its ranks' only one)."""
        assert self.auth is not None
        if not record.state.terminal:
            return
        if await asyncio.to_thread(self.auth.remove, Role.RANK, record.job_id):
            self._reload_nats()
            log.info("revoked the bus identity of %s (%s)", record.job_id, record.state.value)

    def _reload_nats(self) -> None:
        """Have every embedded server read its config again (identities added or gone)."""
        for server in self.embedded_nats:
            if server.process is not None:
                reload_config(server.process.pid)

    def _identity(self, role: Role, scope: str | None = None) -> dict[str, str]:
        """The variables that make a process connect as ``role`` (an identity made, and the
        running server told, if it is new); none when not secured."""
        if self.auth is None:
            return {}
        _, made = self.auth.add(role, scope)
        if made:
            self._reload_nats()
        env = self.auth.env(role, scope)
        if role is Role.AGENT:
            env[settings.AGENT("rank_keys_dir")] = str(self.auth.ranks_dir)
        return env

    async def _spawn(self, name: str, *argv: str, identity: dict[str, str] | None = None,
                     extra_env: dict[str, str] | None = None,
                     wrap: Sequence[str] = ()) -> asyncio.subprocess.Process:
        self._argv[name] = (argv, identity or {}, extra_env or {}, tuple(wrap))
        log_file = (self.logs_dir / f"{name}.log").open("ab")
        env = {**os.environ, settings.NATS_URL: self.nats_url or "",
               settings.NATS_REPLICAS: str(self.nats_replicas), **(extra_env or {})}
        # Admission judges nodes lost by the registry, health by heartbeats: one bound.
        env.setdefault(settings.ADMISSION("lost_after_s"), str(self.lost_after_s))
        if identity:
            env = with_identity(env, identity)
        if self.config_path:
            env[settings.CONFIG] = self.config_path
        # Its own /metrics socket, the same one again after a restart (scrape configs hold
        # its port).
        if name not in self.metrics_sockets:
            self.metrics_sockets[name] = socket.create_server(("127.0.0.1", 0))
        metrics_fd = self.metrics_sockets[name].fileno()
        env[metrics.FD_ENV] = str(metrics_fd)  # served before any PHALANX_METRICS_PORT
        try:
            return await asyncio.create_subprocess_exec(
                *wrap, sys.executable, "-m", *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file, stderr=log_file, env=env, preexec_fn=die_with_parent,
                pass_fds=(metrics_fd,))
        finally:
            log_file.close()

    async def _spawn_service(self, service: str, instance: str, *, wrap: Sequence[str] = (),
                             env: Mapping[str, str] | None = None
                             ) -> asyncio.subprocess.Process:
        extra = ("--lost-after", str(self.lost_after_s)) if service == "health" else ()
        self.services[instance] = await self._spawn(
            instance, control_plane.module(service), "--instance", instance, *extra,
            identity=self._identity(Role(service)), extra_env=dict(env or {}), wrap=wrap)
        return self.services[instance]

    async def start_service(self, service: str, instance: str, *, wrap: Sequence[str] = (),
                            env: Mapping[str, str] | None = None
                            ) -> asyncio.subprocess.Process:
        """Start one more instance of ``service`` (a name of
        :data:`~phalanx.services.control_plane.SERVICES`), named ``instance`` (its log is
        ``logs/<instance>.log``); :meth:`restart` starts it again as it was started.

        Args:
            wrap: a command it runs under, which ends by executing the rest of its command
                line (``ip netns exec NS``: an instance with a network of its own, which
                the tests' partition harness cuts from the bus).
            env: variables it gets beside the cluster's.

        Raises:
            ClusterError: ``instance`` names a service instance already running.
        """
        running = self.services.get(instance)
        if running is not None and running.returncode is None:
            raise ClusterError(f"service instance {instance!r} already runs "
                               f"(pid {running.pid})")
        process = await self._spawn_service(service, instance, wrap=wrap, env=env)
        self.state().write(self.data_dir)
        return process

    async def restart(self, name: str) -> asyncio.subprocess.Process:
        """Start a service instance (by instance name) or an agent (by node id) again with
        the command it was first started with, as a supervisor would after a crash."""
        processes = self.agents if name in self.agents else self.services
        if name not in processes:
            raise ClusterError(f"no service instance or agent named {name!r}")
        log_name = f"agent-{name}" if processes is self.agents else name
        argv, identity, extra_env, wrap = self._argv[log_name]
        processes[name] = await self._spawn(log_name, *argv, identity=identity,
                                            extra_env=extra_env, wrap=wrap)
        self.state().write(self.data_dir)
        return processes[name]

    async def start_agent(self, node_id: str, domain: str, *, wrap: Sequence[str] = (),
                          env: Mapping[str, str] | None = None) -> None:
        """Start the agent of ``node_id`` in failure domain ``domain``.

        Args:
            wrap: a command it runs under, which ends by executing the rest of its command
                line (``ip netns exec NS``: an agent with a network of its own; the tests'
                partition harness).
            env: variables it gets beside the cluster's (``PHALANX_AGENT_ADDRESS``).
        """
        command = ("phalanx.services.cli", "agent", "--supervised") \
            if self.supervised_agents else ("phalanx.services.agent",)
        self.agents[node_id] = await self._spawn(
            f"agent-{node_id}", *command, "--node-id", node_id,
            "--slots", str(self.slots_per_agent), "--failure-domain", domain,
            "--heartbeat-interval", str(self.heartbeat_interval_s),
            "--lost-after", str(self.lost_after_s),
            "--work-dir", str(self.data_dir / "agents" / node_id),
            identity=self._identity(Role.AGENT, node_id),
            # `phalanx down` is a restart of the node: the next `phalanx up` brings it back.
            # The agents share one machine's GPUs: CPU slots (--slots-per-agent), unless
            # the environment asks for discovery (bench/gpu_node.py on a GPU, one agent).
            extra_env={settings.AGENT("stop_is_restart"): "1",
                       **({settings.AGENT("zygote_template"): self.zygote_template.path}
                          if self.zygote_template is not None else {}),
                       settings.AGENT("discover_gpus"):
                       os.environ.get(settings.AGENT("discover_gpus"), "0"),
                       **self._cpus_of(len(self.agents)), **(env or {})}, wrap=wrap)

    def _cpus_of(self, index: int) -> dict[str, str]:
        """The ``agent.cpus`` of the cluster's ``index``-th agent, where agents are pinned
        (one started later, bench/detect.py's, shares the first's)."""
        if not self.agent_cpus:
            return {}
        return {settings.AGENT("cpus"):
                cpus.format_cpu_list(self.agent_cpus[index % len(self.agent_cpus)])}

    @property
    def embedded_nats(self) -> list[NatsServer]:
        """The nats-servers this cluster started (none when it uses an existing one)."""
        if self.nats_cluster is not None:
            return self.nats_cluster.servers
        return [self.nats] if self.nats is not None else []

    async def keep_nats(self, stop: asyncio.Event, restart_after_s: float = 1.0,
                        attempts: int = 5) -> bool:
        """Start an embedded nats-server again whenever it dies, on the same ports and
        store (as a Deployment would), until ``stop`` is set; after ``attempts`` failed
        starts in a row, set ``stop`` and return True: without its server the cluster is
        gone."""
        failures = 0
        while (servers := self.embedded_nats) and not stop.is_set():
            # Indexed by member (the position _restart_nats takes), skipping any not running.
            deaths = {i: asyncio.create_task(asyncio.to_thread(server.process.wait))
                      for i, server in enumerate(servers) if server.process is not None}
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait([*deaths.values(), stopping],
                               return_when=asyncio.FIRST_COMPLETED)
            for task in (*deaths.values(), stopping):
                task.cancel()
            if stop.is_set():
                return False
            member, died = next((i, task) for i, task in deaths.items() if task.done())
            log.warning("nats-server %s exited with %s; starting it again",
                        servers[member].url, died.result())
            await asyncio.sleep(restart_after_s)
            try:
                await asyncio.to_thread(self._restart_nats, member)
            except NatsServerError as exc:
                failures += 1
                log.error("nats-server did not start again (%d/%d): %s", failures, attempts,
                          exc)
                if failures >= attempts:
                    stop.set()
                    return True
                continue
            failures = 0
            self.state().write(self.data_dir)
        return False

    def _restart_nats(self, member: int) -> None:
        if self.nats_cluster is not None:
            self.nats_cluster.restart(member)
            return
        assert self.nats is not None
        self.nats = self._nats_server(self.nats.port).start()

    def state(self) -> ClusterState:
        return ClusterState(
            pid=os.getpid(), nats_url=self.nats_url or "",
            nats_pid=self.nats.process.pid if self.nats and self.nats.process else None,
            agents={n: p.pid for n, p in self.agents.items()}, started_at=time.time(),
            services={n: p.pid for n, p in self.services.items()},
            auth_dir=str(self.auth.root) if self.auth else None,
            nats_pids=[s.process.pid for s in self.embedded_nats if s.process],
            nats_replicas=self.nats_replicas, metrics={name: sock.getsockname()[1]
                     for name, sock in self.metrics_sockets.items()},
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the services, then the agents (SIGKILL stragglers of each), stop NATS.

        The services go first, so that none acts on the agents' stop: admission does
        not shrink the jobs, elasticity launches no replacement into a stopping agent.
        The agents stop their ranks and report them lost (their jobs still want them),
        keeping their registry entries and snapshots (``stop_is_restart``): the next
        ``phalanx up`` finds the jobs where they were, health faults the lost ranks from
        the job-events stream, and elasticity replaces them, each job resuming from the
        newest step its nodes' memory (or the durable tier) holds. Idempotent.
        """
        for group in (list(self.services.values()), list(self.agents.values())):
            await _terminate(group, grace_s)
        if self.bus is not None:
            await self.bus.close()
            self.bus = None
        sweep_ranks(self.data_dir)
        if self.zygote_template is not None:
            await asyncio.to_thread(self.zygote_template.stop)
            self.zygote_template = None
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        if self.nats_cluster is not None:
            await asyncio.to_thread(self.nats_cluster.stop)
        for sock in self.metrics_sockets.values():
            sock.close()
        self.metrics_sockets.clear()
        with contextlib.suppress(FileNotFoundError):
            state_file = self.data_dir / STATE_FILE
            recorded = json.loads(state_file.read_text())
            if recorded.get("pid") == os.getpid():
                state_file.unlink()


async def _terminate(children: list[asyncio.subprocess.Process], grace_s: float) -> None:
    """SIGTERM ``children``; SIGKILL those still there after ``grace_s``; wait for all."""
    for proc in children:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    if not children:
        return
    try:
        async with asyncio.timeout(grace_s):
            await asyncio.gather(*(p.wait() for p in children))
    except TimeoutError:
        for proc in children:
            if proc.returncode is None:
                proc.kill()
        await asyncio.gather(*(p.wait() for p in children))


def stop_recorded(data_dir: Path, timeout_s: float = 20.0) -> ClusterState | None:
    """Stop the cluster ``up.json`` records (SIGTERM, then SIGKILL); None if none runs.

    Waits on the supervisor's pidfd, so the return is prompt; whatever is still
    alive after ``timeout_s`` (supervisor, agents, server) is SIGKILLed.
    """
    path = data_dir / STATE_FILE
    try:
        state = ClusterState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if pid_alive(state.pid):
        os.kill(state.pid, signal.SIGTERM)
        _wait_exit(state.pid, timeout_s)
    leftovers = [state.pid, *state.agents.values(), *state.services.values(),
                 *([state.nats_pid] if state.nats_pid else []), *state.nats_pids]
    for pid in leftovers:
        if pid_alive(pid) and _is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 5.0)
    sweep_ranks(data_dir)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return state


def sweep_ranks(data_dir: Path) -> int:
    """SIGKILL rank processes the local agents' manifests still list; returns how many.

    A SIGKILLed agent leaves its ranks running on purpose (a restarted agent adopts
    them); when the whole local cluster stops, nobody will, so they go too.
    """
    killed = 0
    for manifest in data_dir.glob(f"agents/*/{MANIFEST}"):
        for rank in running_in_manifest(manifest):
            if rank.get("ticks") is not None and start_ticks(rank["pid"]) == rank["ticks"]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rank["pid"], signal.SIGKILL)
                    killed += 1
    return killed


def _wait_exit(pid: int, timeout_s: float) -> bool:
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)
    finally:
        os.close(fd)
    return not pid_alive(pid)


def _is_ours(pid: int) -> bool:
    """Only kill a recorded pid if it still runs phalanx or nats-server (pids get reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"phalanx" in cmdline or b"nats-server" in cmdline

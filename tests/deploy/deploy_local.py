"""Containers as local processes: what ``deploy/`` gives each container, run on this machine.

No container engine runs here, so the deployment files are proven by running, as
plain processes, exactly the command and environment each container would get:

* the image's side comes from ``deploy/Dockerfile`` (parsed with BuildKit's own
  parser, the ``dockerfile`` package): entry point, default command, working
  directory and ``ENV`` of its last stage;
* the container's side from ``deploy/compose.yaml`` or the rendered Kubernetes
  manifests (command/args, env, mounts).

What cannot be the same on one machine is *translated*, and only that: host
names and ports of other containers (``nats:4222`` → a local port), the ports a
container itself listens on (each container's ``PHALANX_METRICS_PORT``, 9464 in all
of them, → a free local port of its own, and ``admission:9464`` → that port for
whoever scrapes it), absolute
paths of the container's filesystem (``/opt/phalanx`` → this checkout,
``/opt/venv`` → this interpreter's prefix, a volume → a directory shared by the
containers that mount it, anything else → a directory of that container's own).
:meth:`World.localize` refuses a container path it has no translation for, so a
file naming a path the image does not have fails the test.

Each image is a target of ``deploy/Dockerfile`` (:data:`TARGETS`). The control-plane
image's virtualenv holds less than this one: a process standing in for one of its
containers gets an import blocker (``image_without/sitecustomize.py``) that makes every
module of a distribution outside that image fail to import, as it would there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import dockerfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.schemas import subjects
from phalanx.schemas.messages import JobRecord, JobState, RankProgress
from phalanx.services import metrics
from phalanx.services.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
#: Each image the deployment files name -> the ``deploy/Dockerfile`` target that builds it.
TARGETS = {"phalanx": "full", "phalanx-control-plane": "control-plane"}
#: Targets whose virtualenv holds only ``deploy/requirements.py``'s list and phalanx.
SLIM_TARGETS = ("control-plane",)
#: What ``python3 -m venv`` puts into every virtualenv (Python 3.11).
VENV_SEED = ("pip", "setuptools")
#: The import blocker's directory (its ``sitecustomize``) and the variable naming what
#: it blocks.
BLOCKER = Path(__file__).resolve().parent / "image_without"
BLOCKED_ENV = "DEPLOY_LOCAL_ABSENT_MODULES"
# Paths of the image's filesystem a container may name; anything else absolute is refused.
IMAGE_ROOTS = ("/opt/phalanx", "/opt/venv", "/var/lib/phalanx", "/home/phalanx", "/tmp",
               "/dev/shm")
# What the base image sets before our ENV lines (Docker's default PATH).
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
# The base image's own directories (PATH entries and the like): the same here.
SYSTEM_ROOTS = ("/usr/", "/bin", "/sbin", "/lib", "/etc/", "/proc/", "/sys/", "/dev/null")


def stages(path: Path = DEPLOY / "Dockerfile") -> dict[str, tuple[str, list]]:
    """``path``'s build stages in order: name -> (what it is ``FROM``, its instructions)."""
    found: dict[str, tuple[str, list]] = {}
    for c in dockerfile.parse_file(str(path)):
        if c.cmd == "FROM":
            assert len(c.value) == 3 and c.value[1].upper() == "AS", \
                f"{path.name}: every stage is named (FROM image AS name): {c.original}"
            found[c.value[2]] = (c.value[0], [])
        elif found:
            list(found.values())[-1][1].append(c)
    return found


@functools.cache
def outside(requirements: tuple[str, ...]) -> frozenset[str]:
    """The top-level modules installed here that a virtualenv holding only
    ``requirements`` (with what they require), phalanx and :data:`VENV_SEED` lacks."""
    need = {canonicalize_name(n) for n in ("phalanx", *VENV_SEED)}
    todo = [r for r in map(Requirement, requirements)
            if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in need:
            continue
        need.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{name} (required by the image) is not installed here: "
                                 "the stand-in cannot tell what the image holds") from None
        extras = {"", *requirement.extras}
        todo += [r for r in map(Requirement, requires)
                 if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras)]
    return frozenset(module for module, dists in importlib.metadata.packages_distributions()
                     .items() if not any(canonicalize_name(d) in need for d in dists))


@dataclasses.dataclass(frozen=True)
class Image:
    """The run-time half of one ``deploy/Dockerfile`` target (by default the last stage,
    which ``docker build`` builds without ``--target``)."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    workdir: str
    env: dict[str, str]
    user: str
    absent: frozenset[str] = frozenset()
    """Top-level modules installed here that the image does not hold."""

    @classmethod
    def parse(cls, target: str | None = None, path: Path = DEPLOY / "Dockerfile") -> Image:
        found = stages(path)
        target = target or list(found)[-1]
        assert target in found, f"{path.name} has no stage {target!r} ({list(found)})"
        chain: list[list] = []  # the target's instructions, its parent stages' first
        stage: str | None = target
        while stage in found:
            parent, commands = found[stage]
            chain.insert(0, commands)
            stage = parent
        entrypoint: tuple[str, ...] = ()
        cmd: tuple[str, ...] = ()
        workdir, user, env = "/", "root", {}
        for c in (c for commands in chain for c in commands):
            if c.cmd == "ENTRYPOINT":
                assert c.json, "ENTRYPOINT in exec form (a shell form ignores signals)"
                entrypoint = c.value
            elif c.cmd == "CMD":
                assert c.json, "CMD in exec form"
                cmd = c.value
            elif c.cmd == "WORKDIR":
                workdir = os.path.join(workdir, c.value[0])
            elif c.cmd == "USER":
                user = c.value[0]
            elif c.cmd == "ENV":
                pairs = c.value
                for key, value in zip(pairs[::2], pairs[1::2], strict=True):
                    assert '"' not in value and "'" not in value, f"ENV {key}: no quotes"
                    # $VAR from the image so far, else the base image's
                    env[key] = re.sub(r"\$\{?(\w+)\}?",
                                      lambda m: env.get(m[1], BASE_ENV.get(m[1], "")), value)
        absent = frozenset()
        if target in SLIM_TARGETS:
            requirements = subprocess.run(
                [sys.executable, str(DEPLOY / "requirements.py"), str(REPO / "pyproject.toml")],
                capture_output=True, text=True, check=True).stdout.split("\n")
            absent = outside(tuple(r for r in requirements if r.strip()))
        return cls(entrypoint, cmd, workdir, env, user, absent)

    @classmethod
    def named(cls, reference: str) -> Image:
        """The image a deployment file's ``image:`` names (``name:tag``)."""
        name = reference.rsplit(":", 1)[0]
        assert name in TARGETS, f"{reference}: not an image deploy/Dockerfile builds"
        return cls.parse(TARGETS[name])


@dataclasses.dataclass
class Container:
    """What one container runs, as the deployment file says (container paths and hosts)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    mounts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Mount path in the container -> shared volume key."""
    ports: tuple[int, ...] = ()
    """Ports the container declares it listens on (compose ``expose``, ``containerPort``)."""
    absent: frozenset[str] = frozenset()
    """Modules installed here that the container's image does not hold (:attr:`Image.absent`)."""


class World:
    """The translation from the containers' world to this machine."""

    def __init__(self, root: Path, hosts: Mapping[str, str]) -> None:
        self.root = root
        self.hosts = dict(hosts)
        self.ports: dict[str, dict[int, int]] = {}
        """Container name -> its declared ports -> the local ports standing in for them."""

    def listen(self, container: Container) -> dict[int, int]:
        """The local ports of ``container``'s declared ports, a free one each (every
        container may listen on 9464 in its own network namespace; here they share one).
        ``<name>:<port>`` then reaches it, as a scrape target names it."""
        if container.name not in self.ports:
            self.ports[container.name] = {p: free_port() for p in container.ports}
            for port, local in self.ports[container.name].items():
                self.hosts[f"{container.name}:{port}"] = f"127.0.0.1:{local}"
        return self.ports[container.name]

    def rehost(self, text: str) -> str:
        """``text`` with other containers' host names and ports made local ones."""
        for host, local in self.hosts.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", local, text)
        return text

    def paths(self, container: Container) -> list[tuple[str, Path]]:
        mapped = [(mount, self.root / "volumes" / key) for mount, key in
                  container.mounts.items()]
        mapped += [("/opt/phalanx", REPO), ("/opt/venv", Path(sys.prefix))]
        own = self.root / "containers" / container.name
        mapped += [(p, own / p.strip("/").replace("/", "-")) for p in IMAGE_ROOTS
                   if p not in ("/opt/phalanx", "/opt/venv")]
        # Longest first: a mount under /tmp wins over the container's own /tmp.
        return sorted(mapped, key=lambda pair: -len(pair[0]))

    def localize(self, container: Container, text: str) -> str:
        text = self.rehost(text)
        out = []
        # Only whole path components: "/tmp" in "/tmpfoo" or in a URL path is left alone.
        for piece in re.split(r"([:,= ])", text):
            if piece == "/":  # the container's root: a directory of its own
                piece = str(self.root / "containers" / container.name)
                Path(piece).mkdir(parents=True, exist_ok=True)
            elif piece.startswith("/") and not piece.startswith("//"):
                for prefix, local in self.paths(container):
                    if piece == prefix or piece.startswith(prefix + "/"):
                        local.mkdir(parents=True, exist_ok=True)
                        piece = str(local) + piece[len(prefix):]
                        break
                else:
                    if not piece.startswith(SYSTEM_ROOTS):
                        raise AssertionError(f"{container.name}: no translation for container "
                                             f"path {piece!r} (not in the image)")
            out.append(piece)
        return "".join(out)

    def process(self, container: Container) -> tuple[list[str], dict[str, str], Path]:
        """(argv, env, cwd) of the local process standing in for ``container``."""
        env = {k: self.localize(container, v) for k, v in container.env.items()}
        env.setdefault("HOME", self.localize(container, "/home/phalanx"))
        if env.get(metrics.PORT_ENV, "").strip():
            port, ports = int(env[metrics.PORT_ENV]), self.listen(container)
            assert port in ports, (f"{container.name}: {metrics.PORT_ENV}={port}, a port the "
                                   f"container does not declare ({sorted(ports)})")
            env[metrics.PORT_ENV] = str(ports[port])
        argv = [self.localize(container, a) for a in container.argv]
        cwd = Path(self.localize(container, container.workdir))
        if container.absent:  # importing what the image lacks fails, as in the image
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(BLOCKER), env.get("PYTHONPATH")) if p)
            env[BLOCKED_ENV] = ",".join(sorted(container.absent))
        return argv, env, cwd


@dataclasses.dataclass
class Running:
    container: Container
    process: subprocess.Popen
    log: Path


class Processes:
    """Local processes standing in for containers; all stopped (TERM, then KILL) on exit."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.running: dict[str, Running] = {}

    def start(self, container: Container) -> Running:
        argv, env, cwd = self.world.process(container)
        log = self.world.root / "logs" / f"{container.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            process = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=out, start_new_session=True)
        self.running[container.name] = Running(container, process, log)
        return self.running[container.name]

    def run(self, container: Container, timeout_s: float) -> subprocess.CompletedProcess:
        """Run a one-shot container to its end."""
        argv, env, cwd = self.world.process(container)
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)

    def exec(self, name: str, argv: list[str], timeout_s: float = 120.0,
             extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """``docker exec``: ``argv`` with the environment and working dir of container ``name``."""
        container = self.running[name].container
        command = dataclasses.replace(container, argv=argv)
        argv, env, cwd = self.world.process(command)
        return subprocess.run(argv, env={**env, **(extra_env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout_s)

    def alive(self, name: str) -> bool:
        return self.running[name].process.poll() is None

    def logs(self) -> str:
        """The tail of every process's log, for a failing assertion's message."""
        parts = []
        for name, r in self.running.items():
            lines = r.log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {name} (exit {r.process.poll()}) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        r = self.running[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.process.pid, signal.SIGTERM)
        try:
            return r.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.process.pid, signal.SIGKILL)
            return r.process.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.running)):
            if self.running[name].process.poll() is None:
                self.stop(name)


@contextlib.contextmanager
def processes(world: World) -> Iterator[Processes]:
    procs = Processes(world)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2,
             detail=lambda: ""):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` (and
    ``detail()``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: "
                                 f"{detail()}")
        time.sleep(interval_s)


def healthy_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


async def train(nats_url: str, spec_path: Path,
                host_env: dict) -> tuple[JobRecord, JobRecord, dict]:
    """Submit from the host (``phalanx submit``), follow the job to its end; returns the
    admitted record, the final one and each rank's last progress."""
    config = BusConfig.load(env={k: v for k, v in host_env.items()
                                 if k.startswith("PHALANX_NATS_")}, servers=nats_url)
    async with await Bus.connect(config) as bus:
        states: asyncio.Queue[JobRecord] = asyncio.Queue()
        last: dict[int, RankProgress] = {}

        async def on_state(record: JobRecord, _: Delivery) -> None:
            await states.put(record)

        async def on_progress(progress: RankProgress, _: Delivery) -> None:
            last[progress.rank] = progress

        await bus.subscribe(subjects.job_states(), JobRecord, on_state)
        await bus.subscribe(subjects.health_ranks(), RankProgress, on_progress)
        submitted = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "phalanx.services.cli", "submit",
                             str(spec_path), "--json", "--nats", nats_url],
            capture_output=True, text=True, timeout=60, env=host_env)
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]

        admitted: list[JobRecord] = []

        async def finished() -> JobRecord:
            while True:
                record = await states.get()
                if record.job_id == job_id and record.state is JobState.ADMITTED:
                    admitted.append(record)
                if record.job_id == job_id and record.state.terminal:
                    return record

        final = await asyncio.wait_for(finished(), 240)
        assert admitted, f"{job_id} ended without being admitted: {final.reason}"
        return admitted[0], final, last

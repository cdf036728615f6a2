"""`phalanx up --secure` as a user runs it: TLS, every process as its own identity, on a
bus of three servers whose routes are mutual TLS with the routes' secret.

Marked slow: it starts a whole local cluster. A job runs to completion with its
ranks as the job's identity (the agents launch them with it; a refused rank would
never report, and its job would never finish); a viewer's cancel is refused; a
rank holds nothing of its agent's credentials and may publish nothing of another
job's or of the services'; a job's identity is revoked when the job ends; and no
seed appears in any log, rank log, job record or command output.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from e2e_cli import phalanx

from phalanx.bus.client import Bus
from phalanx.bus.config import CREDENTIAL_VARS, BusConfig
from phalanx.bus.errors import BusUnavailable
from phalanx.schemas import subjects
from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.roles import Role
from phalanx.services.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_finished(job_id: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    """Poll the job's record as a user would (the CLI has no wait verb) until it finished."""
    deadline = time.monotonic() + 60
    while True:
        job = phalanx("job", job_id, "--json", "--data-dir", str(data_dir))
        if json.loads(job.stdout)["state"] == "finished":
            return job
        assert time.monotonic() < deadline, job.stdout
        time.sleep(0.5)


def test_a_secured_cluster_runs_a_job_refuses_a_viewer_and_logs_no_secret(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    # Its bus a cluster of three servers, routed over mutual TLS with the routes' secret.
    outputs = [phalanx("up", "--secure", "--nats-cluster", "3", "--agents", "2", "--detach",
                       "--data-dir", str(data_dir), "--nats-port", str(free_port()))]
    auth = AuthDir(data_dir / "auth")
    job_seeds: list[str] = []  # a job's seed is deleted when it ends: read while it runs
    try:
        spec = tmp_path / "job.yaml"
        spec.write_text(
            "name: sec\nteam: t\npriority_class: normal\nreplicas: {min: 2, max: 2}\n"
            f"command: [python, {ROOT / 'examples' / 'progress_loop.py'}, --steps, '5', "
            f"--step-time, '0.02', --wait-for, {tmp_path / 'release'}]\n")
        outputs.append(phalanx("submit", str(spec), "--job-id", "sec-1", "--data-dir",
                               str(data_dir)))
        job_seeds.append(auth.seed_path(Role.RANK, "sec-1").read_text().strip())
        (tmp_path / "release").touch()
        outputs.append(wait_finished("sec-1", data_dir))

        viewer = {**os.environ, **auth.env(Role.VIEWER)}
        outputs.append(phalanx("jobs", "--json", "--data-dir", str(data_dir), env=viewer))
        # The replicas' logs come from the agents over the secured bus, to the viewer too.
        for env in (None, viewer):
            logs = phalanx("logs", "sec-1", "--data-dir", str(data_dir), env=env)
            outputs.append(logs)
            assert logs.stdout.count("=== phalanx: r") == 2 and not logs.stderr, logs
        refused = phalanx("cancel", "sec-1", "--data-dir", str(data_dir), env=viewer,
                          check=False)
        outputs.append(refused)
        assert refused.returncode == 1
        assert "refused this identity permission to publish to phalanx.admission.cancel" \
            in refused.stderr
        outputs += rank_holds_its_job_identity_alone(tmp_path, data_dir, auth, job_seeds)
    finally:
        outputs.append(phalanx("down", "--data-dir", str(data_dir)))

    assert not list(auth.ranks_dir.glob("*.nk")), "every job's identity went with the job"
    seeds = [path.read_text().strip() for path in (data_dir / "auth").rglob("*.nk")]
    assert len(seeds) == 6 + 2  # static roles, two agents
    seeds += job_seeds
    logs = [*(data_dir / "logs").glob("*.log"), *(data_dir / "agents").rglob("*.log")]
    assert any(p.parent.parent.name == "jobs" for p in logs)  # the replicas' own logs
    texts = [p.read_text(errors="replace") for p in logs]
    texts += [o.stdout + o.stderr for o in outputs]
    for seed in seeds:
        assert seed.startswith("SU")
        assert not any(seed in text for text in texts)
        assert not any(seed[2:20] in text for text in texts)  # nor a piece of one


def rank_holds_its_job_identity_alone(tmp_path: Path, data_dir: Path, auth: AuthDir,
                                      job_seeds: list[str]) -> list:
    """A rank started by agents that hold bus credentials: its environment names its
    job's identity and nothing of its agent's, the server refuses it every subject of
    another job and of the services, and the identity is revoked once the job ended."""
    forbidden = [subjects.health_rank("sec-1", 0), subjects.replica_ready("sec-1"),
                 subjects.job_state("sec-2"), subjects.job_fault("sec-2"),
                 subjects.admission_submit(), subjects.agent_launch("local-0"),
                 subjects.kv_key(subjects.JOBS_BUCKET, "sec-2")]
    allowed = subjects.health_rank("sec-2", 0)
    spec = tmp_path / "probe.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "probe", "team": "t", "priority_class": "normal",
        "replicas": {"min": 1, "max": 1},
        "command": ["python", str(ROOT / "tests" / "e2e" / "rank_probe.py"), *forbidden,
                    allowed]}))
    outputs = [phalanx("submit", str(spec), "--job-id", "sec-2", "--data-dir", str(data_dir))]
    seed_file = auth.seed_path(Role.RANK, "sec-2")
    kept = tmp_path / "revoked.nk"
    shutil.copy(seed_file, kept)
    job_seeds.append(kept.read_text().strip())
    public_key = auth.identity(Role.RANK, "sec-2").public_key
    outputs.append(wait_finished("sec-2", data_dir))

    (report,) = [json.loads(line) for log in (data_dir / "agents").glob("*/jobs/sec-2/*.log")
                 for line in log.read_text().splitlines() if line.startswith("{")]
    env = report["env"]
    assert env["PHALANX_NATS_NKEY"] == str(seed_file)
    assert env["PHALANX_NATS_INBOX_PREFIX"] == subjects.inbox("rank-sec-2")
    assert env["PHALANX_NATS_CA"] == str(auth.ca_path)
    assert set(env) & CREDENTIAL_VARS == {"PHALANX_NATS_NKEY", "PHALANX_NATS_INBOX_PREFIX"}
    assert not [name for name in env if name.startswith("PHALANX_AGENT_")]
    assert str(auth.replication_key_path) not in env.values()  # its agent's, not its own
    # Nothing leads to the agents' seeds or to another job's.
    assert not [v for v in env.values() if str(auth.root / "keys") in v
                or (str(auth.ranks_dir) in v and v != str(seed_file))]
    assert report["refused"] == {**dict.fromkeys(forbidden, True), allowed: False}

    # Revoked when the job ended: the seed, the user in the server's config, and the
    # server no longer lets anyone in with it.
    deadline = time.monotonic() + 20
    while seed_file.exists() or public_key in auth.config_path.read_text():
        assert time.monotonic() < deadline, "sec-2's identity outlived the job"
        time.sleep(0.2)
    assert "rank-sec-2" not in {who.name for who in auth.identities()}
    nats_url = json.loads((data_dir / "up.json").read_text())["nats_url"]

    async def connect(env: dict[str, str]) -> None:
        config = BusConfig.load(env=env, servers=nats_url, connect_timeout_s=2.0)
        await (await Bus.connect(config)).close()

    # (The server refuses the revoked key and closes the socket: nats-py reports the
    # refusal, or the closed socket as a broken pipe or a reset, whichever it meets first.)
    with pytest.raises(BusUnavailable,
                       match="Authorization Violation|Broken pipe|Connection reset by peer"):
        asyncio.run(connect({**auth.env(Role.VIEWER), "PHALANX_NATS_NKEY": str(kept),
                             "PHALANX_NATS_INBOX_PREFIX": subjects.inbox("rank-sec-2")}))
    asyncio.run(connect(auth.env(Role.VIEWER)))  # the same way in, as one not revoked
    return outputs

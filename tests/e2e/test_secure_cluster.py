"""`phalanx up --secure` as a user runs it: TLS, every process as its own identity.

Marked slow: it starts a whole local cluster. A job runs to completion with its
ranks as the job's identity (the agents launch them with it; a refused rank would
never report, and its job would never finish); a viewer's cancel is refused; and
no seed appears in any log, rank log, job record or command output.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from e2e_cli import phalanx
from test_local_cluster import free_port

from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.roles import Role

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_a_secured_cluster_runs_a_job_refuses_a_viewer_and_logs_no_secret(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    outputs = [phalanx("up", "--secure", "--agents", "2", "--detach", "--data-dir",
                       str(data_dir), "--nats-port", str(free_port()))]
    try:
        spec = tmp_path / "job.yaml"
        spec.write_text(
            "name: sec\nteam: t\npriority_class: normal\nreplicas: {min: 2, max: 2}\n"
            f"command: [python, {ROOT / 'examples' / 'progress_loop.py'}, --steps, '5', "
            "--step-time, '0.02']\n")
        outputs.append(phalanx("submit", str(spec), "--job-id", "sec-1", "--data-dir",
                               str(data_dir)))
        deadline = time.monotonic() + 60
        while True:  # the CLI has no wait verb: poll the record as a user would
            job = phalanx("job", "sec-1", "--json", "--data-dir", str(data_dir))
            if json.loads(job.stdout)["state"] == "finished":
                break
            assert time.monotonic() < deadline, job.stdout
            time.sleep(0.5)
        outputs.append(job)

        auth = AuthDir(data_dir / "auth")
        viewer = {**os.environ, **auth.env(Role.VIEWER)}
        outputs.append(phalanx("jobs", "--json", "--data-dir", str(data_dir), env=viewer))
        refused = phalanx("cancel", "sec-1", "--data-dir", str(data_dir), env=viewer,
                          check=False)
        outputs.append(refused)
        assert refused.returncode == 1
        assert "refused this identity permission to publish to phalanx.admission.cancel" \
            in refused.stderr
    finally:
        outputs.append(phalanx("down", "--data-dir", str(data_dir)))

    seeds = [path.read_text().strip() for path in (data_dir / "auth").rglob("*.nk")]
    assert len(seeds) == 6 + 2 + 1  # static roles, two agents, one job
    logs = [*(data_dir / "logs").glob("*.log"), *(data_dir / "agents").rglob("*.log")]
    assert any(p.parent.parent.name == "jobs" for p in logs)  # the replicas' own logs
    texts = [p.read_text(errors="replace") for p in logs]
    texts += [o.stdout + o.stderr for o in outputs]
    for seed in seeds:
        assert seed.startswith("SU")
        assert not any(seed in text for text in texts)
        assert not any(seed[2:20] in text for text in texts)  # nor a piece of one

"""`phalanx up / nodes / down` as a user runs them, on real processes.

Marked slow: each test starts a whole local cluster (NATS + agents).
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path

import pytest
from e2e_cli import phalanx

from phalanx.services.agent.cpus import shares
from phalanx.services.cluster import pid_alive
from phalanx.services.manifest import MANIFEST, running_in_manifest
from phalanx.services.ports import free_port

LOST_AFTER_S = 1.5


def nodes(data_dir: Path) -> dict[str, dict]:
    out = phalanx("nodes", "--json", "--data-dir", str(data_dir),
                  "--lost-after", str(LOST_AFTER_S)).stdout
    return {n["node_id"]: n for n in json.loads(out)}


def kill_and_wait(pid: int, timeout_s: float) -> None:
    """SIGKILL ``pid`` through a pidfd (no pid-reuse race) and wait until it is gone."""
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        assert select.select([fd], [], [], timeout_s)[0], f"pid {pid} still alive"
    finally:
        os.close(fd)



@pytest.fixture
def cluster(tmp_path: Path):
    data_dir = tmp_path / "cluster"
    out = phalanx("up", "--agents", "2", "--detach", "--data-dir", str(data_dir),
                  "--nats-port", str(free_port()), "--heartbeat-interval", "0.2",
                  "--lost-after", str(LOST_AFTER_S))
    assert "local cluster running" in out.stdout
    state = json.loads((data_dir / "up.json").read_text())
    yield data_dir, state
    phalanx("down", "--data-dir", str(data_dir))


def test_up_nodes_kill_agent_lost_then_down_leaves_nothing(cluster) -> None:
    data_dir, state = cluster
    listed = nodes(data_dir)
    assert sorted(listed) == ["local-0", "local-1"]
    assert all(n["state"] == "alive" and n["slots"] == 2 for n in listed.values())
    assert {n["failure_domain"] for n in listed.values()} == {"domain-0", "domain-1"}

    assert "cordoned" in phalanx("node", "cordon", "local-0", "--data-dir", str(data_dir)).stdout
    assert nodes(data_dir)["local-0"]["cordoned"] is True
    phalanx("node", "uncordon", "local-0", "--data-dir", str(data_dir))
    assert nodes(data_dir)["local-0"]["cordoned"] is False
    missing = phalanx("node", "cordon", "nope", "--data-dir", str(data_dir), check=False)
    assert missing.returncode == 1 and "no node 'nope'" in missing.stderr

    victim = listed["local-1"]["agent_pid"]
    assert victim == state["agents"]["local-1"]
    kill_and_wait(victim, 10)
    just_after = nodes(data_dir)["local-1"]
    if just_after["state"] == "alive":
        # Not lost before its timeout; lost once the timeout has passed.
        time.sleep(LOST_AFTER_S - just_after["heartbeat_age_s"] + 0.3)
    after = nodes(data_dir)
    assert after["local-1"]["state"] == "lost"
    assert after["local-1"]["heartbeat_age_s"] > LOST_AFTER_S
    assert after["local-0"]["state"] == "alive"

    down = phalanx("down", "--data-dir", str(data_dir))
    assert "stopped the local cluster" in down.stdout
    pids = [state["pid"], state["nats_pid"], *state["agents"].values()]
    assert not [p for p in pids if pid_alive(p)]
    assert not (data_dir / "up.json").exists()
    assert "nothing to stop" in phalanx("down", "--data-dir", str(data_dir)).stdout


def test_second_up_is_refused_clearly(cluster, tmp_path: Path) -> None:
    data_dir, state = cluster
    again = phalanx("up", "--agents", "1", "--detach", "--data-dir", str(data_dir),
                    "--nats-port", "0", check=False)
    assert again.returncode == 1
    assert f"already runs from {data_dir} (pid {state['pid']}" in again.stderr

    port = state["nats_url"].rsplit(":", 1)[1]
    busy = phalanx("up", "--agents", "1", "--detach", "--data-dir", str(tmp_path / "other"),
                   "--nats-port", port, check=False)
    assert busy.returncode == 1
    assert "address already in use" in busy.stderr and port in busy.stderr
    assert not (tmp_path / "other" / "up.json").exists()


def test_nodes_without_a_cluster_says_what_is_missing(tmp_path: Path) -> None:
    result = phalanx("nodes", "--data-dir", str(tmp_path), "--nats",
                     f"nats://127.0.0.1:{free_port()}", check=False)
    assert result.returncode == 1
    assert "cannot reach NATS" in result.stderr and "phalanx up" in result.stderr


def test_readme_flow_second_job_waits_with_reason_until_first_is_cancelled(cluster) -> None:
    data_dir, _ = cluster
    examples = Path(__file__).resolve().parents[2] / "examples"
    where = ("--data-dir", str(data_dir))
    small = json.loads(phalanx("submit", str(examples / "small.yaml"), "--json", *where).stdout)
    big = json.loads(phalanx("submit", str(examples / "big.yaml"), "--json", *where).stdout)
    assert small["state"] == big["state"] == "pending"

    def explain(job: str) -> dict:
        return json.loads(phalanx("explain", job, "--json", *where).stdout)

    why = explain(big["job_id"])
    while why["reason_code"] == "queued":  # the first pass after the submit has not run yet
        why = explain(big["job_id"])
    assert why["state"] == "pending" and why["position"] == 1
    assert why["reason_code"] == "reserved" and "needs 4 replica(s)" in why["reason"]
    assert explain(small["job_id"])["state"] == "admitted"

    assert "cancelled" in phalanx("cancel", small["job_id"], *where).stdout
    state = explain(big["job_id"])
    while state["state"] == "pending":
        state = explain(big["job_id"])
    assert state["state"] == "admitted" and len(state["nodes"]) == 4
    listed = {j["job_id"]: j for j in json.loads(phalanx("jobs", "--json", *where).stdout)}
    assert listed[small["job_id"]]["state"] == "cancelled"
    assert listed[big["job_id"]]["state"] == "admitted"

    bad = phalanx("submit", str(examples / "small.yaml"), "--job-id", "has.dot", *where,
                  check=False)
    assert bad.returncode == 2 and "job_id" in bad.stderr


def test_a_service_that_cannot_start_fails_up_naming_it_and_its_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    out = phalanx("up", "--agents", "1", "--detach", "--data-dir", str(data_dir),
                  "--nats-port", "0", check=False,
                  env={**os.environ, "PHALANX_ADMISSION_LEASE_S": "soon"})
    assert out.returncode != 0
    # The exit itself is the error, with the service's own words: not a wait for a leader.
    assert "admission exited with 2 while the cluster started" in out.stderr, out.stderr
    assert "admission.lease_s must be a number, got 'soon'" in out.stderr, out.stderr
    assert "no admission leader" not in out.stderr
    assert not (data_dir / "up.json").exists()


def test_a_pinned_agents_ranks_run_on_cpus_of_their_own(tmp_path: Path) -> None:
    """`phalanx up --pin-cpus`: the agent on its share of the machine's CPUs (here all of
    them), and each rank it starts on its slot's share of those, as the processes
    themselves show."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to share out")
    data_dir = tmp_path / "cluster"
    where = ("--data-dir", str(data_dir))
    phalanx("up", "--agents", "1", "--slots-per-agent", "2", "--pin-cpus", "--detach",
            "--nats-port", str(free_port()), *where)
    try:
        agent = json.loads((data_dir / "up.json").read_text())["agents"]["local-0"]
        assert os.sched_getaffinity(agent) == allowed
        spec = tmp_path / "sleeper.yaml"
        spec.write_text("name: sleeper\nteam: t\npriority_class: normal\n"
                        "replicas: {min: 2, max: 2}\ncommand: [sleep, '300']\n")
        job = json.loads(phalanx("submit", str(spec), "--json", *where).stdout)["job_id"]
        manifest = data_dir / "agents" / "local-0" / MANIFEST
        deadline = time.monotonic() + 30
        while len(ranks := running_in_manifest(manifest)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the agent writes its manifest as each rank starts
        assert len(ranks) == 2, f"ranks not started in 30 s: {ranks}"
        pinned = sorted(sorted(os.sched_getaffinity(rank["pid"])) for rank in ranks)
        assert pinned == [list(share) for share in shares(sorted(allowed), 2)]
        phalanx("cancel", job, *where)
    finally:
        phalanx("down", *where)


def test_an_agent_tees_its_ranks_lines_and_rotates_their_logs(tmp_path: Path) -> None:
    """``agent.tee_rank_output``: each line a rank prints shows in its agent's output as
    ``<job>/<replica> | <line>``; past ``agent.rank_log_max_bytes`` the rank's log is kept
    as ``.log.1`` and emptied, and the rank's lines go on into it."""
    data_dir = tmp_path / "cluster"
    where = ("--data-dir", str(data_dir))
    phalanx("up", "--agents", "1", "--detach", "--nats-port", str(free_port()), *where,
            env={**os.environ, "PHALANX_AGENT_TEE_RANK_OUTPUT": "1",
                 "PHALANX_AGENT_RANK_LOG_MAX_BYTES": "4000"})
    try:
        spec = tmp_path / "printer.yaml"
        spec.write_text(
            "name: printer\nteam: t\npriority_class: normal\nreplicas: {min: 1, max: 1}\n"
            "command: [python, -c, \"import time\\nfor i in range(400):\\n"
            "    print(f'line {i:04d}', flush=True); time.sleep(0.005)\"]\n")
        job = json.loads(phalanx("submit", str(spec), "--json", *where).stdout)["job_id"]
        agent_log = data_dir / "logs" / "agent-local-0.log"
        deadline = time.monotonic() + 60
        while f"{job}/r0-0 | line 0399" not in agent_log.read_text(errors="replace"):
            assert time.monotonic() < deadline, agent_log.read_text(errors="replace")[-2000:]
            time.sleep(0.2)
        teed = [line.split(" | ", 1)[1] for line in agent_log.read_text().splitlines()
                if line.startswith(f"{job}/r0-0 | line ")]
        assert teed == [f"line {i:04d}" for i in range(400)]
        logs = data_dir / "agents" / "local-0" / "jobs" / job
        kept = (logs / "r0-0.log.1").read_text()
        assert kept.startswith("=== phalanx: r0-0")  # the first 4000 bytes and more
        assert "line 0399" in kept + (logs / "r0-0.log").read_text()
    finally:
        phalanx("down", *where)

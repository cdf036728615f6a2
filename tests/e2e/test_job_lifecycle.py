"""Jobs that end honestly, through the ``phalanx`` command line on a local cluster.

The everyday mistakes of issue 11: a command that does not exist, a script that raises,
a script that dies at exit after its training completed, and faults injected with
``phalanx chaos`` — each must end the job the way its restart policy says, with the
reason where the user looks (``phalanx job``, ``phalanx logs``), its slots freed, and
no node cordoned for what was not the node's fault. And what the CLI says of a job
is what happened (issue 24): its history's resume steps are those in the ranks' own
records, an ended job places no replicas, and the commands after ``phalanx up`` find
its cluster without ``--data-dir``.

Marked slow: a whole local cluster (NATS, services, two agents), one for the module's tests
(each a few seconds of CPU to start): each test's jobs end, or it cancels them, and a test
that gets a node cordoned uncordons it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_cli import phalanx

from phalanx.runtime import record
from phalanx.services.manifest import running_in_manifest
from phalanx.services.ports import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WIDTHS = "8,16,8"



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """Two agents of two slots; health cordons a node at its first fault, so a fault
    that is charged to a node shows at once."""
    data_dir = tmp_path_factory.mktemp("cluster")
    env = {**os.environ, "PHALANX_HEALTH_CORDON_FAULTS": "1"}
    phalanx("up", "--agents", "2", "--detach", "--data-dir", str(data_dir),
            "--nats-port", str(free_port()), "--heartbeat-interval", "0.2",
            "--lost-after", "3", env=env)
    yield ("--data-dir", str(data_dir)), data_dir
    phalanx("down", "--data-dir", str(data_dir))


@pytest.fixture(scope="module")
def mlp_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny data set of ``train_mlp.py`` (WIDTHS, 256 samples), for the tests that train."""
    data = tmp_path_factory.mktemp("data")
    subprocess.run([sys.executable, str(EXAMPLES / "train_mlp.py"), "--prepare", "--data-dir",
                    str(data), "--widths", WIDTHS, "--samples", "256"], check=True)
    return data


def submit(where: tuple[str, ...], tmp_path: Path, name: str, command: list[str],
           replicas: int = 4, extra: str = "") -> str:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(f"name: {name}\nteam: t\npriority_class: normal\n"
                    f"replicas: {{min: {replicas}, max: {replicas}}}\n"
                    f"command: {json.dumps(command)}\n{extra}")
    return json.loads(phalanx("submit", str(spec), "--json", *where).stdout)["job_id"]


def job(where: tuple[str, ...], job_id: str) -> dict:
    return json.loads(phalanx("job", job_id, "--json", *where).stdout)


def until(where: tuple[str, ...], job_id: str, states: set[str], timeout_s: float = 60) -> dict:
    """The job's record once it is in one of ``states``."""
    deadline = time.monotonic() + timeout_s
    while (row := job(where, job_id))["state"] not in states:
        assert time.monotonic() < deadline, f"{job_id} still {row['state']}: {row['reason']}"
        time.sleep(0.2)
    return row


def rank_pid(agent_dir: Path, job_id: str, rank: int, timeout_s: float = 60,
             other_than: int | None = None) -> int:
    """The pid of the job's ``rank`` on that agent's node, once the agent started it (one
    other than ``other_than``: a rank started again)."""
    deadline = time.monotonic() + timeout_s
    while not (pids := [r["pid"] for r in running_in_manifest(agent_dir / "ranks.json")
                        if r["job_id"] == job_id and r["rank"] == rank
                        and r["pid"] != other_than]):
        assert time.monotonic() < deadline, f"rank {rank} of {job_id} never started"
        time.sleep(0.2)
    return pids[0]


def nodes(where: tuple[str, ...]) -> dict[str, dict]:
    return {n["node_id"]: n for n in json.loads(phalanx("nodes", "--json", *where).stdout)}


def test_a_missing_command_fails_the_job_with_the_agents_error_and_frees_its_slots(
        cluster, tmp_path: Path) -> None:
    where, _ = cluster
    job_id = submit(where, tmp_path, "nocmd", ["pythn", "train.py"])
    started = time.monotonic()
    row = until(where, job_id, {"failed", "finished", "cancelled"})
    print(f"failed {time.monotonic() - started:.1f} s after submit")
    assert row["state"] == "failed" and row["reason_code"] == "launch_failed", row
    assert "cannot start pythn train.py" in row["reason"]
    assert "No such file or directory" in row["reason"]
    assert row["nodes"] == []
    logs = phalanx("logs", job_id, *where).stdout
    assert "cannot start pythn train.py" in logs and "No such file or directory" in logs
    # Its four slots are free: a job that needs all of them is admitted.
    next_job = submit(where, tmp_path, "next", [sys.executable, str(EXAMPLES / "progress_loop.py"),
                                                "--steps", "5", "--step-time", "0.1"])
    assert until(where, next_job, {"admitted", "finished"})["state"] in {"admitted", "finished"}
    assert not any(n["cordoned"] for n in nodes(where).values())


def test_an_exception_fails_the_job_with_its_last_line_and_cordons_nothing(
        cluster, tmp_path: Path) -> None:
    where, _ = cluster
    script = tmp_path / "raises.py"
    script.write_text(
        "import os, time\n"
        "from phalanx.runtime.progress import ProgressReporter\n"
        "reporter = ProgressReporter.from_env()\n"
        "for step in range(1, 1000):\n"
        "    time.sleep(0.05)\n"
        "    reporter.report(step, 0.05)\n"
        "    if step == 5 and os.environ['PHALANX_RANK'] == '0':\n"
        "        raise RuntimeError('loss is nan at step 5')\n")
    job_id = submit(where, tmp_path, "raises", [sys.executable, str(script)], replicas=2,
                    extra="restart_policy: {max_app_failures: 0}\n")
    row = until(where, job_id, {"failed", "finished", "cancelled"})
    assert row["state"] == "failed" and row["reason_code"] == "app_failed", row
    # The rank's error as its log ends, on the reason's first line too (one-line views).
    last = phalanx("logs", job_id, "--rank", "0", *where).stdout.rstrip().splitlines()[-1]
    assert last == "RuntimeError: loss is nan at step 5"
    first, *output = row["reason"].splitlines()
    # The first line stands alone: the error, then the policy's verdict.
    assert last in first and first.endswith("(application failure 1, max_app_failures 0)")
    assert output[0] == "its last output:" and output[-1] == last
    assert row["replicas"] == 0
    assert not any(n["cordoned"] for n in nodes(where).values())


def test_a_torchrun_gang_whose_rank_fails_starts_again_whole_as_torchrun_would(
        cluster, tmp_path: Path) -> None:
    # A plain torchrun script, no phalanx in it: r1-0 fails before its init_process_group,
    # where r0-0 waits for it. The whole gang starts again (r0-1, r1-1), on a rendezvous
    # of its own, and its all-reduce sees both ranks.
    where, _ = cluster
    script = tmp_path / "gang.py"
    script.write_text(
        "import os, sys\n"
        "import torch, torch.distributed as dist\n"
        "if os.environ['PHALANX_REPLICA_ID'] == 'r1-0':\n"
        "    sys.exit('r1-0 fails before its init_process_group')\n"
        "dist.init_process_group('gloo')\n"
        "total = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(total)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: {int(total)}', flush=True)\n"
        "dist.destroy_process_group()\n")
    job_id = submit(where, tmp_path, "gang", [sys.executable, str(script)], replicas=2)
    row = until(where, job_id, {"failed", "finished", "cancelled"}, timeout_s=120)
    assert row["state"] == "finished", row
    for rank in (0, 1):
        log = phalanx("logs", job_id, "--replica", f"r{rank}-1", *where).stdout
        assert f"rank {rank} of 2: 3" in log, log
    assert "of 2" not in phalanx("logs", job_id, "--replica", "r0-0", *where).stdout


def test_a_gang_that_fails_again_before_any_step_fails_after_its_restarts(
        cluster, tmp_path: Path) -> None:
    # Rank 1 fails at every start: the gang starts again once (max_app_failures 1), then
    # the job fails with the rank's error, as a crash loop.
    where, _ = cluster
    script = tmp_path / "loop.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['PHALANX_RANK'] == '1':\n"
                      "    sys.exit('rank 1 cannot start')\n"
                      "time.sleep(600)\n")
    job_id = submit(where, tmp_path, "loop", [sys.executable, str(script)], replicas=2)
    row = until(where, job_id, {"failed", "finished", "cancelled"}, timeout_s=120)
    assert row["state"] == "failed" and row["reason_code"] == "app_failed", row
    assert row["reason"].splitlines()[0].startswith("r1-1 on "), row["reason"]
    assert "(application failure 2, max_app_failures 1)" in row["reason"]
    assert "rank 1 cannot start" in row["reason"]


def test_a_rank_dying_after_its_last_step_finishes_the_job(cluster, tmp_path: Path) -> None:
    """As a script that never closes its session does when gloo times out at exit."""
    where, _ = cluster
    script = tmp_path / "dies_at_exit.py"
    script.write_text(
        "import os, time\n"
        "from phalanx.runtime.progress import ProgressReporter\n"
        "reporter = ProgressReporter.from_env()\n"
        "for step in range(1, 11):\n"
        "    time.sleep(0.05)\n"
        "    reporter.report(step, 0.05, final=step == 10)\n"
        "reporter.close()\n"
        "if os.environ['PHALANX_RANK'] != '0':\n"
        "    time.sleep(1)\n"
        "    os.abort()\n")
    job_id = submit(where, tmp_path, "dies", [sys.executable, str(script)], replicas=2)
    row = until(where, job_id, {"failed", "finished", "cancelled"})
    assert row["state"] == "finished", row
    assert row["reason"] == "training completed at step 10"
    assert not any(n["cordoned"] for n in nodes(where).values())


def test_chaos_kills_never_cordon_while_the_same_kill_from_elsewhere_does(
        cluster, tmp_path: Path) -> None:
    where, data_dir = cluster
    job_id = submit(where, tmp_path, "target", [sys.executable, str(EXAMPLES / "progress_loop.py"),
                                                "--step-time", "0.1"], replicas=4)
    try:  # the module's next tests get the cluster whole, whatever fails here
        placed = until(where, job_id, {"admitted"})["nodes"]
        chaos_slot = placed.index("local-0")
        other_slot = placed.index("local-1")
        # The ranks started first (admitted is before started): a kill-rank before its
        # rank runs is refused (404).
        rank_pid(data_dir / "agents" / "local-0", job_id, chaos_slot)
        first = rank_pid(data_dir / "agents" / "local-1", job_id, other_slot)
        phalanx("chaos", "kill-rank", job_id, str(chaos_slot), *where)
        # The gang starts again after the kill: the same signal, sent by something that is
        # not phalanx chaos (say the OOM killer), to local-1's rank of the new gang (one
        # of the old gang's would be stopping already, and its exit no fault).
        outside = rank_pid(data_dir / "agents" / "local-1", job_id, other_slot,
                           other_than=first)
        os.kill(outside, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not nodes(where)["local-1"]["cordoned"]:  # health heard both kills, in order
            assert time.monotonic() < deadline, "the SIGKILL from outside was never charged"
            time.sleep(0.2)
        assert nodes(where)["local-0"]["cordoned"] is False
    finally:
        phalanx("cancel", job_id, *where)
        phalanx("node", "uncordon", "local-1", *where)


def test_a_replacement_that_raises_again_fails_the_job_after_max_app_failures(
        cluster, mlp_data: Path, tmp_path: Path) -> None:
    """Under the runtime a failed replica is replaced; an application failure that its
    replacement repeats is not retried forever: the job ends failed with the exception."""
    where, _ = cluster
    script = tmp_path / "slot1_raises.py"
    script.write_text(
        "import os, sys, torch\n"
        "from phalanx.examples import workload_w\n"
        "from phalanx.runtime import ElasticSession, MemmapDataset\n"
        "torch.set_num_threads(1)\n"
        f"dataset = MemmapDataset({str(mlp_data)!r})\n"
        f"model = workload_w.build_model(({WIDTHS}), 0)\n"
        "optimizer = workload_w.build_optimizer(model)\n"
        "with ElasticSession.from_env(model, optimizer, dataset, global_batch=32,\n"
        "                             micro_batch_size=8, seed=0) as session:\n"
        "    for step in session.steps(100000):\n"
        "        if os.environ['PHALANX_RANK'] == '1' and step.index >= 3:\n"
        "            raise RuntimeError(f'{os.environ[\"PHALANX_REPLICA_ID\"]} diverged')\n"
        "        for inputs, targets in step:\n"
        "            step.backward(torch.nn.functional.mse_loss(model(inputs), targets))\n"
        "        step.commit()\n")
    job_id = submit(where, tmp_path, "again", [sys.executable, str(script)], replicas=2,
                    extra="restart_policy: {max_app_failures: 1}\n")
    row = until(where, job_id, {"failed", "finished", "cancelled"}, timeout_s=180)
    assert row["state"] == "failed" and row["reason_code"] == "app_failed", row
    # The replacement (incarnation 1 of slot 1) failed the same way as the first.
    assert "RuntimeError: r1-1 diverged" in row["reason"], row["reason"]
    assert "max_app_failures 1" in row["reason"]
    logs = phalanx("logs", job_id, "--replica", "r1-0", *where).stdout
    assert "RuntimeError: r1-0 diverged" in logs
    assert not any(n["cordoned"] for n in nodes(where).values())


def test_the_history_says_what_the_ranks_resumed_after(
        cluster, mlp_data: Path, tmp_path: Path) -> None:
    """Issue 24: the CLI showed elasticity's estimate when it decided (step 1) where the
    ranks resumed after step 19. Compared here with the ranks' own records."""
    rec = tmp_path / "rec"
    command = [sys.executable, str(EXAMPLES / "train_mlp.py"), "--data-dir", str(mlp_data),
               "--widths", WIDTHS, "--samples", "256", "--global-batch", "32",
               "--micro-batch", "8", "--steps", "40"]
    env = {"PHALANX_RECORD_DIR": str(rec), "PHALANX_CHAOS_KILL": "r1-0:20:boundary"}
    spec = tmp_path / "resume.yaml"
    spec.write_text("name: resume\nteam: t\npriority_class: normal\n"
                    "replicas: {min: 1, max: 2}\n"
                    f"command: {json.dumps(command)}\nenv: {json.dumps(env)}\n")
    # Submitted, watched and read without --data-dir: `phalanx up` left where it is.
    job_id = json.loads(phalanx("submit", str(spec), "--json").stdout)["job_id"]
    row = until((), job_id, {"failed", "finished", "cancelled"}, timeout_s=120)
    assert row["state"] == "finished", row
    assert row["replicas"] == 0
    resumed = {}  # generation -> the step its members resumed after, by their records
    for lines in record.read(rec).values():
        for line in lines:
            if line["kind"] == "generation":
                assert resumed.setdefault(line["generation"], line["resume"]) \
                    == line["resume"], line
    history = {g["generation"]: g for g in row["history"]}
    assert resumed.get(1, 0) >= 19, resumed  # r1-0 died at step 20: a fault generation
    reported = {g: h["resume_step"] for g, h in history.items()
                if h["resume_source"] == "members"}
    assert 1 in reported
    assert reported == {g: resumed[g] for g in reported}, (reported, resumed)

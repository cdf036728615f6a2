"""The durable checkpoint tier end to end: everything restarted, the job resumed from storage.

A 2-replica job of ``examples/train_mlp.py`` on a local cluster (2 agents x 1
slot: one rank, one shard per node; more ranks would write more shards of the same
kind, each rank a torch process of seconds of CPU, and prove nothing more) persists
every ``EVERY``-th step to the cluster's default durable root
(``<data dir>/checkpoints``). Once a few durable steps are committed its ranks are
frozen, the job is cancelled and the whole cluster stops (``phalanx down``):
ranks, agents, services and the bus, so no memory holds the job's state any more.
Bytes are flipped on disk in one shard of the newest committed step. The cluster
comes back (``phalanx up``, same data dir) and the job is submitted again with
``phalanx submit FILE --resume JOB``.
The new job must detect the damaged step, skip it, report it (its record and
the catalog), restore the step before it from storage and train to the end:
parameters and every step's loss equal to the fault-free run (deterministic
mode), no step lost beyond the damaged step and the durable interval. The
restored step, exported with ``phalanx ckpt export``, loads with plain
``torch.distributed.checkpoint`` in a process that imports nothing from phalanx,
equal to the fault-free run stopped at that step; the resumed job's last step is
persisted before its ranks exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml
from e2e_cli import next_of, phalanx
from test_elastic import (  # the e2e helpers of the elastic tests: same cluster, same job
    ARGS,
    ORDER,
    RUN_ENV,
    SCRIPT,
    FaultFreeRuns,
    watched_cluster,
)

from phalanx.runtime import record
from phalanx.schemas import subjects
from phalanx.schemas.messages import JobState, SnapshotRecord, SnapshotTier
from phalanx.services.manifest import running_in_manifest

pytestmark = pytest.mark.timeout(480)  # two clusters, one after the other
STEPS = 200  # the run alone is the checkpoint and cluster-restart tests' too
EVERY = 20  # durable_every_steps
PERSISTED = 3  # durable_keep; everything stops once step PERSISTED * EVERY is persisted
OLD, NEW = "durable-1", "durable-2"
REPLICAS = 2  # on 2 agents x 1 slot
ONE_SLOT = ("--slots-per-agent", "1")
SCHEDULE = ["--schedule"]


def spec_file(path: Path, data_dir: Path, out: Path,
              hang_timeout_s: float = 2.0, args: Sequence[str] = ()) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "durable", "team": "t", "priority_class": "normal",
        "replicas": {"min": 2, "max": 4},
        "command": [sys.executable, str(SCRIPT), "--data-dir", str(data_dir), *ARGS, *SCHEDULE,
                    *args, "--steps", str(STEPS), "--save", str(out / "final.pt")],
        "env": {"PHALANX_RECORD_DIR": str(out / "rec"), **RUN_ENV},
        "hang_timeout_s": hang_timeout_s, "grace_period_s": 3.0,
        "checkpoint": {"durable_every_steps": EVERY, "durable_keep": PERSISTED}}))
    return path


def committed(root: Path) -> list[int]:
    """The job's committed durable steps on storage, newest first."""
    return sorted((int(d.name.split("-")[1]) for d in root.glob("step-*")
                   if (d / ".phalanx-commit").exists()), reverse=True)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for at in range(len(data) // 2, len(data) // 2 + 8):
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


PLAIN_LOAD = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = dcp.FileSystemReader(sys.argv[1]).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    state["extra.scheduler.last_epoch"] = -1
    state["phalanx.step"] = -1
    dcp.load(state, checkpoint_id=sys.argv[1], no_dist=True)
    assert not [m for m in sys.modules if m.split(".")[0] == "phalanx"], "phalanx imported"
    torch.save({k.removeprefix("model."): v for k, v in state.items()}, sys.argv[2])
""")


# Sharded: each rank persists its share and the optimizer entries it alone holds; the step
# is the consolidated state, loaded into new owners. Both with what a real loop steps
# after each commit (an LR schedule, an EMA, a counter: the durable step holds them as
# the script left them). The runs alone are the plain optimizer's, made once for both
# cases: a sharded AdamW makes the same updates, bitwise.
@pytest.mark.parametrize("args", [[], ["--sharded-optimizer"]], ids=["plain", "sharded"])
async def test_everything_restarted_the_job_resumes_from_durable_storage(
        data_dir: Path, fault_free_runs: FaultFreeRuns, tmp_path: Path,
        args: list[str]) -> None:
    reference = fault_free_runs(STEPS, SCHEDULE)
    cluster_dir = tmp_path / "cluster"
    where = ("--data-dir", str(cluster_dir))
    old_out, new_out = tmp_path / "old", tmp_path / "new"
    storage = cluster_dir / "checkpoints" / OLD

    # 1. The job trains and persists; then the whole machine stops: every rank frozen at
    # once (the job would finish in seconds otherwise), the job cancelled, then phalanx
    # down kills the rest.
    async with watched_cluster(cluster_dir, *ONE_SLOT) as (_, bus, watch):
        frozen: list[int] = []

        async def on_snapshot(announced: SnapshotRecord, _) -> None:
            if announced.tier is SnapshotTier.DURABLE and announced.step >= PERSISTED * EVERY \
                    and not frozen:
                for manifest in cluster_dir.glob("agents/*/ranks.json"):
                    for rank in running_in_manifest(manifest):  # the agents' own list
                        os.kill(rank["pid"], signal.SIGSTOP)
                        frozen.append(rank["pid"])
                stopped.set()

        stopped = asyncio.Event()
        await bus.subscribe(subjects.ckpt_snapshot(OLD), SnapshotRecord, on_snapshot)
        phalanx("submit", str(spec_file(tmp_path / "old.yaml", data_dir, old_out, 120.0,
                                        args)),
                "--job-id", OLD, *where)
        await asyncio.wait_for(stopped.wait(), 240)
        assert len(frozen) == REPLICAS, frozen
        # Cancelled before the cluster stops: a job still admitted when it comes back
        # resumes by itself (test_cluster_restart), and on a loaded machine it once
        # committed three more steps before a cancel sent after the restart, which
        # pruned the step this test resumes from (durable_keep).
        phalanx("cancel", OLD, *where)
    before = committed(storage)
    trained = max(s.step for s in record.timeline(record.read(old_out / "rec")))
    assert before[0] < STEPS, "the job finished before the cluster stopped"
    # A rank skips a durable step while its previous write is still under way (logged: a
    # loaded machine), so the committed steps may have a gap; two are what the rest needs.
    assert len(before) >= 2 and all(step % EVERY == 0 for step in before), before
    # Only what the durable interval implies is lost (plus one write still under way).
    assert trained + 1 - before[0] < 2 * EVERY, (trained, before)

    # 2. The newest committed step is damaged on disk.
    [newest] = storage.glob(f"step-{before[0]:010d}-*")
    flip(newest / "__1_0.distcp")

    # 3. Everything comes back; the job is submitted again, resuming the old one.
    async with watched_cluster(cluster_dir, *ONE_SLOT) as (_, bus, watch):
        phalanx("submit", str(spec_file(tmp_path / "new.yaml", data_dir, new_out,
                                        args=args)),
                "--job-id", NEW, "--resume", OLD, *where)
        ended = await next_of(watch.states, lambda r: r.job_id == NEW and r.state.terminal,
                              300)
        assert ended.state is JobState.FINISHED, ended.reason
        listed = json.loads(phalanx("ckpt", "ls", OLD, "--json", *where).stdout)
        # The step before the damaged one as a plain DCP checkpoint (the damaged one refused).
        exported = tmp_path / "export"
        phalanx("ckpt", "export", OLD, str(before[1]), str(exported), *where)
        refused = phalanx("ckpt", "export", OLD, str(before[0]), str(tmp_path / "bad"),
                          *where, check=False)
        assert refused.returncode != 0 and "checksum mismatch" in refused.stderr
    resumed_from = before[1]
    records = record.read(new_out / "rec")
    restores = [line for lines in records.values() for line in lines
                if line["kind"] == "restore"]
    assert restores and {(r["tier"], r["step"]) for r in restores} == {
        ("durable", resumed_from)}, restores
    corrupt = [line for lines in records.values() for line in lines
               if line["kind"] == "corrupt"]
    assert corrupt and {(c["tier"], c["step"]) for c in corrupt} == {
        ("durable", before[0])}, corrupt
    assert all("__1_0.distcp" in c["problem"] for c in corrupt), corrupt
    # The catalog lists the damaged step's copy as corrupt.
    flagged = {row["step"] for row in listed for c in row["copies"] if c["corrupt"]}
    assert before[0] in flagged, listed

    # Every step after the restored one trained exactly once, as the run alone did.
    steps = record.timeline(records)
    assert [s.step for s in steps] == list(range(resumed_from, STEPS))
    torch.testing.assert_close(
        torch.tensor([s.loss for s in steps], dtype=torch.float64),
        torch.tensor(reference["loss"][resumed_from:], dtype=torch.float64),
        rtol=1e-5, atol=1e-7)
    assert record.verify(records, ORDER, STEPS) == [
        f"steps never committed: {list(range(resumed_from))[:10]}"]
    # Leaving waited for the last durable write: the job's final step is persisted.
    assert committed(cluster_dir / "checkpoints" / NEW)[0] == STEPS
    params = torch.load(new_out / "final.pt")
    for name, value in reference["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7)

    # 4. The restored step as exported, read by torch alone.
    subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(exported), str(tmp_path / "m.pt")],
                   check=True, timeout=120, cwd=tmp_path)
    at_step = fault_free_runs(resumed_from, [*SCHEDULE, "--schedule-steps", str(STEPS)])
    loaded = torch.load(tmp_path / "m.pt")
    # The step as the script left it after that step's commit: the schedule stepped too.
    assert loaded.pop("phalanx.step") == resumed_from
    assert loaded.pop("extra.scheduler.last_epoch") == resumed_from
    assert int(at_step["params"]["scheduler.last_epoch"]) == resumed_from
    model = {k: v for k, v in at_step["params"].items() if k.split(".")[0].isdigit()}
    assert set(loaded) == set(model)
    for name, value in model.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)

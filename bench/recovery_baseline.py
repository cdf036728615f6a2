"""The baseline half of the recovery benchmark: torchrun restarting DDP from a DCP checkpoint.

:func:`run_baseline` runs ``bench/torchrun_worker.py`` under ``torch.distributed.run``
(``world`` CPU ranks on one node, gloo, c10d rendezvous, ``--max-restarts 1``):
plain DDP training of workload W or the GPT example (the worker's options, passed
through) with a DCP checkpoint every ``ckpt_every`` steps.
On the first attempt one rank SIGKILLs itself at ``kill_step`` (``kill_phase``
``between`` steps or mid gradient ``allreduce``; see the worker's docstring);
torchrun tears the group down, restarts it, and the new workers resume from the
last complete checkpoint. The workers' JSON-line records are then turned into the
downtime, the steps redone and a breakdown of the restart; ``bench/recovery.py``
compares that with phalanx's checkpointless recovery. :func:`run_fault_free` runs
the same workers without a fault or a checkpoint and gives the median step time:
the plain DDP loop the runtime's step-time cost is measured against.

Run directly, it prints progress and one JSON object as the last line::

    python bench/recovery_baseline.py --widths 1024,2048,2048,2048,2048,1024 \\
        --steps 30 --kill-step 20 --kill-phase allreduce
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from phalanx.examples import workload_w
from phalanx.services.ports import free_port

BENCH_DIR = Path(__file__).resolve().parent
WORKER = BENCH_DIR / "torchrun_worker.py"

KILL_PHASES = ("between", "allreduce")  # see bench/torchrun_worker.py
# Set in the environment of torchrun and so of all its workers, to find them all.
RUN_MARKER = "BASELINE_RUN"
# Restart phases recorded by the worker, in order, and the breakdown entry each one ends.
RESTART_PHASES = (("start", "detect_and_restart"), ("torch", "import_torch"),
                  ("imported", "import_other"), ("process_group", "process_group"),
                  ("built", "build"), ("loaded", "dcp_load"))


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds ``marker`` (``NAME=value``).

    That is how torchrun's workers are found: each runs in a session of its own,
    and may have been orphaned by a torchrun that died or was killed.
    """
    entry = marker.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if entry in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


def torchrun(*, steps: int, worker_args: list[str], work_dir: Path, world: int,
             ckpt_every: int, timeout_s: float, kill: str | None) -> int:
    """Run the workers once under torchrun (one restart allowed); torchrun's exit status.

    ``work_dir`` is emptied and receives ``ckpt/``, ``records/rank-<r>.jsonl`` and
    ``torchrun.log``. ``kill``: the workers' ``BASELINE_KILL``, or None.

    Raises:
        TimeoutError: torchrun did not finish within ``timeout_s`` (it and all its
            workers are killed first; they are killed after a normal exit too).
    """
    work_dir = Path(work_dir)
    shutil.rmtree(work_dir, ignore_errors=True)
    record_dir, ckpt_dir, log = work_dir / "records", work_dir / "ckpt", work_dir / "torchrun.log"
    record_dir.mkdir(parents=True)
    run_id = f"{os.getpid()}-{time.time_ns()}"
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", str(world),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-id", f"baseline-{run_id}", "--max-restarts", "1",
        str(WORKER), *worker_args, "--steps", str(steps), "--ckpt-dir", str(ckpt_dir),
        "--record-dir", str(record_dir), "--ckpt-every", str(ckpt_every),
    ]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           RUN_MARKER: run_id}
    if kill is not None:
        env["BASELINE_KILL"] = kill
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"torchrun ran over {timeout_s} s; see {log}") from None
        finally:
            process.kill()
            process.wait()
            kill_marked(f"{RUN_MARKER}={run_id}")


def run_baseline(*, steps: int, kill_step: int, kill_phase: str, worker_args: list[str],
                 work_dir: Path, world: int = 4, ckpt_every: int = 10,
                 timeout_s: float = 600, kill_rank: int = 1) -> dict[str, Any]:
    """Run the torchrun baseline once, with one fault, and measure its recovery.

    ``worker_args``: the workload's options for ``bench/torchrun_worker.py`` (its
    ``--workload`` and the workload's own, its data prepared), all but ``--steps``.
    ``work_dir`` as for :func:`torchrun`. Returns the dict described by
    :func:`analyse`, plus ``returncode`` (torchrun's), ``wall_s`` and ``log`` (the
    log's path).

    Raises:
        TimeoutError: torchrun did not finish within ``timeout_s``.
        RuntimeError: the records show no fault or no restart.
    """
    if not 1 <= kill_step <= steps:
        raise ValueError(f"kill_step must be in 1..{steps}, got {kill_step}")
    if kill_phase not in KILL_PHASES:
        raise ValueError(f"kill_phase must be one of {KILL_PHASES}, got {kill_phase!r}")
    started = time.time()
    returncode = torchrun(steps=steps, worker_args=worker_args, work_dir=work_dir, world=world,
                          ckpt_every=ckpt_every, timeout_s=timeout_s,
                          kill=f"{kill_rank}:{kill_step}:{kill_phase}")
    result = analyse(read_records(Path(work_dir) / "records"), steps)
    return {**result, "returncode": returncode, "ok": result["ok"] and returncode == 0,
            "wall_s": time.time() - started, "log": str(Path(work_dir) / "torchrun.log")}


def cpu_per_step(per_rank: Iterable[Iterable[tuple[int, float]]]) -> float:
    """The median CPU seconds a rank's process spent on a step.

    ``per_rank``: for each rank, ``(step, the process's CPU time at its commit)``; the
    growth between two consecutive steps of the same rank is one step's cost.
    """
    costs = []
    for commits in per_rank:
        ordered = sorted(commits)
        costs += [b[1] - a[1] for a, b in itertools.pairwise(ordered) if b[0] == a[0] + 1]
    return statistics.median(costs)


def peak_rss_kb(pid: int | str = "self") -> int | None:
    """A process's peak resident memory in KiB (``VmHWM``); None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in status.splitlines()
                 if line.startswith("VmHWM:")), None)


def run_fault_free(*, steps: int, worker_args: list[str], work_dir: Path, skip: int,
                   world: int = 4, timeout_s: float = 600) -> dict[str, Any]:
    """The plain loop's median step time, CPU per step and memory: no fault, no checkpoint.

    ``step_s``: the median gap between consecutive commits (a step's commit: its last
    rank's ``step`` record); ``cpu_s``: :func:`cpu_per_step`; the first ``skip``
    steps left out of both (start-up, first allocations); ``peak_rss_kb``: each rank's
    peak resident memory (:func:`peak_rss_kb` at its end), ascending.

    Raises:
        TimeoutError: torchrun did not finish within ``timeout_s``.
        RuntimeError: torchrun failed.
    """
    returncode = torchrun(steps=steps, worker_args=worker_args, work_dir=work_dir, world=world,
                          ckpt_every=0, timeout_s=timeout_s, kill=None)
    if returncode != 0:
        raise RuntimeError(f"torchrun exited {returncode}; see {Path(work_dir) / 'torchrun.log'}")
    commits: dict[int, float] = defaultdict(float)
    cpu: dict[int, list[tuple[int, float]]] = defaultdict(list)
    records = read_records(Path(work_dir) / "records")
    for r in records:
        if r["phase"] == "step" and r["step"] > skip:
            commits[r["step"]] = max(commits[r["step"]], r["t"])
            cpu[r["rank"]].append((r["step"], r["process_cpu_s"]))
    ordered = [commits[step] for step in sorted(commits)]
    return {"step_s": statistics.median(b - a for a, b in itertools.pairwise(ordered)),
            "cpu_s": cpu_per_step(cpu.values()),
            "peak_rss_kb": sorted(r["peak_rss_kb"] for r in records if r["phase"] == "done")}


def read_records(record_dir: Path) -> list[dict[str, Any]]:
    """All the workers' records, each with its ``rank`` added."""
    records = []
    for path in sorted(record_dir.glob("rank-*.jsonl")):
        rank = int(path.stem.removeprefix("rank-"))
        records += [{**json.loads(line), "rank": rank}
                    for line in path.read_text().splitlines() if line.strip()]
    return records


def analyse(records: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Recovery figures from the workers' records of a run with one fault and one restart.

    A step's commit time is the latest ``step`` record of it over the ranks, in the
    latest attempt that committed it. Returns (times in seconds):

    * ``median_step_s``: the median gap between consecutive commits before the fault;
    * ``downtime_s``: the longest gap between the commits of consecutive steps
      (i.e. from the last step kept by the checkpoint to the first step after
      the restart) minus ``median_step_s``: how much later training gets
      anywhere than without the fault, lost work included;
    * ``stall_s``: from the last commit before the fault to the first commit
      after the restart, minus ``median_step_s``: the downtime without the
      lost work;
    * ``last_committed_before_fault``, ``resumed_from_step`` (the checkpoint's
      step; the restart runs the step after it), ``steps_redone`` (committed
      before the fault and run again), ``final_step``, ``ok`` (``final_step`` >= ``steps``);
    * ``breakdown``: from the kill to the first commit after the restart, in
      consecutive phases of the restarted attempt (each phase ends when its last
      rank reaches it; they sum to kill -> first commit): ``detect_and_restart``
      (kill to the new processes' first statement), ``import_torch``,
      ``import_other`` (the worker's other imports: ``torch.distributed``,
      workload W, phalanx), ``process_group`` (gloo process group, i.e. the workers'
      rendezvous), ``build`` (model, DDP, optimizer), ``dcp_load``, ``first_step``;
    * ``kill``: the fault's record (rank, step, time, and for ``allreduce`` the
      bucket and whether its all-reduce was in flight);
    * ``attempts``: how many attempts recorded anything.

    Raises:
        RuntimeError: no fault, or no restart, in the records.
    """
    kills = [r for r in records if r["phase"] == "kill"]
    if not kills:
        raise RuntimeError("no rank recorded a kill: the fault was not injected")
    kill = kills[0]
    restart = max(r["attempt"] for r in records)
    if restart == 0:
        raise RuntimeError("no restarted attempt in the records")

    commits: dict[int, dict[int, float]] = defaultdict(dict)
    for r in records:
        if r["phase"] == "step":
            by_attempt = commits[r["step"]]
            by_attempt[r["attempt"]] = max(by_attempt.get(r["attempt"], 0.0), r["t"])
    commit_time = {step: by_attempt[max(by_attempt)] for step, by_attempt in commits.items()}
    before = sorted(step for step, by_attempt in commits.items() if 0 in by_attempt)
    last_before = before[-1] if before else 0
    median_step = statistics.median(
        commits[step][0] - commits[step - 1][0] for step in before if step - 1 in before)

    ordered = sorted(commit_time)
    downtime = max(commit_time[b] - commit_time[a] for a, b in itertools.pairwise(ordered))
    phase_end = {phase: max(r["t"] for r in records
                            if r["phase"] == phase and r["attempt"] == restart)
                 for phase, _ in RESTART_PHASES}
    resumed_from = min(r["step"] for r in records
                       if r["phase"] == "loaded" and r["attempt"] == restart)
    first_commit = commits[resumed_from + 1][restart]
    breakdown, previous = {}, kill["t"]
    for phase, name in RESTART_PHASES:
        breakdown[name] = phase_end[phase] - previous
        previous = phase_end[phase]
    breakdown["first_step"] = first_commit - previous

    final_step = max(commit_time)
    return {
        "downtime_s": downtime - median_step,
        "stall_s": first_commit - commits[last_before][0] - median_step,
        "median_step_s": median_step,
        "steps_redone": max(0, last_before - resumed_from),
        "last_committed_before_fault": last_before,
        "resumed_from_step": resumed_from,
        "breakdown": breakdown,
        "final_step": final_step,
        "ok": final_step >= steps,
        "kill": {k: v for k, v in kill.items() if k != "phase"},
        "attempts": restart + 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=lambda s: tuple(int(w) for w in s.split(",")),
                        default=workload_w.W_WIDTHS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--kill-phase", choices=KILL_PHASES, default="allreduce")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--data-dir", type=Path, help="default: a temporary directory")
    parser.add_argument("--work-dir", type=Path, help="default: a temporary directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="recovery-baseline-") as tmp:
        print(f"torchrun baseline: {args.world} ranks, widths {args.widths}, "
              f"{args.steps} steps, rank {args.kill_rank} killed at step {args.kill_step} "
              f"({args.kill_phase})", flush=True)
        data_dir = args.data_dir or Path(tmp) / "data"
        workload_w.prepare(data_dir, args.samples, args.widths)
        result = run_baseline(
            steps=args.steps, kill_step=args.kill_step, kill_phase=args.kill_phase,
            worker_args=["--widths", ",".join(map(str, args.widths)), "--samples",
                         str(args.samples), "--data-dir", str(data_dir)],
            work_dir=args.work_dir or Path(tmp) / "work", world=args.world,
            ckpt_every=args.ckpt_every, timeout_s=args.timeout, kill_rank=args.kill_rank)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Recovery after SIGKILL of 1 of 4 ranks on W: phalanx in process vs torchrun from a checkpoint.

For each kill phase (mid gradient all-reduce, and between steps) ``--repeat``
runs of phalanx and one of the baseline, one after the other on the same
machine; the targets must hold in every phalanx run:

* **phalanx**: ``examples/train_mlp.py`` as a 4-replica elastic job on a
  local cluster (``phalanx up``); replica ``r1-0`` SIGKILLs itself at step
  ``--kill-step``. The survivors continue on 3, the replacement joins when it
  is ready. From the replicas' records and the bus: survivor downtime (the
  longest gap between committed steps around the fault minus the median step
  time; the gaps up to the replacement's join, which has its own figure),
  steps lost or redone, the pause the survivors see when the replacement
  joins, and the recovery's phases (detect: kill → fault event; decide:
  fault → generation; rebuild: process group; state copy; resume: to the
  next commit).
* **baseline**: torchrun + DDP + a DCP checkpoint every 10 steps, restarted
  after the same kill (:mod:`recovery_baseline`).

Prints one JSON object as its last line and appends the figures to
bench/RESULTS.md::

    python bench/recovery.py                      # W, 4 ranks, 3 runs per phase
    python bench/recovery.py --widths 256,512,256 --steps 60   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "examples"))

import recovery_baseline  # noqa: E402
import workload_w  # noqa: E402
from results import append, utc_date  # noqa: E402

from phalanx.bus.client import Bus, Delivery  # noqa: E402
from phalanx.bus.config import BusConfig  # noqa: E402
from phalanx.runtime import record  # noqa: E402
from phalanx.runtime.data import ElasticOrder  # noqa: E402
from phalanx.schemas import subjects  # noqa: E402
from phalanx.schemas.messages import (  # noqa: E402
    Fault,
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient  # noqa: E402

SCRIPT = BENCH.parent / "examples" / "train_mlp.py"


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args], check=True,
                   capture_output=True, timeout=120)


async def run_phalanx(args: argparse.Namespace, phase: str, work: Path) -> dict[str, Any]:
    """One elastic run with a self-kill of r1-0; its figures from records and bus events."""
    cluster = work / "cluster"
    rec = work / "records"
    cli("up", "--agents", "2", "--slots-per-agent", "2", "--detach", "--data-dir", str(cluster),
        "--nats-port", "0")
    url = json.loads((cluster / "up.json").read_text())["nats_url"]
    events: dict[str, list] = {"fault": [], "generation": []}
    try:
        async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
            done = asyncio.Event()

            async def on_fault(fault: Fault, _: Delivery) -> None:
                events["fault"].append((time.time(), fault))

            async def on_generation(g: Generation, _: Delivery) -> None:
                events["generation"].append((time.time(), g))

            async def on_state(r: JobRecord, _: Delivery) -> None:
                if r.state.terminal:
                    done.set()

            await bus.subscribe(subjects.job_events("fault"), Fault, on_fault)
            await bus.subscribe(subjects.job_events("generation"), Generation, on_generation)
            await bus.subscribe(subjects.job_states(), JobRecord, on_state)
            kill = f"r1-0:{args.kill_step}:{'allreduce' if phase == 'allreduce' else 'boundary'}"
            spec = JobSpec(
                name="w", team="bench", priority_class="normal",
                replicas=ReplicaRange(min=2, max=4),
                command=[sys.executable, str(SCRIPT), "--data-dir", str(args.data_dir),
                         "--widths", args.widths, "--samples", str(args.samples),
                         "--steps", str(args.steps)],
                env={"PHALANX_RECORD_DIR": str(rec), "PHALANX_CHAOS_KILL": kill},
                hang_timeout_s=10.0, grace_period_s=5.0)
            await AdmissionClient(bus).submit(spec, f"w-{phase}")
            await asyncio.wait_for(done.wait(), args.timeout)
    finally:
        cli("down", "--data-dir", str(cluster))
    return analyse_phalanx(record.read(rec), events, args)


def analyse_phalanx(records: dict[str, list[dict]], events: dict[str, list],
                    args: argparse.Namespace) -> dict[str, Any]:
    steps = record.timeline(records)
    problems = record.verify(records, ElasticOrder(args.samples, workload_w.W_GLOBAL_BATCH),
                             args.steps)
    kill_t = next(line["t"] for line in records["r1-0"] if line["kind"] == "chaos")
    join = next((g for _, g in events["generation"] if g.reason is GenerationReason.JOIN), None)
    joined = [] if join is None else [
        line for lines in records.values() for line in lines
        if line["kind"] == "generation" and line["generation"] == join.generation]
    join_at = min(a["received"] for a in joined) if joined else None
    gap, median = record.downtime(steps, kill_t, until=join_at)
    fault_t, _ = events["fault"][0]
    fault_gen_t, fault_gen = next((t, g) for t, g in events["generation"]
                                  if g.reason is GenerationReason.FAULT)
    applied = [line for lines in records.values() for line in lines
               if line["kind"] == "generation" and line["generation"] == fault_gen.generation]
    resumed = min(s.committed_at for s in steps if s.committed_at > kill_t
                  and s.generation >= fault_gen.generation)
    result: dict[str, Any] = {
        "downtime_s": gap - median, "longest_gap_s": gap, "median_step_s": median,
        "steps_lost_or_redone": sum("repeated or skipped" in p for p in problems)
                                + sum("never committed" in p for p in problems),
        "exactly_once": not problems, "problems": problems,
        "breakdown": {
            "detect": fault_t - kill_t,
            "decide": fault_gen_t - fault_t,
            "rebuild": max(a["built"] - a["received"] for a in applied),
            "state_copy": max(a["synced"] - a["built"] for a in applied),
            "resume": resumed - max(a["synced"] for a in applied),
        },
        "final_step": steps[-1].step + 1 if steps else 0,
    }
    if join_at is not None:
        join_gap, join_median = record.downtime(steps, join_at)
        result["join_pause_s"] = join_gap - join_median
        result["join_pause_steps"] = (join_gap - join_median) / join_median if join_median \
            else None
        result["join_state_bytes"] = max(a["state_bytes"] for a in joined)
        result["join_breakdown"] = {
            "rebuild": max(a["built"] - a["received"] for a in joined),
            "state_copy": max(a["synced"] - a["built"] for a in joined)}
    return result


def run_baseline(args: argparse.Namespace, phase: str, work: Path) -> dict[str, Any]:
    result = recovery_baseline.run_baseline(
        steps=args.baseline_steps, kill_step=args.kill_step, kill_phase=phase,
        widths=tuple(int(w) for w in args.widths.split(",")), samples=args.samples,
        data_dir=args.data_dir, work_dir=work, timeout_s=args.timeout)
    # The same measure as phalanx's: the longest gap between commits minus the median step
    # (the restart stall); the redone steps are counted apart.
    return {"downtime_s": result["stall_s"], "downtime_incl_redone_s": result["downtime_s"],
            "median_step_s": result["median_step_s"], "steps_lost_or_redone":
            result["steps_redone"], "breakdown": result["breakdown"], "ok": result["ok"]}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    widths = tuple(int(w) for w in args.widths.split(","))
    workload_w.prepare(args.data_dir, args.samples, widths)
    report: dict[str, Any] = {"date": utc_date(), "command": " ".join(sys.argv),
                              "widths": args.widths, "kill_step": args.kill_step, "runs": {}}
    for phase in args.phases.split(","):
        ours = []
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(args.repeat):
                ours.append(await run_phalanx(args, phase, Path(tmp) / f"phalanx-{n}"))
                shutil.rmtree(Path(tmp) / f"phalanx-{n}", ignore_errors=True)
                print(json.dumps({phase: {"phalanx": ours[-1]}}), flush=True)
            base = run_baseline(args, phase, Path(tmp) / "baseline")
        ratios = [o["downtime_s"] / base["downtime_s"] if base["downtime_s"] > 0 else None
                  for o in ours]
        # A missing figure (no baseline stall, no join) counts as 99: a miss.
        summary = {name: {"median": statistics.median(values), "worst": max(values)}
                   for name, values in (
                       ("downtime_s", [o["downtime_s"] for o in ours]),
                       ("ratio", [r if r is not None else 99 for r in ratios]),
                       ("join_pause_steps", [o.get("join_pause_steps") or 99 for o in ours]))}
        targets = {  # judged on the worst run
            "downtime <= 10% of baseline": summary["ratio"]["worst"] <= 0.10,
            "downtime < 1 s": summary["downtime_s"]["worst"] < 1.0,
            "0 steps lost": all(o["steps_lost_or_redone"] == 0 for o in ours),
            "join pause <= 1 step": summary["join_pause_steps"]["worst"] <= 1.0}
        report["runs"][phase] = {"phalanx": ours, "baseline": base, "ratios": ratios,
                                 "targets": targets, "summary": summary}
        print(json.dumps({phase: {"baseline": base, "targets": targets}}), flush=True)
    report["pass"] = all(all(r["targets"].values()) for r in report["runs"].values())
    return report


def record_results(report: dict[str, Any]) -> None:
    rows, summaries = [], []
    for phase, r in report["runs"].items():
        b = r["baseline"]
        for n, (p, ratio) in enumerate(zip(r["phalanx"], r["ratios"], strict=True)):
            bd = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in p["breakdown"].items())
            copy = p.get("join_breakdown", {}).get("state_copy", float("nan"))
            rows.append(
                f"| {phase} #{n + 1} | {p['downtime_s']:.3f} | {p['steps_lost_or_redone']} | "
                f"{p.get('join_pause_s', float('nan')):.3f} "
                f"({p.get('join_pause_steps') or float('nan'):.2f} steps; copy "
                f"{copy * 1000:.0f} ms) | "
                f"{b['downtime_s']:.2f} ({b['downtime_incl_redone_s']:.2f} incl. redone) | "
                f"{b['steps_lost_or_redone']} | {ratio or float('nan'):.3f} | {bd} |")
        summaries.append(f"{phase}: " + ", ".join(
            f"{name} median {v['median']:.3f} worst {v['worst']:.3f}"
            for name, v in r["summary"].items()))
    verdicts = "; ".join(f"{phase}: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}"
                                                   for k, v in r["targets"].items())
                         for phase, r in report["runs"].items())
    append(f"\n## recovery.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
           f"W widths {report['widths']}, 4 ranks, SIGKILL of one rank at step "
           f"{report['kill_step']}; baseline: torchrun + DDP + DCP every 10 steps, one run "
           "per phase; the targets are judged on every phalanx run.\n\n"
           "| kill | phalanx downtime (s) | phalanx steps lost | join pause (s) | "
           "baseline downtime (s) | baseline steps redone | ratio | phalanx breakdown |\n"
           "|---|---:|---:|---|---|---:|---:|---|\n" + "\n".join(rows)
           + f"\n\nAcross runs: {'; '.join(summaries)}.\n\nResult: {verdicts}.\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)))
    parser.add_argument("--samples", type=int, default=64 * 40)
    parser.add_argument("--steps", type=int, default=70, help="phalanx run length")
    parser.add_argument("--baseline-steps", type=int, default=30)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--phases", default="allreduce,between")
    parser.add_argument("--repeat", type=int, default=3, help="phalanx runs per phase")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "phalanx-bench-w")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("PHALANX_HEALTH_CORDON_FAULTS", "1000")
    report = asyncio.run(run(args))
    if not args.no_record:
        record_results(report)
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

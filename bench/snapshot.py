"""What the in-memory snapshot costs a step on W: step time without snapshots, with one
every step and with the adaptive interval, in one run, next to the bound a memcpy of the
bytes per step sets.

* **Step time**: ``examples/train_mlp.py`` on W as a 4-replica job on a local cluster
  (``phalanx up``, 2 agents x 2 slots; ``--agents`` and ``--slots`` change that: on the
  2-core test machine 4 ranks oversubscribe the cores, and a run's own step time drifted
  by up to 11 % within it; 2 x 1 stayed within 2 % inside a run, but its runs a minute
  apart still differed by up to 11 %: bench/RESULTS.md, 2026-11-28), with
  ``checkpoint.memory_every_steps`` 0 (no
  snapshot), 1 (every committed step) and ``auto`` (the default: the interval the ranks
  agree on to keep a snapshot's cost in the training thread within
  ``checkpoint.memory_overhead``, 2 %, of the training time), ``--repeat`` rounds; per
  run the mean gap between consecutive committed steps (the replicas' records: what the
  job pays, the steps a snapshot delays included; a median would leave out the one step
  in k that takes auto's snapshot), the first ``--warmup`` steps left out. A round is a
  palindrome, off, auto, every, auto, off (:data:`ROUND`): each mode's runs are centred
  on the same moment, so a load that drifts through the round falls alike on every
  mode's mean, and each round judges auto against the off runs around it. Overhead of a
  round = the mode's mean / off's mean - 1; the target (auto <= 3 %) holds in every
  round. Runs of one mode differ by more than that, on the 2-core test machine and on a
  16-CPU one alike, ranks pinned or not (up to 22 %: bench/RESULTS.md, 2026-11-28), so
  each run is also judged within itself (:func:`step_gaps`): its mean step over the
  mean of the steps no snapshot precedes (``in_run``).
  Beside it, from the commit records: the median time of a
  rank's snapshot in the training thread (``snapshot_s``: state views, meta, copy,
  checksum, the announcement handed to the bus thread), the interval in force
  (``snapshot_every``), and the in-thread share the adaptive rule bounds (the snapshots'
  time over the steps' own time, every rank summed). The load average before each run
  says how busy the machine was.
* **Bound**: the bytes one rank snapshots per step (its 1/4 share of W's model and
  AdamW state, as ``runtime/snapshot.py`` lays it out), timed in this process: a plain
  ``memcpy`` of them (``torch`` copy into a preallocated buffer) and the runtime's own
  ``write_share`` (copy + xxh3-64 + header) into a buffer of the same size. Bound =
  write_share time / step time without snapshots.

* **Replication**: the modes with snapshots include buddy replication (the two agents,
  in two failure domains, are each other's buddy). Beside the step times, one rank's
  buffer sent to a buddy by the agents' replication code next to a plain TCP copy of the
  same bytes (:mod:`replication`, also runnable alone).

* **Recovery per source**, in the same run (unless ``--no-tiers``): ``bench/tiers.py``'s
  phases on the same W — every holder of the state lost at step 20, the state back from
  the nodes' own memory, from a buddy's replicas, from durable storage — next to torchrun
  restarting from a DCP checkpoint (each phase on its own fresh cluster; see tiers.py).

Prints one JSON object as its last line and appends the figures to bench/RESULTS.md::

    python bench/snapshot.py                 # W, 1 round of runs of 60 steps
    python bench/snapshot.py --repeat 3
    python bench/snapshot.py --widths 64,128,64 --steps 200 --repeat 3   # the tests' MLP
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from phalanx.bench import recovery, replication, tiers
from phalanx.bench.results import append, utc_date
from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.examples import workload_w
from phalanx.runtime import record
from phalanx.runtime.flat_state import flat_state
from phalanx.runtime.snapshot import write_share
from phalanx.schemas import environment, snapshot_file
from phalanx.schemas.messages import (
    CheckpointPolicy,
    JobSpec,
    JobState,
    ReplicaRange,
)

BENCH = Path(__file__).resolve().parent

SCRIPT = BENCH.parent / "examples" / "train_mlp.py"
#: The modes: name, checkpoint.memory_every_steps.
MODES: dict[str, int | Literal["auto"]] = {"off": 0, "every": 1, "auto": "auto"}
#: The runs of a round, in order: a palindrome, every mode's runs centred alike.
ROUND = ("off", "auto", "every", "auto", "off")
#: The most a round's adaptive interval may cost against its off runs.
TARGET = 0.03


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args], check=True,
                   capture_output=True, timeout=120)


async def step_time(bus: Bus, args: argparse.Namespace, work: Path, name: str,
                    every: int | Literal["auto"]) -> dict[str, Any]:
    """One run with ``checkpoint.memory_every_steps`` = ``every``: the mean seconds
    between committed steps (``step_s``: what the job pays, the steps that take a snapshot
    included); the median of the gaps no snapshot precedes (``plain_step_s``) and the
    run's own excess over it (``in_run``: mean / plain - 1); from the commit records the
    median time of a rank's snapshot (``snapshot_s``), the median interval in force and
    the in-thread share."""
    rec = work / name
    spec = JobSpec(
        name="w", team="bench", priority_class="normal",
        replicas=ReplicaRange(min=args.agents * args.slots, max=args.agents * args.slots),
        command=[sys.executable, str(SCRIPT), "--data-dir", str(args.data_dir),
                 "--widths", args.widths, "--samples", str(args.samples),
                 "--steps", str(args.steps)],
        env={environment.RECORD_DIR: str(rec)},
        checkpoint=CheckpointPolicy(memory_every_steps=every),
        hang_timeout_s=30.0, grace_period_s=5.0)
    ended = await recovery.run_job(bus, spec, name, args.timeout)
    if ended.state is not JobState.FINISHED:
        raise RuntimeError(f"{name} ended {ended.state.value}: {ended.reason}")
    records = record.read(rec)
    steps = [s for s in record.timeline(records) if s.step >= args.warmup]
    commits = [line for lines in records.values() for line in lines
               if line["kind"] == "commit" and line["step"] >= args.warmup]
    taken = [line["snapshot_s"] for line in commits if "snapshot_s" in line]
    trained = sum(line["compute_s"] + line["reduce_s"] + line["optimizer_s"]
                  for line in commits)
    intervals = [line["snapshot_every"] for line in commits if "snapshot_every" in line]
    return {**step_gaps(steps, {line["step"] for line in commits if "snapshot_s" in line}),
            "snapshot_s": statistics.median(taken) if taken else None,
            "interval": statistics.median(intervals) if intervals else None,
            "in_thread": sum(taken) / trained}


def step_gaps(steps: list[record.StepRecord],
              snapshotted: set[int]) -> dict[str, float | None]:
    """The mean gap between consecutive committed ``steps``, the mean of the gaps that
    follow a step without a snapshot (a snapshot after step k delays step k + 1), and the
    one's excess over the other (None with a snapshot after every step): what the
    snapshots cost the steps they delay, judged within one run, the same processes on the
    same memory (runs of one mode differed by up to 22 % on a 16-CPU machine:
    bench/RESULTS.md, 2026-11-28). Means, not medians, on both sides: an outlier falls on
    either kind of step alike, and a median of all the gaps would leave out the one in k
    that a snapshot delays. What is spread evenly over every step (the agents'
    replication, bounded by ``agent.replica_duty``) is not in it."""
    gaps = [(b.committed_at - a.committed_at, a.step) for a, b in itertools.pairwise(steps)]
    mean = statistics.fmean(gap for gap, _ in gaps)
    plain = [gap for gap, after in gaps if after not in snapshotted]
    if not plain:  # a snapshot after every step: nothing to hold it against
        return {"step_s": mean, "plain_step_s": None, "in_run": None}
    plain_mean = statistics.fmean(plain)
    return {"step_s": mean, "plain_step_s": plain_mean, "in_run": mean / plain_mean - 1}


def bound(widths: tuple[int, ...], world: int) -> dict[str, float]:
    """The bytes one of ``world`` ranks snapshots per step, and what copying them costs
    here."""
    torch.set_num_threads(1)
    model = workload_w.build_model(widths)
    optimizer = workload_w.build_optimizer(model)
    inputs = torch.randn(8, widths[0])
    torch.nn.functional.mse_loss(model(inputs), torch.randn(8, widths[-1])).backward()
    optimizer.step()  # the AdamW moments exist from here
    state = flat_state(model, optimizer, {}, 1)
    meta = pickle.dumps(state.meta)
    _, share = snapshot_file.share(state.total, 0, world)
    source = torch.empty(share, dtype=torch.uint8)
    target = torch.empty(share, dtype=torch.uint8)
    buffer = bytearray(snapshot_file.HEADER_BYTES + len(meta) + share)

    def best_of(fn: Callable[[], object], n: int = 7) -> float:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return {"state_bytes": state.total, "share_bytes": share,
            "memcpy_s": best_of(lambda: target.copy_(source)),
            "write_share_s": best_of(lambda: write_share(memoryview(buffer), state, meta,
                                                         "bench", 1, 0, 0, world))}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    widths = tuple(int(w) for w in args.widths.split(","))
    workload_w.prepare(args.data_dir, args.samples, widths)
    report: dict[str, Any] = {"date": utc_date(), "command": " ".join(sys.argv),
                              "widths": args.widths, "world_size": args.agents * args.slots,
                              "agents": args.agents, "steps": args.steps,
                              "cpus": os.cpu_count(), "pinned": args.pin_cpus,
                              "runs": {mode: [] for mode in MODES}}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "cluster"
        cli("up", "--agents", str(args.agents), "--slots-per-agent", str(args.slots),
            "--detach", "--data-dir", str(cluster), "--nats-port", "0",
            *(("--pin-cpus",) if args.pin_cpus else ()))
        try:
            url = json.loads((cluster / "up.json").read_text())["nats_url"]
            async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
                for n in range(args.repeat):
                    for k, mode in enumerate(ROUND):
                        load = os.getloadavg()[0]
                        run = await step_time(bus, args, Path(tmp), f"w-{mode}-{n}-{k}",
                                              MODES[mode])
                        run.update(load=load, round=n)
                        report["runs"][mode].append(run)
                        print(json.dumps({"mode": mode, **run}), flush=True)
        finally:
            cli("down", "--data-dir", str(cluster))
    report.update(bound(widths, report["world_size"]))
    report.update(await asyncio.to_thread(replication.measure, report["share_bytes"], 5))
    report["rounds"] = rounds(report["runs"], args.repeat)
    report["overhead"] = {mode: statistics.median(r["overhead"][mode] for r in report["rounds"])
                          for mode in ("every", "auto")}
    report["in_run"] = {"auto": statistics.median(r["in_run"]["auto"]
                                                  for r in report["rounds"])}
    report["target_auto_every_round"] = all(r["overhead"]["auto"] <= TARGET
                                            for r in report["rounds"])
    report["target_auto_in_run_every_round"] = all(r["in_run"]["auto"] <= TARGET
                                                   for r in report["rounds"])
    off = statistics.median(run["step_s"] for run in report["runs"]["off"])
    report["bound"] = report["write_share_s"] / off
    return report


def rounds(runs: dict[str, list[dict[str, Any]]], count: int) -> list[dict[str, Any]]:
    """Per round: each mode's mean step time over its runs in the round and its overhead
    against off's; and auto's mean in-run excess (``in_run``; every has no step without a
    snapshot before it to hold its steps against)."""
    def mean(mode: str, figure: str, n: int) -> float:
        return statistics.fmean(run[figure] for run in runs[mode] if run["round"] == n)

    out = []
    for n in range(count):
        step = {mode: mean(mode, "step_s", n) for mode in runs}
        out.append({"step_s": step,
                    "overhead": {mode: step[mode] / step["off"] - 1 for mode in ("every", "auto")},
                    "in_run": {"auto": mean("auto", "in_run", n)}})
    return out


def record_results(report: dict[str, Any]) -> None:
    def per_run(mode: str, figure: str, scale: float = 1000, fmt: str = ".1f") -> str:
        values = [run[figure] for run in report["runs"][mode]]
        return ", ".join("-" if v is None else f"{v * scale:{fmt}}" for v in values)

    def per_round(mode: str, figure: str) -> str:
        return ", ".join(f"{r[figure][mode] * 100:+.1f} %" for r in report["rounds"])

    def judged(mode: str, figure: str) -> str:
        if mode not in report[figure]:
            return " | "
        return f"{per_round(mode, figure)} | {report[figure][mode] * 100:+.1f} %"

    rows = "".join(
        f"| {mode} | {per_run(mode, 'step_s')} | {judged(mode, 'overhead')} | "
        f"{per_run(mode, 'in_run', 100)} % | {judged(mode, 'in_run')} | "
        + (f"{per_run(mode, 'snapshot_s', fmt='.2f')} | {per_run(mode, 'interval', 1, 'g')}"
           f" | {per_run(mode, 'in_thread', 100)} % | " if mode != "off" else " | | | ")
        + f"{per_run(mode, 'load', 1, '.1f')} |\n" for mode in MODES)

    def verdict(key: str) -> str:
        return "pass" if report[key] else "FAIL"

    append(f"\n## snapshot.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
           f"W widths {report['widths']}, {report['world_size']} ranks, {report['steps']} "
           f"steps per run, on one local cluster ({report['agents']} agents x "
           f"{report['world_size'] // report['agents']} slots, "
           f"{'ranks pinned to cores of their own' if report['pinned'] else 'unpinned'}, "
           f"{report['cpus']} CPUs); rounds of runs without "
           "snapshots (off), with one every step (every) and with the adaptive interval "
           "(auto), each round a palindrome (off, auto, every, auto, off). Per run: the "
           "mean step (what the job pays), the run's in-run excess (its mean step over the "
           "mean of the steps no snapshot precedes: what the snapshots cost within the "
           "same processes, free of the differences between runs), a rank's median "
           "snapshot in the training thread, the median interval in force, the snapshots' "
           "share of the steps' own time (what auto keeps within "
           "checkpoint.memory_overhead, 2 % by default), and the 1-minute load average "
           "before the run. Per round: the mode's mean step against off's mean in the same "
           "round, and its mean in-run excess.\n\n"
           "| mode | step time per run (ms) | overhead per round | median of rounds | "
           "in-run excess per run | in-run per round | median of rounds | "
           "snapshot in the thread (ms) | interval | in-thread share | load |\n"
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
           f"{rows}\nResult: auto <= {TARGET * 100:.0f} % in every round, between runs "
           f"{verdict('target_auto_every_round')}, within runs "
           f"{verdict('target_auto_in_run_every_round')}.\n\n"
           "| bound | value |\n|---|---:|\n"
           f"| state bytes (model + AdamW) | {report['state_bytes']} |\n"
           f"| bytes one rank snapshots per step (1/{report['world_size']}) | "
           f"{report['share_bytes']} |\n"
           f"| plain memcpy of them (ms) | {report['memcpy_s'] * 1000:.2f} |\n"
           f"| write_share of them: copy + xxh3 + header (ms) | "
           f"{report['write_share_s'] * 1000:.2f} |\n"
           f"| bound: write_share / step time without (%) | {report['bound'] * 100:.1f} |\n"
           f"| replication of one buffer to a buddy (ms, MB/s) | "
           f"{report['replication_s'] * 1000:.1f}, {report['replication_MBps']:.0f} |\n"
           f"| plain TCP copy of the same bytes (ms, MB/s) | "
           f"{report['tcp_copy_s'] * 1000:.1f}, {report['tcp_copy_MBps']:.0f} |\n")


def tier_phases(args: argparse.Namespace) -> argparse.Namespace:
    """bench/tiers.py's options for its phases after the overhead rounds: this run's W,
    tiers' defaults for the rest."""
    phases = tiers.arguments().parse_args([])
    for name in ("widths", "samples", "steps", "data_dir", "timeout"):
        setattr(phases, name, getattr(args, name))
    phases.no_record = True  # recorded with this bench's section
    return phases


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)))
    parser.add_argument("--samples", type=int, default=64 * 40)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of runs (off, auto, every, auto, off)")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "phalanx-bench-w")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--agents", type=int, default=2,
                        help="agents of the local cluster (nodes, each other's buddy)")
    parser.add_argument("--slots", type=int, default=2,
                        help="slots per agent: the job is agents x slots ranks")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="each agent on cores of its own, each rank on cores of its own "
                             "among them (phalanx up --pin-cpus)")
    parser.add_argument("--no-tiers", action="store_true",
                        help="skip the recovery time per source (bench/tiers.py's phases)")
    parser.add_argument("--no-record", action="store_true")
    return parser


def main() -> int:
    args = arguments().parse_args()
    report = asyncio.run(run(args))
    if not args.no_tiers:
        phases = tier_phases(args)
        report["tiers"] = asyncio.run(tiers.run(phases))
        report["tiers"]["fault_step"] = phases.fault_step
    if not args.no_record:
        record_results(report)
        if "tiers" in report:
            append(tiers.section(report["tiers"]))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

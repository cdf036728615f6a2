"""The phalanx demo: W trains on 4 CPU ranks, loses one, carries on, takes a replacement back.

``phalanx demo`` (or ``python examples/demo.py``) starts a local cluster
(2 agents x 3 slots), submits ``examples/train_mlp.py`` as a 4-replica elastic
job with a warm spare on each node's free slot (``spares: 1``; ``--no-spares``:
none), SIGKILLs one rank mid-run the way a user would (``phalanx chaos
kill-rank``), and lets elasticity do the rest: the survivors continue on 3 ranks
at once, and the replacement (the spare on the dead rank's node, told who it is,
or a process started cold) joins them. Then it runs the same script alone as
the fault-free reference and prints a summary — downtime per event, steps
lost, final loss and parameters against the reference, samples seen exactly
once — and writes a plot of loss and throughput over time with the events
marked. Both runs use the runtime's deterministic reduction, so the final
parameters must be *identical* to the reference's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.examples import workload_w
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import environment, settings, subjects
from phalanx.schemas.messages import (
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    Placement,
    RankProgress,
    RankStarted,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient

EXAMPLES = Path(__file__).resolve().parent

SCRIPT = EXAMPLES / "train_mlp.py"


def phalanx(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


async def run_elastic(args: argparse.Namespace, out: Path, train: list[str]) -> dict:
    """The elastic run on the local cluster; returns the events it saw."""
    cluster = out / "cluster"
    shutil.rmtree(cluster, ignore_errors=True)
    say("starting a local cluster: NATS, the services, 2 agents x 3 slots")
    phalanx("up", "--agents", "2", "--slots-per-agent", "3", "--detach", "--data-dir",
            str(cluster), "--nats-port", "0")
    events: dict = {"generations": [], "kill": None, "started": []}
    try:
        url = json.loads((cluster / "up.json").read_text())["nats_url"]
        async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
            finished = asyncio.Event()
            reached = asyncio.Event()

            async def on_generation(g: Generation, _: Delivery) -> None:
                events["generations"].append((time.time(), g))
                say(f"generation {g.generation}: {g.reason.value}, world size {g.world_size}"
                    f" ({g.cause})")

            async def on_progress(p: RankProgress, _: Delivery) -> None:
                if p.step >= args.kill_at:
                    reached.set()

            async def on_started(r: RankStarted, _: Delivery) -> None:
                events["started"].append((time.time(), r))
                if events["kill"] is not None:
                    how = "a warm spare handed its identity" if r.from_spare else "a cold start"
                    say(f"replacement {r.replica_id} running on {r.node_id}: {how}")

            async def on_state(r: JobRecord, _: Delivery) -> None:
                if r.state.terminal:
                    events["state"] = r.state
                    finished.set()

            await bus.subscribe(subjects.job_events("generation"), Generation, on_generation)
            await bus.subscribe(subjects.health_ranks(), RankProgress, on_progress)
            await bus.subscribe(subjects.job_states(), JobRecord, on_state)
            await bus.subscribe(subjects.job_events("started"), RankStarted, on_started)
            spec = JobSpec(name="demo", team="demo", priority_class="normal",
                           replicas=ReplicaRange(min=2, max=4), command=train,
                           env={environment.RECORD_DIR: str(out / "records"),
                                environment.DETERMINISTIC: "1"},
                           hang_timeout_s=10.0, grace_period_s=5.0,
                           # Two replicas on each node, so each keeps a slot free for
                           # its spare: a replacement starts on its dead rank's node.
                           placement=Placement(spread_failure_domains=True),
                           spares=0 if args.no_spares else 1)
            job = await AdmissionClient(bus).submit(spec, f"demo-{int(time.time())}")
            say(f"submitted {job.job_id}: 4 replicas of {SCRIPT.name}"
                + ("" if args.no_spares else ", a warm spare on each node's free slot"))
            await asyncio.wait_for(reached.wait(), args.timeout)
            say(f"step {args.kill_at} reached: SIGKILL rank 1 (phalanx chaos kill-rank)")
            events["kill"] = time.time()
            phalanx("chaos", "kill-rank", job.job_id, "1", "--data-dir", str(cluster))
            await asyncio.wait_for(finished.wait(), args.timeout)
            say(f"job {events['state'].value}")
    finally:
        phalanx("down", "--data-dir", str(cluster))
    return events


def plot(path: Path, steps: list[record.StepRecord], reference: list[record.StepRecord],
         marks: list[tuple[float, str]]) -> None:
    """Loss per step against the reference; throughput over time; the events on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0].committed_at
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7))
    top.plot([s.step for s in steps], [s.loss for s in steps], lw=2.5, alpha=0.6,
             label="phalanx, through a kill and a join")
    top.plot([r.step for r in reference], [r.loss for r in reference], "k--", lw=1,
             label="fault-free run alone")
    top.set_xlabel("step")
    top.set_ylabel("loss (global batch)")
    rates = [(b.committed_at - t0, 64 / (b.committed_at - a.committed_at))
             for a, b in itertools.pairwise(steps) if b.committed_at > a.committed_at]
    bottom.plot([t for t, _ in rates], [r for _, r in rates], color="tab:green")
    bottom.set_ylabel("throughput (samples/s)")
    bottom.set_xlabel("time since the first step (s)")
    for at, label in marks:
        step = next((s.step for s in steps if s.committed_at >= at), steps[-1].step)
        color = "tab:red" if "kill" in label else "tab:gray"
        top.axvline(step, color=color, ls=":")
        bottom.axvline(at - t0, color=color, ls=":")
        bottom.annotate(label, (at - t0, bottom.get_ylim()[0]), rotation=90, va="bottom",
                        fontsize=8)
    top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)),
                        help="MLP widths (default: W)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=64 * 20)
    parser.add_argument("--kill-at", type=int, default=15, help="kill rank 1 at this step")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-spares", action="store_true",
                        help="no warm spares: the replacement starts cold")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    shutil.rmtree(out / "records", ignore_errors=True)
    shutil.rmtree(out / "reference", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    widths = tuple(int(w) for w in args.widths.split(","))
    workload_w.prepare(out / "data", args.samples, widths)
    train = [sys.executable, str(SCRIPT), "--data-dir", str(out / "data"), "--widths",
             args.widths, "--samples", str(args.samples), "--steps", str(args.steps)]

    events = asyncio.run(run_elastic(args, out, [*train, "--save", str(out / "final.pt")]))
    say("fault-free reference: the same script alone")
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    subprocess.run([*train, "--save", str(out / "reference" / "final.pt")], check=True,
                   env={**env, environment.RECORD_DIR: str(out / "reference" / "records"),
                        environment.DETERMINISTIC: "1"}, timeout=args.timeout)

    records = record.read(out / "records")
    steps = record.timeline(records)
    reference = record.timeline(record.read(out / "reference" / "records"))
    problems = record.verify(records, ElasticOrder(args.samples, workload_w.W_GLOBAL_BATCH),
                             args.steps)
    ours, theirs = torch.load(out / "final.pt"), torch.load(out / "reference" / "final.pt")
    max_diff = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
    marks = [(events["kill"], "kill rank 1")]
    print("\nphalanx demo — summary")
    changes = [(at, g) for at, g in events["generations"]
               if g.reason is not GenerationReason.START]
    for n, (at, g) in enumerate(changes):
        # Each pause ends where the next change starts: that one has its own figure.
        until = changes[n + 1][0] if n + 1 < len(changes) else None
        gap, median = record.downtime(steps, events["kill"] if g.reason is
                                      GenerationReason.FAULT else at, until)
        marks.append((at, f"generation {g.generation}: {g.reason.value}"))
        print(f"  {g.reason.value:5} generation {g.generation} (world size {g.world_size}): "
              f"survivors paused {max(0.0, gap - median) * 1000:.0f} ms beyond a "
              f"{median * 1000:.0f} ms step")
    for at, started in events["started"]:
        if events["kill"] is None or at < events["kill"]:
            continue
        joined = next((g_at for g_at, g in changes if g.reason is GenerationReason.JOIN
                       and started.replica_id in {m.replica_id for m in g.members}), None)
        how = "from a warm spare" if started.from_spare else "started cold"
        print(f"  replacement {started.replica_id} {how}: running "
              f"{at - events['kill']:.2f} s after the kill"
              + ("" if joined is None else f", a member {joined - events['kill']:.2f} s after"))
    print(f"  steps committed: {len(steps)} of {args.steps}; lost or repeated: "
          f"{sum('repeated' in p or 'never' in p for p in problems)}")
    print(f"  every sample exactly once per epoch: {'yes' if not problems else 'NO'}")
    for problem in problems:
        print(f"    problem: {problem}")
    print(f"  final loss {steps[-1].loss:.6f}, fault-free reference {reference[-1].loss:.6f}; "
          f"largest parameter difference {max_diff:.3g}")
    plot(out / "demo.png", steps, reference, marks)
    print(f"  plot: {out / 'demo.png'}")
    ok = events.get("state") is JobState.FINISHED and not problems and max_diff == 0.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

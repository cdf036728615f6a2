"""Elastic scaling as a policy, measured: throughput over time through planned and
fault-driven size changes, the pause each costs the survivors, and how soon a preemptor runs.

One run on a local cluster (``phalanx up``, 2 agents x 2 slots), the scenario of
``tests/e2e/test_elastic_policy.py`` followed by a fault of the same size:

1. a 2-slot filler runs; ``examples/train_mlp.py`` is submitted as an elastic
   job (``replicas: {min: 1, max: 4}``, ``replica_increment_step: 1``) and
   starts at 2;
2. the filler is cancelled: the job grows to 4 (join);
3. a high-priority rigid 2-slot job is submitted: the job shrinks gracefully to
   2 (a planned leave) and the preemptor's ranks start — submit → both ranks
   running is measured;
4. the preemptor is cancelled: the job grows back to 4 (join);
5. two of its ranks are SIGKILLed at once through their agents: a fault-driven
   shrink to 2, then their replacements join (back to 4);
6. after a last stretch of steady training the job is cancelled.

Between events the job trains ``--settle-steps`` steps (waited for on the ranks'
progress reports). Figures: steps/s over time (1 s bins) with every generation
marked, written as a PNG; for each change the pause its survivors reported
(``GenerationApplied.pause_s``, the longest, as stored in ``phalanx_history``) and the
same pause measured from the replicas' records (the longest gap between commits around
it minus the median step before; ``runtime.record.downtime``). Target: the planned leave
costs the survivors no more than the join of a replacement.

Prints one JSON object as its last line and appends the figures to bench/RESULTS.md::

    python bench/elastic.py                  # writes bench/elastic.png
    python bench/elastic.py --no-record --plot /tmp/elastic.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from phalanx.bench.results import append, utc_date
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.runtime import record
from phalanx.schemas import environment, settings, subjects
from phalanx.schemas.messages import (
    ChaosAction,
    ChaosReply,
    ChaosRequest,
    Generation,
    GenerationReason,
    JobHistory,
    JobSpec,
    Message,
    RankProgress,
    RankStarted,
    ReplicaRange,
    ScalingEvent,
    ScalingPolicy,
)
from phalanx.services.client import AdmissionClient

T = TypeVar("T")

BENCH = Path(__file__).resolve().parent

SCRIPT = BENCH.parent / "examples" / "train_mlp.py"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


def cli(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args], check=True,
                   capture_output=True, timeout=120, env=env)


class Scenario:
    """The bus side of one run: what happened when, and waits on it."""

    def __init__(self, bus: Bus, job_id: str, timeout_s: float) -> None:
        self.bus = bus
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.client = AdmissionClient(bus)
        self.generations: list[tuple[float, Generation]] = []
        self.scaling: list[tuple[float, ScalingEvent]] = []
        self.started: list[tuple[float, RankStarted]] = []
        self.step = 0
        self.changed = asyncio.Condition()

    async def listen(self) -> None:
        async def on(message: Message, _: Delivery) -> None:
            now = time.time()
            async with self.changed:
                match message:
                    case Generation() if message.job_id == self.job_id:
                        self.generations.append((now, message))
                    case ScalingEvent():
                        self.scaling.append((now, message))
                    case RankStarted():
                        self.started.append((now, message))
                    case RankProgress() if message.job_id == self.job_id:
                        self.step = max(self.step, message.step)
                self.changed.notify_all()

        for subject, kind in ((subjects.job_events("generation"), Generation),
                              (subjects.job_events("scaling"), ScalingEvent),
                              (subjects.job_events("started"), RankStarted),
                              (subjects.health_ranks(), RankProgress)):
            await self.bus.subscribe(subject, kind, on)

    async def until(self, what: str, condition: Callable[[], T | None]) -> T:
        """Wait (on bus events) until ``condition()`` is truthy; returns its value."""
        async def wait() -> T:
            async with self.changed:
                while not (value := condition()):
                    await self.changed.wait()
                return value

        try:
            return await asyncio.wait_for(wait(), self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no {what} within {self.timeout_s:g} s") from None

    async def generation(self, reason: GenerationReason, size: int, after: int) -> Generation:
        """The first generation with ``reason`` and ``size`` among those from the
        ``after``-th on (joins may arrive a replica at a time)."""
        return await self.until(f"{reason.value} generation at {size}", lambda: next(
            (g for _, g in self.generations[after:]
             if g.reason is reason and g.world_size == size), None))

    async def change(self, marks: list[tuple[float, str]], label: str, action: Awaitable[object],
                     reason: GenerationReason, size: int) -> None:
        """Mark ``label`` now, await ``action``, then wait for the generation it brings."""
        marks.append((time.time(), label))
        seen = len(self.generations)
        await action
        await self.generation(reason, size, seen)

    async def settle(self, steps: int) -> None:
        target = self.step + steps
        await self.until(f"step {target}", lambda: self.step >= target)


async def run_scenario(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cluster, rec = work / "cluster", work / "records"
    env = {**os.environ, settings.HEALTH("cordon_faults"): "1000"}  # the kills are on purpose
    cli("up", "--agents", "2", "--slots-per-agent", "2", "--detach", "--data-dir", str(cluster),
        "--nats-port", "0", "--heartbeat-interval", "0.2", env=env)
    url = json.loads((cluster / "up.json").read_text())["nats_url"]
    marks: list[tuple[float, str]] = []
    try:
        async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
            run = Scenario(bus, "elastic-1", args.timeout)
            await run.listen()
            client = run.client
            await client.submit(JobSpec(name="filler", team="t", priority_class="normal",
                                        replicas=ReplicaRange(min=2, max=2), command=SLEEPER,
                                        grace_period_s=1.0), "filler-1")
            await run.until("filler running", lambda: sum(
                s.job_id == "filler-1" for _, s in run.started) >= 2)
            await client.submit(JobSpec(
                name="elastic", team="t", priority_class="low",
                replicas=ReplicaRange(min=1, max=4),
                scaling=ScalingPolicy(replica_increment_step=1),
                command=[sys.executable, str(SCRIPT), "--data-dir", str(args.data_dir),
                         "--widths", args.widths, "--samples", str(args.samples),
                         "--micro-batch", "8", "--steps", "10000000"],
                env={environment.RECORD_DIR: str(rec)}, hang_timeout_s=5.0,
                grace_period_s=3.0), run.job_id)
            await run.generation(GenerationReason.START, 2, 0)
            await run.settle(args.settle_steps)

            await run.change(marks, "filler cancelled", client.cancel("filler-1"),
                             GenerationReason.JOIN, 4)
            await run.settle(args.settle_steps)

            submitted = time.time()
            await run.change(marks, "preemptor submitted", client.submit(JobSpec(
                name="urgent", team="t", priority_class="high",
                replicas=ReplicaRange(min=2, max=2), command=SLEEPER, grace_period_s=1.0),
                "urgent-1"), GenerationReason.LEAVE, 2)
            preemptor_running = await run.until("the preemptor's ranks", lambda: (
                starts[1] if len(starts := [t for t, s in run.started
                                            if s.job_id == "urgent-1"]) >= 2 else None))
            await run.settle(args.settle_steps)

            await run.change(marks, "preemptor cancelled", client.cancel("urgent-1"),
                             GenerationReason.JOIN, 4)
            await run.settle(args.settle_steps)

            record_now = await client.job(run.job_id)
            assert record_now is not None
            victims = sorted(record_now.placement().items())[-2:]  # the newest two slots
            marks.append((time.time(), "2 ranks killed"))
            before_kill = len(run.generations)
            replies = await asyncio.gather(*(bus.request(
                subjects.agent_chaos(node), ChaosRequest(
                    action=ChaosAction.KILL_RANK, job_id=run.job_id, rank=slot), ChaosReply)
                for slot, node in victims))
            await run.until("a fault generation at 2", lambda: any(
                g.reason is GenerationReason.FAULT and g.world_size == 2
                for _, g in run.generations[before_kill:]))
            await run.generation(GenerationReason.JOIN, 4, before_kill)
            await run.settle(args.settle_steps)
            history = await client.history(run.job_id)
            await client.cancel(run.job_id)
    finally:
        cli("down", "--data-dir", str(cluster))
    return {"records": record.read(rec), "generations": run.generations,
            "scaling": run.scaling, "marks": marks, "history": history,
            "preemptor_s": preemptor_running - submitted,
            "killed": [r.detail for r in replies]}


def analyse(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run: each change's pause (reported and from the records), the
    throughput, the preemptor's start."""
    steps = record.timeline(run["records"])
    history: JobHistory | None = run["history"]
    reported = {g.generation: g.pause_s for g in (history.generations if history else [])}
    changes = []
    generations = run["generations"]
    for i, (at, g) in enumerate(generations):
        if g.reason is GenerationReason.START:
            continue
        until = generations[i + 1][0] if i + 1 < len(generations) else None
        gap, median = record.downtime(steps, at, until=until)
        changes.append({"generation": g.generation, "reason": g.reason.value,
                        "world_size": g.world_size, "cause": g.cause,
                        "pause_s": reported.get(g.generation),
                        "record_pause_s": round(gap - median, 4),
                        "median_step_s": round(median, 4)})

    def pause(reason: str, nth: int = 0) -> float | None:
        found = [c for c in changes if c["reason"] == reason]
        return found[nth]["pause_s"] if len(found) > nth else None

    joins = [c for c in changes if c["reason"] == "join"]
    faults = [c for c in changes if c["reason"] == "fault"]
    # The replacements' join is the last join (after the fault); the growth joins come first.
    replacement_join = joins[-1]["pause_s"] if joins and faults \
        and joins[-1]["generation"] > faults[0]["generation"] else None
    fault_pause = max((c["pause_s"] or 0.0 for c in faults), default=None)
    leave = pause("leave")
    rates = throughput(steps)
    return {
        "preemptor_submit_to_ranks_running_s": round(run["preemptor_s"], 3),
        "planned_leave_pause_s": leave,
        "fault_shrink_pause_s": fault_pause,
        "fault_generations": len(faults),
        "replacement_join_pause_s": replacement_join,
        "growth_join_pauses_s": [c["pause_s"] for c in joins[:-1] if faults] or
                                [c["pause_s"] for c in joins],
        "changes": changes,
        "scaling_events": [{"at": round(at - run["marks"][0][0], 3), "kind": e.kind.value,
                            "from": e.from_replicas, "to": e.to_replicas, "reason": e.reason}
                           for at, e in run["scaling"] if e.job_id == "elastic-1"],
        "steps": len(steps),
        "steps_per_s": {"median_at_4": median_rate(rates, steps, 4),
                        "median_at_2": median_rate(rates, steps, 2)},
        "targets": {"planned leave pause <= replacement join pause":
                    leave is not None and replacement_join is not None
                    and leave <= replacement_join,
                    "preemptor running within 2 s": run["preemptor_s"] <= 2.0},
    }


def throughput(steps: list[record.StepRecord]) -> list[tuple[float, int]]:
    """Committed steps per 1 s bin: (bin start, steps)."""
    if not steps:
        return []
    start = int(steps[0].committed_at)
    bins = [0] * (int(steps[-1].committed_at) - start + 1)
    for s in steps:
        bins[int(s.committed_at) - start] += 1
    return [(start + i, n) for i, n in enumerate(bins)]


def median_rate(rates: list[tuple[float, int]], steps: list[record.StepRecord],
                size: int) -> float | None:
    """The median steps/s over the whole seconds in which every step ran at ``size``."""
    sizes: dict[int, set[int]] = {}
    for s in steps:
        sizes.setdefault(int(s.committed_at), set()).add(s.world_size)
    values = [n for t, n in rates[1:-1] if sizes.get(int(t)) == {size}]
    return statistics.median(values) if values else None


def plot(run: dict[str, Any], path: Path) -> None:
    """Steps/s over time, the world size under it, every generation and action marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = record.timeline(run["records"])
    rates = throughput(steps)[1:-1]  # the first and last seconds are partial
    t0 = rates[0][0]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.step([t - t0 for t, _ in rates], [n for _, n in rates], where="post",
            label="committed steps/s (1 s bins)")
    size_ax = ax.twinx()
    size_ax.step([s.committed_at - t0 for s in steps], [s.world_size for s in steps],
                 where="post", color="tab:gray", alpha=0.6, label="world size")
    size_ax.set_ylim(0, 5)
    size_ax.set_ylabel("world size")
    colours = {"join": "tab:green", "leave": "tab:blue", "fault": "tab:red"}
    for at, g in run["generations"]:
        if g.reason is GenerationReason.START:
            continue
        ax.axvline(at - t0, color=colours.get(g.reason.value, "k"), linestyle="--")
        ax.annotate(f"g{g.generation} {g.reason.value} -> {g.world_size}", (at - t0, 0.98),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=7, va="top",
                    ha="right")
    for at, label in run["marks"]:
        ax.axvline(at - t0, color="tab:purple", linestyle=":", alpha=0.7)
        ax.annotate(label, (at - t0, 0.02), xycoords=("data", "axes fraction"), rotation=90,
                    fontsize=7, va="bottom", ha="right", color="tab:purple")
    ax.set_xlabel("seconds since the job's first step")
    ax.set_ylabel("steps/s")
    ax.set_title("bench/elastic.py: planned (leave, join) and fault-driven size changes")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(report: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    growth = ", ".join(seconds(v) for v in report["growth_join_pauses_s"])

    def cause(text: str) -> str:  # one table cell: without the rank's last output
        short = text.splitlines()[0][:80]
        return short + ")" * (short.count("(") - short.count(")"))

    rows = "\n".join(
        f"| g{c['generation']} | {c['reason']} | {c['world_size']} | {seconds(c['pause_s'])} "
        f"| {c['record_pause_s']:.3f} | {cause(c['cause'])} |" for c in report["changes"])
    return f"""
## elastic.py — {report['date']}

`{report['command']}` — widths {report['widths']}, {report['steps']} steps; plot
`{report['plot']}`. Preemptor submit → its 2 ranks running:
{report['preemptor_submit_to_ranks_running_s']} s. Pause of the survivors (the longest
`GenerationApplied.pause_s`): planned leave 4 → 2 {seconds(report['planned_leave_pause_s'])} s;
fault-driven shrink 4 → 2 (two ranks SIGKILLed at once; {report['fault_generations']} fault
generation(s)) {seconds(report['fault_shrink_pause_s'])} s; the replacements' join
{seconds(report['replacement_join_pause_s'])} s; the growth joins {growth} s. Steps/s (median
of whole seconds at one size): at 4 {report['steps_per_s']['median_at_4']}, at 2
{report['steps_per_s']['median_at_2']} (2 cores: 4 ranks are not faster). Targets:
{", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report['targets'].items())}.

| generation | reason | world size | pause_s (reported) | pause from records (s) | cause |
|---|---|---:|---:|---:|---|
{rows}
"""


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.keep is not None:  # the cluster's logs and the records stay for reading
        args.keep.mkdir(parents=True, exist_ok=True)
        run = await run_scenario(args, args.keep)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run = await run_scenario(args, Path(tmp))
    plot(run, args.plot)
    report = {"date": utc_date(), "command": " ".join(["python", *sys.argv]),
              "widths": args.widths, "plot": str(args.plot.resolve().relative_to(
                  BENCH.parent) if args.plot.resolve().is_relative_to(BENCH.parent)
                  else args.plot), **analyse(run)}
    report["pass"] = all(report["targets"].values())
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="64,128,64")
    parser.add_argument("--samples", type=int, default=640)
    parser.add_argument("--settle-steps", type=int, default=300,
                        help="steps trained between events")
    parser.add_argument("--timeout", type=float, default=180.0, help="per wait, seconds")
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/phalanx-elastic-bench"))
    parser.add_argument("--plot", type=Path, default=BENCH / "elastic.png")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in DIR and keep it: the cluster's logs and the records")
    args = parser.parse_args()
    subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--data-dir", str(args.data_dir),
                    "--widths", args.widths, "--samples", str(args.samples)],
                   check=True, timeout=120)
    report = asyncio.run(main_async(args))
    if not args.no_record:
        append(section(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()

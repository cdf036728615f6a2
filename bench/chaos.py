"""Seeded chaos against one elastic training job: ranks, agents, every service and the bus.

A local cluster (two agents with two slots, two instances each of admission,
health and elasticity, a supervisor that starts a killed nats-server again on
the same port and store) runs ``examples/train_mlp.py`` as an elastic job of 2
to 4 replicas in deterministic mode. Every ``--interval`` seconds one fault is
injected, drawn with a seeded RNG (the first ones cover every kind once):

* ``rank_kill`` / ``rank_stop``: SIGKILL or SIGSTOP a member rank (only while the
  job has at least three members, so it never drops below its minimum);
* ``agent_kill``: SIGKILL a node agent and start it again half a second later
  (its ranks keep running; the new agent adopts them);
* ``service_kill``: SIGKILL a random instance of admission, health or elasticity,
  ``leader_kill``: the instance holding that service's lease; either is started
  again a second later, as a Deployment would;
* ``bus_restart``: SIGKILL nats-server; the supervisor starts it again two seconds
  later on the same JetStream store;
* ``node_loss``: SIGKILL a node's agent and every rank of the job on it (only while
  the job has at least two members elsewhere); the agent is started again after
  longer than the node timeout, so the node is lost and comes back.

The draws after the first seven weigh rank_kill 3, rank_stop 2, agent_kill 2,
service_kill 2, leader_kill 2, bus_restart 1, node_loss 1 (a rank fault or node
loss no sooner than six seconds after the last one, else another kind): at the
default 2.5 s interval,
about ten restarts of the job within five minutes. The job runs under the
default crash-loop guard (at most ``max_restarts_in_window`` 8 restarts in
300 s *without a committed step between them*), so a guard that counted
restarts instead of judging progress fails the run; it used to hide exactly
that (issue 24): the job's restart policy was raised to 100,000, as if faults
every few seconds could not be a crash loop. Still not drawn: a node lost with
its memory (the agent comes back with its store), and cordons
(``PHALANX_HEALTH_CORDON_FAULTS`` off: faults drawn at random on two nodes are
evidence against them, not a bug).

Then the job must finish ``finished`` with final parameters *equal* to the same
script run alone, every sample used exactly once per epoch and no committed
step trained twice (``runtime.record.verify``), the job admitted once (never
back to pending, one generation 0), and no process left behind. Each fault's
recovery is measured: until training has advanced one full step past where it
was (and, for a leader, until a live instance holds the lease again).

Prints one JSON object as its last line and appends the figures to
bench/RESULTS.md::

    python bench/chaos.py                            # 100 faults
    python bench/chaos.py --faults 15                # the size CI runs (tests/e2e)
    python bench/chaos.py --sharded-optimizer        # the job's optimizer sharded (ZeRO)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.bench.results import append, utc_date
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import TypedKV
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import environment, settings, subjects
from phalanx.schemas.messages import (
    CheckpointPolicy,
    Generation,
    GenerationReason,
    JobRecord,
    JobSpec,
    JobState,
    Lease,
    RankProgress,
    ReplicaRange,
    RestartPolicy,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.cluster import LocalCluster
from phalanx.services.manifest import running_in_manifest

BENCH = Path(__file__).resolve().parent

SCRIPT = BENCH.parent / "examples" / "train_mlp.py"
SAMPLES = 640
ARGS = ["--widths", "64,128,64", "--samples", str(SAMPLES), "--micro-batch", "8"]
KINDS = ("rank_kill", "rank_stop", "agent_kill", "service_kill", "leader_kill", "bus_restart",
         "node_loss")
WEIGHTS = (3, 2, 2, 2, 2, 1, 1)
SERVICES = ("admission", "health", "elasticity")
RANK_KINDS = ("rank_kill", "rank_stop", "node_loss")
#: How long a lost node's agent stays down: past the node timeout (3 s), so it is lost.
NODE_DOWN_S = 5.0
JOB = "chaos-1"


@dataclasses.dataclass
class FaultRecord:
    n: int
    kind: str
    target: str
    at: float
    step: int  # the highest step any rank had reported when it was injected
    recovery_s: float | None = None  # until training advanced a full step past ``step``
    leader_back_s: float | None = None  # leader kills: until a live instance holds the lease


class Observer:
    """What the bench sees of the job over its own bus connection."""

    def __init__(self) -> None:
        self.step = -1
        self.progressed = asyncio.Event()
        self.generations: list[Generation] = []
        self.states: list[JobState] = []

    async def on_progress(self, msg: RankProgress, _: Delivery) -> None:
        if msg.job_id == JOB and msg.step > self.step:
            self.step = msg.step
            self.progressed.set()

    async def on_generation(self, g: Generation, _: Delivery) -> None:
        if g.job_id == JOB:
            self.generations.append(g)

    async def on_state(self, r: JobRecord, _: Delivery) -> None:
        if r.job_id == JOB and (not self.states or self.states[-1] is not r.state):
            self.states.append(r.state)

    async def past(self, step: int, timeout_s: float) -> float | None:
        """Seconds until some rank reports a step after ``step`` (None: not in time)."""
        start = time.monotonic()
        while self.step <= step:
            self.progressed.clear()
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.progressed.wait(), left)
            except TimeoutError:
                return None
        return time.monotonic() - start


class Chaos:
    def __init__(self, work: Path, seed: int, steps: int, sharded: bool = False,
                 pace_s: float = 0.01) -> None:
        self.work = work
        self.pace_s = pace_s
        self.sharded = sharded
        self.rng = random.Random(seed)
        self.order = self.rng.sample(KINDS, len(KINDS))  # of the first faults
        self.steps = steps
        self.release = work / "release"  # the job's pace ends (runtime/chaos.py)
        self.cluster = LocalCluster(work / "cluster", agents=2, slots_per_agent=2, nats_port=0,
                                    heartbeat_interval_s=0.2, admission_instances=2,
                                    health_instances=2, elasticity_instances=2)
        self.stop = asyncio.Event()
        self.observer = Observer()
        self.faults: list[FaultRecord] = []
        self.last_rank_fault = 0.0
        self.restarts: set[asyncio.Task[None]] = set()
        self.measuring: set[asyncio.Task[None]] = set()

    # --- the cluster and the job --------------------------------------------------------

    async def start(self) -> Bus:
        os.environ.update({settings.HEALTH("cordon_faults"): "100000",  # chaos never cordons
                           settings.ELASTICITY("max_replacements"): "100000"})
        await self.cluster.start()
        self.keeper = asyncio.create_task(self.cluster.keep_nats(self.stop, restart_after_s=2))
        bus = await Bus.connect(BusConfig.load(env={}, servers=[self.cluster.nats_url or ""]),
                                name="chaos")
        await bus.subscribe(subjects.health_job_ranks(JOB), RankProgress,
                            self.observer.on_progress)
        await bus.subscribe(subjects.job_generation(JOB), Generation,
                            self.observer.on_generation)
        await bus.subscribe(subjects.job_state(JOB), JobRecord, self.observer.on_state)
        self.bus = bus
        return bus

    def spec(self) -> JobSpec:
        return JobSpec(name="chaos", team="t", priority_class="normal",
                       replicas=ReplicaRange(min=2, max=4),
                       command=[sys.executable, str(SCRIPT), "--data-dir",
                                str(self.work / "data"), *ARGS, *script_args(self.sharded),
                                "--steps", str(self.steps),
                                "--save", str(self.work / "final.pt")],
                       env={environment.RECORD_DIR: str(self.work / "rec"),
                            environment.DETERMINISTIC: "1",
                            # At most 1 / pace_s steps/s until the faults are made:
                            # the job outlasts them on a fast machine too.
                            environment.CHAOS_PACE: f"{self.pace_s}:{self.release}"},
                       hang_timeout_s=2.0, grace_period_s=3.0,
                       # The crash-loop guard as it ships (8 restarts without progress in
                       # 300 s): the job trains between the faults, so they must never fail
                       # it. max_restarts is also elasticity's cap on the replacements it
                       # launches per admission, which progress does not reset yet.
                       restart_policy=RestartPolicy(max_restarts=100_000),
                       # A sharded optimizer recovers from snapshots: one every step.
                       checkpoint=CheckpointPolicy(memory_every_steps=1) if self.sharded
                       else CheckpointPolicy())

    async def finished(self, timeout_s: float) -> JobRecord:
        jobs = await TypedKV.open(self.bus.js, subjects.JOBS_BUCKET, JobRecord)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = await jobs.get(JOB)
            if entry is not None and entry.value.state.terminal:
                return entry.value
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{JOB} did not end within {timeout_s:g} s")

    # --- faults -------------------------------------------------------------------------

    def _ranks(self) -> list[dict[str, Any]]:
        """The job's rank processes now, from the agents' manifests (``node``: whose)."""
        return [{**r, "node": manifest.parent.name}
                for manifest in (self.cluster.data_dir / "agents").glob("*/ranks.json")
                for r in running_in_manifest(manifest) if r["job_id"] == JOB]

    async def _members(self) -> list[str]:
        generations = await TypedKV.open(self.bus.js, subjects.GENERATIONS_BUCKET, Generation)
        entry = await generations.get(JOB)
        return [] if entry is None else [m.replica_id for m in entry.value.members]

    async def _lease(self, service: str) -> Lease | None:
        """``service``'s lease while it is held (None when it is free or expired)."""
        bucket, key = ((subjects.ADMISSION_BUCKET, "leader") if service == "admission"
                       else (subjects.LEASES_BUCKET, service))
        leases = await TypedKV.open(self.bus.js, bucket, Lease)
        entry = await leases.get(key)
        if entry is None or entry.value.expires_at <= time.time():
            return None
        return entry.value

    def _later(self, delay_s: float, name: str) -> None:
        async def restart() -> None:
            await asyncio.sleep(delay_s)
            processes = (self.cluster.agents if name in self.cluster.agents
                         else self.cluster.services)
            if processes[name].returncode is None:
                return  # an earlier fault's restart started it again: a supervisor runs one
            await self.cluster.restart(name)

        task = asyncio.create_task(restart())
        self.restarts.add(task)
        task.add_done_callback(self.restarts.discard)

    def _kill(self, name: str, restart_after_s: float) -> None:
        processes = self.cluster.agents if name in self.cluster.agents else self.cluster.services
        process = processes[name]
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
        self._later(restart_after_s, name)

    async def _choose(self, n: int) -> str | None:
        """The kind of fault ``n`` (None: not now). Every kind comes once first, in a seeded
        order; a rank fault waits until the job has three members and the last rank fault
        is six seconds old (later ones are replaced by another kind instead)."""
        first = n < len(KINDS)
        kind = self.order[n] if first else self.rng.choices(KINDS, weights=WEIGHTS)[0]
        if kind in RANK_KINDS:
            members = await self._members()
            if len(members) < 3 or time.monotonic() - self.last_rank_fault < 6.0:
                return None if first else self.rng.choice(
                    ("service_kill", "leader_kill", "agent_kill"))
        return kind

    async def inject(self, n: int) -> FaultRecord | None:
        kind = await self._choose(n)
        if kind is None:
            return None
        step = self.observer.step
        match kind:
            case "rank_kill" | "rank_stop":
                members = set(await self._members())
                ranks = [r for r in self._ranks() if r["replica_id"] in members]
                if not ranks:
                    return None
                rank = self.rng.choice(sorted(ranks, key=lambda r: r["replica_id"]))
                sig = signal.SIGKILL if kind == "rank_kill" else signal.SIGSTOP
                try:
                    os.kill(rank["pid"], sig)
                except ProcessLookupError:
                    return None
                self.last_rank_fault = time.monotonic()
                target = rank["replica_id"]
            case "agent_kill":
                target = self.rng.choice(sorted(self.cluster.agents))
                self._kill(target, 0.5)
            case "node_loss":
                members = set(await self._members())
                ranks = self._ranks()
                nodes = [node for node in sorted(self.cluster.agents)
                         if len({r["replica_id"] for r in ranks if r["node"] != node}
                                & members) >= 2]
                if not nodes:
                    return None
                target = self.rng.choice(nodes)
                self._kill(target, NODE_DOWN_S)
                for rank in ranks:
                    if rank["node"] == target:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(rank["pid"], signal.SIGKILL)
                self.last_rank_fault = time.monotonic()
            case "service_kill":
                service = self.rng.choice(SERVICES)
                target = self.rng.choice(sorted(n for n in self.cluster.services
                                                if n.startswith(service)))
                self._kill(target, 1.0)
            case "leader_kill":
                service = self.rng.choice(SERVICES)
                lease = await self._lease(service)
                if lease is None or lease.holder not in self.cluster.services:
                    return None
                target = lease.holder
                epoch = lease.epoch
                self._kill(target, 1.0)
            case _:
                assert self.cluster.nats is not None and self.cluster.nats.process is not None
                target = "nats-server"
                self.cluster.nats.process.send_signal(signal.SIGKILL)
        fault = FaultRecord(n, kind, target, time.time(), step)
        self.faults.append(fault)
        self.measuring.add(asyncio.create_task(
            self._measure(fault, epoch if kind == "leader_kill" else None)))
        return fault

    async def _measure(self, fault: FaultRecord, epoch: int | None) -> None:
        if epoch is not None:  # a new term: another instance, or the restarted one
            start = time.monotonic()
            while time.monotonic() - start < 30:
                lease = await self._lease(fault.target.split("-")[0])
                if lease is not None and lease.epoch > epoch:
                    fault.leader_back_s = time.monotonic() - start
                    break
                await asyncio.sleep(0.05)
        fault.recovery_s = await self.observer.past(fault.step + 1, 120.0)

    # --- checks ---------------------------------------------------------------------------

    async def close(self) -> list[str]:
        """Stop everything; returns what is left behind (should be nothing)."""
        for task in list(self.restarts):
            await task
        self.stop.set()
        await self.keeper
        for task in self.measuring:
            task.cancel()
        await self.bus.close()
        await self.cluster.stop()
        for _ in range(50):  # processes told to stop may take a moment to be gone
            left = left_behind(self.work)
            if not left:
                break
            await asyncio.sleep(0.2)
        return [f"{pid}: {command}" for pid, command in left]


def left_behind(work: Path) -> list[tuple[str, str]]:
    """Processes still alive from this run (its services, agents or ranks): pid, command."""
    marker = str(work).encode()
    ours = _ancestors()  # this process and whatever started it (a shell naming --keep)
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in ours:
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited; its parent has yet to reap it
            command = (proc / "cmdline").read_bytes()
            if marker in command \
                    or f"{environment.JOB_ID}={JOB}".encode() in (proc / "environ").read_bytes():
                left.append((proc.name, command.replace(b"\0", b" ").decode()[:200]))
        except (OSError, IndexError):
            continue
    return left


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def prepare(work: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--prepare", "--data-dir", str(work / "data"),
                    *ARGS], check=True, timeout=120)


def script_args(sharded: bool) -> list[str]:
    return ["--sharded-optimizer"] if sharded else []


def fault_free(work: Path, steps: int, sharded: bool = False) -> dict[str, Any]:
    """The same script alone: the reference parameters."""
    import torch

    env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    subprocess.run([sys.executable, str(SCRIPT), "--data-dir", str(work / "data"), *ARGS,
                    *script_args(sharded), "--steps", str(steps),
                    "--save", str(work / "reference.pt")],
                   check=True, timeout=900, env={**env, environment.DETERMINISTIC: "1"})
    reference: dict[str, Any] = torch.load(work / "reference.pt")
    return reference


async def run(work: Path, *, seed: int, faults: int, interval_s: float,
              steps: int, sharded: bool = False, pace_s: float = 0.01) -> dict[str, Any]:
    """One chaos run; returns its figures and the verdicts (see the module docstring).

    ``pace_s``: the job's least time per step while faults are made; with ``steps``, it
    bounds how long the faults may go on (``steps * pace_s`` at the least).
    """
    import torch

    prepare(work)
    reference = fault_free(work, steps, sharded)
    chaos = Chaos(work, seed, steps, sharded, pace_s)
    started = time.monotonic()
    bus = await chaos.start()
    try:
        await AdmissionClient(bus).submit(chaos.spec(), JOB)
        if await chaos.observer.past(20, 180) is None:
            raise RuntimeError("the job did not start training within 180 s")
        n = 0
        while n < faults and chaos.observer.step < steps - 50:
            if await chaos.inject(n) is not None:
                n += 1
            await asyncio.sleep(interval_s)
        chaos.release.touch()
        job = await chaos.finished(timeout_s=max(300.0, steps * 0.5))
        await asyncio.sleep(1.0)  # the last measurements
    finally:
        left = await chaos.close()
    records = record.read(work / "rec")
    errors = record.verify(records, ElasticOrder(SAMPLES, 64, seed=0), steps)
    final = torch.load(work / "final.pt") if (work / "final.pt").exists() else {}
    equal = bool(final) and all(torch.equal(final[k], v) for k, v in reference.items())
    starts = [g for g in chaos.observer.generations if g.reason is GenerationReason.START]
    by_kind: dict[str, list[FaultRecord]] = collections.defaultdict(list)
    for fault in chaos.faults:
        by_kind[fault.kind].append(fault)

    def summary(values: list[float | None]) -> dict[str, float | int | None]:
        measured = [v for v in values if v is not None]
        return {"n": len(values), "unrecovered": len(values) - len(measured),
                "median_s": round(statistics.median(measured), 3) if measured else None,
                "max_s": round(max(measured), 3) if measured else None}

    return {
        "seed": seed, "faults": len(chaos.faults), "steps": steps,
        "duration_s": round(time.monotonic() - started, 1),
        "by_kind": {kind: summary([f.recovery_s for f in by_kind[kind]]) for kind in KINDS},
        "leader_back": summary([f.leader_back_s for f in by_kind["leader_kill"]]),
        "finished": job.state is JobState.FINISHED,
        "params_equal": equal, "verify_errors": errors[:10],
        "admitted_once": JobState.PENDING not in chaos.observer.states[1:] and len(starts) <= 1,
        # What that verdict is drawn from: the job's states, and each start generation seen.
        "states": [state.value for state in chaos.observer.states],
        "starts": [f"generation {g.generation} ({g.rendezvous}): {g.cause}"
                   for g in starts],
        "left_behind": left,
        "fault_log": [dataclasses.asdict(f) for f in chaos.faults],
    }


def ok(result: dict[str, Any]) -> bool:
    return (result["finished"] and result["params_equal"] and not result["verify_errors"]
            and result["admitted_once"] and not result["left_behind"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--interval", type=float, default=2.5, help="seconds between faults")
    parser.add_argument("--steps", type=int, default=0,
                        help="training steps (default: enough for the faults)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--sharded-optimizer", action="store_true",
                        help="the job's AdamW sharded (ZeroRedundancyOptimizer), a snapshot "
                             "every step")
    parser.add_argument("--keep", metavar="DIR",
                        help="run in DIR and keep it (logs, records) instead of a temp dir")
    args = parser.parse_args()
    # The job trains 50-250 steps/s here between faults: enough steps to outlast them.
    steps = args.steps or int(args.faults * args.interval * 100) + 5000
    with tempfile.TemporaryDirectory(prefix="phalanx-chaos-") as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(work, seed=args.seed, faults=args.faults,
                                 interval_s=args.interval, steps=steps,
                                 sharded=args.sharded_optimizer))
    result["ok"] = ok(result)
    if args.keep:  # when each fault came, beside the logs and records it explains
        (work / "faults.json").write_text(json.dumps(result["fault_log"], indent=1))
    if not args.no_record:
        rows = "\n".join(
            f"| {kind} | {s['n']} | {s['median_s']} | {s['max_s']} | {s['unrecovered']} |"
            for kind, s in result["by_kind"].items())
        append(f"\n## chaos.py — {utc_date()}\n\n`python bench/chaos.py --faults {args.faults} "
               f"--interval {args.interval:g} --seed {args.seed}"
               f"{' --sharded-optimizer' if args.sharded_optimizer else ''}` — "
               f"{result['faults']} faults "
               f"over {result['steps']} steps in {result['duration_s']} s; finished: "
               f"{result['finished']}, parameters equal to the fault-free run: "
               f"{result['params_equal']}, record errors: {len(result['verify_errors'])}, "
               f"admitted once: {result['admitted_once']}, left behind: "
               f"{len(result['left_behind'])}; a new leader within "
               f"{result['leader_back']['max_s']} s (max) of a leader kill.\n\n"
               "| fault | n | recovery median (s) | max (s) | not recovered |\n"
               f"|---|---:|---:|---:|---:|\n{rows}\n")
    print(json.dumps({k: v for k, v in result.items() if k != "fault_log"}))


if __name__ == "__main__":
    main()

"""Goodput under continuous failures: phalanx, torchft and torchrun + DCP side by side on W.

One invocation runs workload W (``examples/workload_w.py``: 4 ranks on two "nodes" of
two) under three systems, one after the other, each for ``--duration`` seconds of
wall time per MTBF, with the same failures injected into each:

* **phalanx**: ``examples/train_mlp.py`` as an elastic job of 1 to 4 replicas on a
  local cluster of two agents with two slots (nats-server, admission, health,
  elasticity as processes, as bench/chaos.py starts them);
* **torchft** 0.2.0: its lighthouse (``torchft_lighthouse``) and four replica groups of
  one rank, each under its own torchrun (``--max-restarts``: a crashed group is started
  again), training W with torchft's Manager, DDP and optimizer wrapper over gloo
  (``bench/torchft_worker.py``), at least one group per quorum;
* **torchrun + DCP**: two torchrun agents of two ranks each (c10d rendezvous on a store
  this process hosts, ``--nnodes 1:2``: a lost node's survivor goes on alone) running
  the plain DDP loop of ``bench/torchrun_worker.py``, checkpointing with DCP every
  Young/Daly interval, sqrt(2 x checkpoint cost x MTBF), after measuring the
  checkpoint's cost and the fault-free step time in a run of their own first.

The failures arrive as a Poisson process (exponential gaps of mean ``--mtbf``) drawn
from ``--seed``, the same times and kinds for every system: 70 % rank kills (SIGKILL),
15 % hangs (SIGSTOP; a hung rank that its system has not killed is let go on with
SIGCONT after ``--hang-s``) and 15 % node losses (a node's agent, its torchrun agents
for the torch systems, and its ranks SIGKILLed; started again after ``--node-down-s``).
A node loss while the other node is down is a rank kill instead, so a system is never
left without a node. Which rank or node is hit is drawn with the time, among those
alive then.

Hung peers are noticed by each system's own means: phalanx's health service (the job's
``hang_timeout_s``, its default), torchft's Manager and gloo timeouts and torchrun's
gloo timeout (both ``--torch-timeout``; torch's default would hold a hang for 30 min).

Figures, per system and MTBF:

* **efficiency**: committed steps x fault-free step time / wall time. The window starts
  once the system has trained ``--calibrate`` seconds without faults; its fault-free step
  time is the median gap between commits there (torchrun's calibration run only sets
  its checkpoint interval). A torchft step trained by fewer than the four groups counts
  as the share of W's global batch it trained (torchft shrinks the batch, phalanx keeps
  it whole over fewer ranks).
* **samples lost or repeated**: phalanx from its data accounting (``record.verify``, as
  bench/chaos.py checks); torchrun's kept steps each read their batch once (a restart
  reads again the batches of the steps it redoes, counted as redone steps); torchft's
  loader restarts with its group and trains a batch whose step was not committed once
  only: counted from its groups' records.
* **time lost per failure**, by cause: detection, rendezvous or restart, state recovery,
  redone steps, checkpoints (torchrun), and what is left (running short-handed).

Writes bench/goodput.png (efficiency against MTBF, one line per system), appends a
section to bench/RESULTS.md unless ``--no-record``, and prints one JSON object as its
last line::

    python bench/goodput.py --mtbf 60 15 --duration 300
    python bench/goodput.py --mtbf 60 --duration 30 --widths 256,512,256   # a quick look

``--project`` runs nothing: it prints the model of ``bench/goodput_model.py``, ETTR of the
three systems projected to 1k-100k GPUs from the costs measured here (docs/goodput.md),
appends it to bench/RESULTS.md unless ``--no-record``, and ends with its JSON::

    python bench/goodput.py --project
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from phalanx.bench import goodput_model, recovery, recovery_baseline
from phalanx.bench.goodput_model import young_daly_s
from phalanx.bench.results import append, command_line, utc_date
from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.examples import workload_w
from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder
from phalanx.schemas import MAX_PAYLOAD_BYTES, environment, settings
from phalanx.schemas.messages import (
    GenerationReason,
    JobSpec,
    ReplicaRange,
    RestartPolicy,
)
from phalanx.services.client import AdmissionClient
from phalanx.services.cluster import LocalCluster
from phalanx.services.manifest import running_in_manifest
from phalanx.services.ports import free_port

BENCH = Path(__file__).resolve().parent
SYSTEMS = ("phalanx", "torchft", "torchrun")
#: The failure mix: mostly rank kills.
MIX = {"rank_kill": 0.70, "hang": 0.15, "node_loss": 0.15}
NODES = ("node-0", "node-1")
RANKS_PER_NODE = 2
WORLD = len(NODES) * RANKS_PER_NODE
JOB = "goodput"
PLOT = BENCH / "goodput.png"


# --- the pure parts: failures, the checkpoint interval, efficiency --------------------


@dataclasses.dataclass(frozen=True)
class Failure:
    """One injected failure: when (seconds into the window), what, and whom: ``pick`` in
    [0, 1) chooses among the ranks or nodes alive then."""

    at_s: float
    kind: str
    pick: float


def schedule(seed: int, mtbf_s: float, duration_s: float,
             mix: dict[str, float] = MIX) -> list[Failure]:
    """Poisson arrivals of mean gap ``mtbf_s`` within ``duration_s``, kinds drawn by
    ``mix``'s weights; the same for every system given the same seed and MTBF."""
    rng = random.Random(f"{seed}:{mtbf_s}")
    failures, at = [], 0.0
    while (at := at + rng.expovariate(1 / mtbf_s)) < duration_s:
        kind = rng.choices(list(mix), weights=list(mix.values()))[0]
        failures.append(Failure(round(at, 3), kind, rng.random()))
    return failures


@dataclasses.dataclass(frozen=True)
class Commit:
    """A step the system kept: when its last rank committed it, and the share of the
    global batch it trained (1: all of it)."""

    t: float
    step: int
    share: float = 1.0


def median_step_s(commits: Sequence[Commit], start: float, end: float) -> float:
    """The median gap between consecutive commits of full steps within [start, end)."""
    inside = [c for c in sorted(commits, key=lambda c: c.t) if start <= c.t < end]
    gaps = [b.t - a.t for a, b in itertools.pairwise(inside)
            if b.step == a.step + 1 and b.share == 1.0]
    if not gaps:
        raise RuntimeError(f"no two consecutive full steps within {end - start:.0f} s")
    return statistics.median(gaps)


def efficiency(commits: Sequence[Commit], start: float, end: float,
               step_s: float) -> tuple[float, float]:
    """``(steps committed in [start, end), their share of the window)``: the steps (in
    global batches) times the fault-free step time over the wall time."""
    work = sum(c.share for c in commits if start <= c.t < end)
    return work, work * step_s / (end - start)


#: A gap between commits longer than this many fault-free steps is a stall; a shorter one
#: a slow step.
STALL_STEPS = 3


def lost_time(commits: Sequence[Commit], start: float, end: float,
              step_s: float) -> dict[str, float]:
    """The window's lost time, ``wall - steps x step_s``, in two parts that sum to it:

    * ``stalled``: no step committed: every gap between consecutive commits (clipped to
      the window) longer than ``STALL_STEPS`` fault-free steps, less one step (detection,
      rendezvous, restarts, state recovery, redone steps and checkpoints fall here);
    * ``degraded``: the rest: training on, but slower or smaller than fault-free: fewer
      ranks carrying the whole batch (phalanx, torchrun), steps that trained only a share
      of it (torchft with groups missing), a loaded machine.
    """
    times = [start, *sorted(c.t for c in commits if start <= c.t < end), end]
    stalled = sum(b - a - step_s for a, b in itertools.pairwise(times)
                  if b - a > STALL_STEPS * step_s)
    lost = (end - start) - sum(c.share for c in commits if start <= c.t < end) * step_s
    return {"stalled": stalled, "degraded": lost - stalled}


# --- processes -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rank:
    node: str
    pid: int


def started_at(pid: int) -> int | None:
    """A process's start time in clock ticks (tells a pid reused from the one meant)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """A process's children (its threads' lists, all of them)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def signal_pid(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class System(Protocol):
    """What the injector needs of a system under test."""

    name: str

    def ranks(self) -> list[Rank]: ...

    async def lose_node(self, node: str) -> None: ...

    async def restore_node(self, node: str) -> None: ...


@dataclasses.dataclass
class Injected:
    at: float
    kind: str  # as done: a node loss may have become a rank kill
    target: str
    drawn: str  # as drawn


class Injector:
    """Carries out a schedule against a system; ends the hangs and node losses later."""

    def __init__(self, system: System, hang_s: float, node_down_s: float) -> None:
        self.system = system
        self.hang_s = hang_s
        self.node_down_s = node_down_s
        self.down: set[str] = set()
        self.stopped: set[int] = set()
        self.log: list[Injected] = []
        self.later: set[asyncio.Task[None]] = set()

    def _after(self, delay_s: float, action: Any) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await action()

        task = asyncio.create_task(run())
        self.later.add(task)
        task.add_done_callback(self.later.discard)

    async def run(self, failures: Sequence[Failure], t0: float) -> None:
        for failure in failures:
            await asyncio.sleep(max(0.0, t0 + failure.at_s - time.time()))
            await self.inject(failure)

    async def inject(self, failure: Failure) -> None:
        up = [n for n in NODES if n not in self.down]
        kind = failure.kind
        if kind == "node_loss" and len(up) < len(NODES):
            kind = "rank_kill"
        if kind == "node_loss":
            node = up[int(failure.pick * len(up))]
            self.down.add(node)
            await self.system.lose_node(node)

            async def back() -> None:
                await self.system.restore_node(node)
                self.down.discard(node)

            self._after(self.node_down_s, back)
            self.log.append(Injected(time.time(), kind, node, failure.kind))
            return
        ranks = sorted((r for r in self.system.ranks() if r.pid not in self.stopped),
                       key=lambda r: (r.node, r.pid))
        if not ranks:
            self.log.append(Injected(time.time(), "none", "no rank alive", failure.kind))
            return
        rank = ranks[int(failure.pick * len(ranks))]
        born = started_at(rank.pid)
        if kind == "hang" and signal_pid(rank.pid, signal.SIGSTOP):
            self.stopped.add(rank.pid)

            async def cont() -> None:
                if started_at(rank.pid) == born:
                    signal_pid(rank.pid, signal.SIGCONT)
                self.stopped.discard(rank.pid)

            self._after(self.hang_s, cont)
        elif kind != "hang":
            signal_pid(rank.pid, signal.SIGKILL)
        self.log.append(Injected(time.time(), kind, f"{rank.node}/{rank.pid}", failure.kind))

    async def close(self) -> None:
        for task in list(self.later):
            task.cancel()
        for pid in self.stopped:  # a stopped process never dies of SIGTERM
            signal_pid(pid, signal.SIGCONT)


# --- phalanx ---------------------------------------------------------------------------


class Phalanx:
    """W as an elastic job of 1..4 replicas on a local cluster of two agents."""

    name = "phalanx"

    def __init__(self, work: Path, options: list[str], order: ElasticOrder) -> None:
        self.work = work
        self.options = options
        self.order = order
        self.records = work / "records"
        self.cluster = LocalCluster(work / "cluster", agents=len(NODES),
                                    slots_per_agent=RANKS_PER_NODE, nats_port=0,
                                    heartbeat_interval_s=0.2)
        self.events: recovery.Arrivals = {"fault": [], "generation": []}
        self.bus: Bus | None = None
        self.nodes: dict[str, str] = {}  # our node name -> the agent's

    async def start(self) -> None:
        os.environ.update({settings.HEALTH("cordon_faults"): "1000000",
                           settings.ELASTICITY("max_replacements"): "1000000"})
        await self.cluster.start()
        self.nodes = dict(zip(NODES, sorted(self.cluster.agents), strict=True))
        self.bus = await Bus.connect(BusConfig.load(env={}, servers=[self.cluster.nats_url
                                                                     or ""]), name="goodput")
        await recovery.watch_recovery(self.bus, self.events)
        spec = JobSpec(name=JOB, team="bench", priority_class="normal",
                       replicas=ReplicaRange(min=1, max=WORLD),
                       command=[sys.executable, str(recovery.EXAMPLES / "train_mlp.py"),
                                *self.options, "--steps", "100000000"],
                       env={environment.RECORD_DIR: str(self.records)},
                       restart_policy=RestartPolicy(max_restarts=1_000_000))
        await AdmissionClient(self.bus).submit(spec, JOB)

    def commits(self) -> list[Commit]:
        return [Commit(s.committed_at, s.step) for s in record.timeline(record.read(self.records))]

    def ranks(self) -> list[Rank]:
        names = {agent: node for node, agent in self.nodes.items()}
        return [Rank(names[m.parent.name], r["pid"])
                for m in (self.cluster.data_dir / "agents").glob("*/ranks.json")
                if m.parent.name in names
                for r in running_in_manifest(m) if r["job_id"] == JOB]

    async def lose_node(self, node: str) -> None:
        ranks = [r for r in self.ranks() if r.node == node]
        self.cluster.agents[self.nodes[node]].send_signal(signal.SIGKILL)
        for rank in ranks:
            signal_pid(rank.pid, signal.SIGKILL)

    async def restore_node(self, node: str) -> None:
        await self.cluster.restart(self.nodes[node])

    async def stop(self) -> None:
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await AdmissionClient(self.bus).cancel(JOB, retry_s=5)
            await self.bus.close()
        await self.cluster.stop()

    def analyse(self, log: list[Injected], start: float, end: float,
                step_s: float) -> dict[str, Any]:
        records = record.read(self.records)
        steps = record.timeline(records)
        kept = [s for s in steps if s.committed_at < end]
        problems = record.verify(records, self.order, len(kept))
        phases: dict[str, list[float]] = defaultdict(list)
        faults = sorted(t for t, _ in self.events["fault"])
        generations = sorted((t, g) for t, g in self.events["generation"]
                             if g.reason is GenerationReason.FAULT)
        applied = [line for lines in records.values() for line in lines
                   if line["kind"] == "generation" and "synced" in line]
        seen: set[int] = set()  # each generation once, for the first failure before it
        for injected in log:
            fault = next((t for t in faults if t >= injected.at - 0.5), None)
            if fault is None or fault > injected.at + 60:
                continue
            gen = next(((t, g) for t, g in generations if t >= fault), None)
            if gen is None or gen[1].generation in seen:
                continue
            seen.add(gen[1].generation)
            phases["detection"].append(max(0.0, fault - injected.at))
            phases["rendezvous"].append(gen[0] - fault)
            lines = [a for a in applied if a["generation"] == gen[1].generation]
            if lines:
                phases["rebuild"].append(max(a["built"] - a["received"] for a in lines))
                phases["state_recovery"].append(max(a["synced"] - a["built"] for a in lines))
        return {"samples_lost_or_repeated": 0 if not problems else None,
                "data_problems": problems[:10], "phases": phases, "redone_steps": 0,
                "data_note": "record.verify: every kept step trained on exactly its batch, "
                             "every complete epoch every sample once"}


# --- torchft ---------------------------------------------------------------------------


def launch(command: list[str], log: Path, marker: str, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    """Start a command in a session of its own, its output to ``log``, ``marker`` in its
    environment (:func:`recovery_baseline.kill_marked` finds its children by it)."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1",
                                     recovery_baseline.RUN_MARKER: marker, **(env or {})})


def torchrun_command(*argv: str) -> list[str]:
    """torchrun restarting its workers without limit, checking them every 0.1 s. (A hung
    worker never handles the SIGTERM of a restart: torch 2.13's agent waits 30 s for it,
    hard-coded in ``LocalElasticAgent._stop_workers``, before its SIGKILL.)"""
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1000000",
            "--monitor-interval", "0.1", *argv]


def read_lines(directory: Path, pattern: str) -> list[dict[str, Any]]:
    """Every JSON line of the files matching ``pattern`` (a line cut short is skipped),
    each with its file's stem as ``file``."""
    lines = []
    for path in sorted(directory.glob(pattern)):
        for text in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                lines.append({**json.loads(text), "file": path.stem})
    return lines


class Agents(abc.ABC):
    """The torch systems' torchrun agents by node: a node's ranks are their children, a
    node loss SIGKILLs both, and the node comes back as the same commands started again."""

    name: str

    def __init__(self, work: Path) -> None:
        self.work = work
        self.marker = f"goodput-{os.getpid()}-{time.time_ns()}"
        self.agents: dict[str, list[subprocess.Popen[bytes]]] = {}

    @abc.abstractmethod
    def agent_commands(self, node: str) -> list[list[str]]:
        """The commands of ``node``'s torchrun agents."""

    def start_node(self, node: str) -> None:
        self.agents[node] = [launch(c, self.work / f"{node}.log", self.marker)
                             for c in self.agent_commands(node)]

    def ranks(self) -> list[Rank]:
        return [Rank(node, pid) for node, agents in self.agents.items() for a in agents
                if a.poll() is None for pid in children(a.pid)]

    async def lose_node(self, node: str) -> None:
        ranks = [r.pid for r in self.ranks() if r.node == node]
        for agent in self.agents.pop(node, []):
            agent.kill()
            agent.wait()
        for pid in ranks:
            signal_pid(pid, signal.SIGKILL)

    async def restore_node(self, node: str) -> None:
        self.start_node(node)

    async def stop(self) -> None:
        for node in list(self.agents):
            await self.lose_node(node)
        recovery_baseline.kill_marked(f"{recovery_baseline.RUN_MARKER}={self.marker}")


class Torchft(Agents):
    """Four torchft replica groups of one rank, two a node, each under torchrun."""

    name = "torchft"

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        super().__init__(work)
        self.args = args
        self.records = work / "records"
        self.port = free_port()
        self.lighthouse: subprocess.Popen[bytes] | None = None

    def agent_commands(self, node: str) -> list[list[str]]:
        first = NODES.index(node) * RANKS_PER_NODE
        return [torchrun_command(
            "--standalone", "--nproc-per-node", "1", str(BENCH / "torchft_worker.py"),
            "--group", str(g), "--groups", str(WORLD), "--min-replicas", "1",
            "--data-dir", str(self.args.data_dir), "--widths", self.args.widths,
            "--record-dir", str(self.records), "--timeout", str(self.args.torch_timeout))
            for g in range(first, first + RANKS_PER_NODE)]

    async def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        bin_dir = Path(sys.executable).parent
        # torchft's README: a 100 ms quorum tick, stragglers waited for 10 s.
        self.lighthouse = launch([str(bin_dir / "torchft_lighthouse"), "--min_replicas", "1",
                                  "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                                  "--bind", f"[::]:{self.port}"],
                                 self.work / "lighthouse.log", self.marker)
        os.environ["TORCHFT_LIGHTHOUSE"] = f"http://localhost:{self.port}"
        for node in NODES:
            self.start_node(node)

    def commits(self) -> list[Commit]:
        by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for line in read_lines(self.records, "group-*.jsonl"):
            if line["kind"] == "step" and line["committed"]:
                by_step[line["step"]].append(line)
        return [Commit(max(x["t"] for x in lines), step,
                       max(x["participants"] for x in lines) / WORLD)
                for step, lines in sorted(by_step.items())]

    async def stop(self) -> None:
        await super().stop()
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait()
        os.environ.pop("TORCHFT_LIGHTHOUSE", None)

    def analyse(self, log: list[Injected], start: float, end: float,
                step_s: float) -> dict[str, Any]:
        lines = [x for x in read_lines(self.records, "group-*.jsonl") if x["t"] < end]
        steps = [x for x in lines if x["kind"] == "step"]
        # A batch is its group's (epoch, position) in its shard since its process started:
        # a process started again reads its shard from the start.
        batch = workload_w.W_GLOBAL_BATCH // WORLD
        used: dict[tuple[str, int, int], int] = defaultdict(int)
        dropped: set[tuple[str, int, int]] = set()
        for x in steps:
            key = (x["file"], x["epoch"], x["position"])
            if x["committed"]:
                used[key] += 1
            else:
                dropped.add(key)
        repeated = sum(n - 1 for n in used.values()) * batch
        lost = len(dropped - set(used)) * batch
        # A killed group's new process: started (torchrun noticed and restarted it) ->
        # ready (imports, manager, model) -> its first commit (quorum, state from a peer).
        # The others train on meanwhile: this time is short-handed, not stalled.
        info: dict[str, list[float]] = defaultdict(list)
        group_of = {x["pid"]: x["file"] for x in lines}
        for injected in log:
            pid = int(injected.target.rpartition("/")[2]) if injected.kind == "rank_kill" \
                else None
            if pid not in group_of:
                continue
            new = next((x for x in lines if x["file"] == group_of[pid]
                        and x["kind"] == "start" and x["t"] > injected.at), None)
            if new is None:
                continue
            mine = [x for x in lines if x["pid"] == new["pid"]]
            ready = next((x["t"] for x in mine if x["kind"] == "ready"), None)
            first = next((x["t"] for x in mine if x["kind"] == "step" and x["committed"]),
                         None)
            info["restart"].append(new["t"] - injected.at)
            if ready is not None and first is not None:
                info["ready"].append(ready - new["t"])
                info["heal_and_first_step"].append(first - ready)
        return {"samples_lost_or_repeated": lost + repeated, "samples_lost": lost,
                "samples_repeated": repeated, "phases": {},
                "group_restart_medians_s": {k: round(statistics.median(v), 3)
                                            for k, v in info.items()},
                "uncommitted_steps": len({x["step"] for x in steps if not x["committed"]
                                          and start <= x["t"] < end}),
                "redone_steps": 0,
                "data_note": "torchft's DistributedSampler per replica group, its position "
                             "not saved (as torchft's train_ddp.py): a restarted group reads "
                             "its shard again from the start (repeated); a batch trained in a "
                             "step not committed is not read again (lost)"}


# --- torchrun + DCP --------------------------------------------------------------------


class Torchrun(Agents):
    """Two torchrun agents of two ranks (``--nnodes 1:2``), DCP every ``ckpt_every`` steps."""

    name = "torchrun"

    def __init__(self, work: Path, args: argparse.Namespace, ckpt_every: int,
                 checkpoint_s: float) -> None:
        super().__init__(work)
        self.args = args
        self.ckpt_every = ckpt_every
        self.checkpoint_s = checkpoint_s
        self.records = work / "records"
        self.port = free_port()
        self.store: Any = None

    def agent_commands(self, node: str) -> list[list[str]]:
        return [torchrun_command(
            "--nnodes", f"1:{len(NODES)}", "--nproc-per-node", str(RANKS_PER_NODE),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", self.marker, "--rdzv-conf", "is_host=false,last_call_timeout=1",
            str(recovery_baseline.WORKER), *worker_options(self.args),
            "--steps", "100000000", "--ckpt-dir", str(self.work / "ckpt"),
            "--record-dir", str(self.records), "--ckpt-every", str(self.ckpt_every),
            "--ckpt-keep", "2", "--pg-timeout", str(self.args.torch_timeout))]

    async def start(self) -> None:
        import torch.distributed as dist

        self.work.mkdir(parents=True, exist_ok=True)
        # The rendezvous' store lives here, on no node: a node loss leaves it.
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True,
                                   wait_for_workers=False)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        for node in NODES:
            self.start_node(node)

    def commits(self) -> list[Commit]:
        last: dict[int, float] = {}
        for x in read_lines(self.records, "rank-*.jsonl"):
            if x["phase"] == "step":
                last[x["step"]] = max(last.get(x["step"], 0.0), x["t"])
        return [Commit(t, step) for step, t in sorted(last.items())]

    async def stop(self) -> None:
        await super().stop()
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        self.store = None

    def analyse(self, log: list[Injected], start: float, end: float,
                step_s: float) -> dict[str, Any]:
        lines = sorted((x for x in read_lines(self.records, "rank-*.jsonl") if x["t"] < end),
                       key=lambda x: x["t"])
        phases: dict[str, list[float]] = defaultdict(list)
        redone = 0
        rounds: set[float] = set()  # each restart once, for the first failure before it
        for injected in log:
            after = [x for x in lines if x["t"] > injected.at]
            loaded = next((x for x in after if x["phase"] == "loaded"), None)
            if loaded is None or loaded["t"] > injected.at + 120 or loaded["t"] in rounds:
                continue
            rounds.add(loaded["t"])
            # The round that loaded: its ranks' records within the seconds before.
            round_ = [x for x in after if x["t"] <= loaded["t"] + 2]
            started = [x["t"] for x in round_ if x["phase"] == "start"]
            group = [x["t"] for x in round_ if x["phase"] == "process_group"]
            done = max(x["t"] for x in round_ if x["phase"] == "loaded")
            if started and group:
                phases["detection_and_restart"].append(min(started) - injected.at)
                phases["rendezvous"].append(max(group) - min(started))
                phases["state_recovery"].append(done - max(group))
            high = max((x["step"] for x in lines if x["phase"] == "step"
                        and x["t"] < loaded["t"]), default=0)
            lost = max(0, high - loaded["step"])
            redone += lost
            phases["redone_steps"].append(lost * step_s)
        saves = {x["step"] for x in lines if x["phase"] == "saved" and start <= x["t"] < end}
        phases["checkpoints"].append(len(saves) * self.checkpoint_s)
        return {"samples_lost_or_repeated": 0, "phases": phases, "redone_steps": redone,
                "checkpoints": len(saves), "ckpt_every_steps": self.ckpt_every,
                "data_note": "each step reads its batch by its number: a restart from the "
                             "checkpoint reads the redone steps' batches again (redone, not "
                             "kept twice)"}


def worker_options(args: argparse.Namespace) -> list[str]:
    return ["--widths", args.widths, "--samples", str(args.samples), "--data-dir",
            str(args.data_dir)]


def calibrate_torchrun(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """torchrun's fault-free step time and DCP checkpoint cost, 4 ranks on one agent."""
    every, steps = 5, args.calibrate_steps
    code = recovery_baseline.torchrun(steps=steps, worker_args=worker_options(args),
                                      work_dir=work, world=WORLD, ckpt_every=every,
                                      timeout_s=args.timeout, kill=None)
    if code != 0:
        raise RuntimeError(f"torchrun's calibration exited {code}; see {work}/torchrun.log")
    lines = recovery_baseline.read_records(work / "records")
    commit: dict[int, float] = defaultdict(float)
    saved: dict[int, float] = defaultdict(float)
    for x in lines:
        if x["phase"] == "step":
            commit[x["step"]] = max(commit[x["step"]], x["t"])
        elif x["phase"] == "saved":
            saved[x["step"]] = max(saved[x["step"]], x["t"])
    skip = 3  # start-up
    gaps = [commit[s] - commit[s - 1] for s in commit
            if s > skip and s - 1 in commit and (s - 1) % every]
    costs = [saved[s] - commit[s] for s in saved if s > skip]
    return {"step_s": statistics.median(gaps), "checkpoint_s": statistics.median(costs)}


# --- one run ---------------------------------------------------------------------------


async def until_training(system: Any, timeout_s: float) -> float:
    """Wait until the system has committed a few steps; the time then."""
    deadline = time.time() + timeout_s
    while len(system.commits()) < 3:
        if time.time() > deadline:
            raise TimeoutError(f"{system.name} committed no steps within {timeout_s:g} s; "
                               f"see {system.work}")
        await asyncio.sleep(0.5)
    return time.time()


async def measure(system: Any, args: argparse.Namespace, mtbf_s: float) -> dict[str, Any]:
    """Start ``system``, let it train ``--calibrate`` s without faults (its step time),
    inject the failures for ``--duration`` s; its figures."""
    failures = schedule(args.seed, mtbf_s, args.duration)
    injector = Injector(system, args.hang_s, args.node_down_s)
    load = os.getloadavg()[0]
    try:
        await system.start()
        began = await until_training(system, args.timeout)
        await asyncio.sleep(args.calibrate)
        start = time.time()
        step_s = median_step_s(system.commits(), began + args.calibrate / 4, start)
        await injector.run(failures, start)
        await asyncio.sleep(max(0.0, start + args.duration - time.time()))
        end = time.time()
    finally:
        await injector.close()
        await system.stop()
    commits = system.commits()
    work, eff = efficiency(commits, start, end, step_s)
    result: dict[str, Any] = system.analyse(injector.log, start, end, step_s)
    n = max(1, len(injector.log))
    # Per failure: the stall split into the phases measured within it (each failure's
    # phases summed over the failures, over their number), the rest of it "stalled, other".
    parts = lost_time(commits, start, end, step_s)
    phases = result.pop("phases")
    causes = {name: sum(values) / n for name, values in phases.items()}
    causes["stalled, other"] = parts["stalled"] / n - sum(causes.values())
    causes.update({k: v / n for k, v in parts.items() if k != "stalled"})
    lost = sum(parts.values())
    return {"system": system.name, "mtbf_s": mtbf_s, "efficiency": round(eff, 4),
            "committed_steps": round(work, 2), "wall_s": round(end - start, 2),
            "fault_free_step_s": round(step_s, 4), "failures": len(injector.log),
            "by_kind": {k: sum(i.kind == k for i in injector.log) for k in MIX},
            "lost_s": round(lost, 2), "lost_per_failure_s": round(lost / n, 3),
            "lost_s_by_part": {k: round(v, 2) for k, v in parts.items()},
            "lost_per_failure_by_cause_s": {k: round(v, 3) for k, v in causes.items()},
            "phase_medians_s": {k: round(statistics.median(v), 3)
                                for k, v in phases.items() if v},
            "load_before": load,
            "load_after": os.getloadavg()[0],
            "injected": [dataclasses.asdict(i) | {"at": round(i.at - start, 2)}
                         for i in injector.log], **result}


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    widths = tuple(int(w) for w in args.widths.split(","))
    workload_w.prepare(args.data_dir, args.samples, widths)
    order = ElasticOrder(args.samples, workload_w.W_GLOBAL_BATCH)
    report: dict[str, Any] = {"date": utc_date(), "command": command_line("goodput.py",
                                                                         sys.argv[1:]),
                              "widths": args.widths, "seed": args.seed,
                              "duration_s": args.duration, "mix": MIX, "runs": []}
    calibration = None
    if "torchrun" in args.systems:
        calibration = await asyncio.to_thread(calibrate_torchrun, args, work / "calibrate")
        report["torchrun_calibration"] = calibration
        print(json.dumps({"torchrun_calibration": calibration}), flush=True)
    options = ["--data-dir", str(args.data_dir), "--widths", args.widths,
               "--samples", str(args.samples)]
    for mtbf in args.mtbf:
        for name in args.systems:
            where = work / f"{name}-{mtbf:g}"
            system: Any
            if name == "phalanx":
                system = Phalanx(where, options, order)
            elif name == "torchft":
                system = Torchft(where, args)
            else:
                assert calibration is not None
                interval = young_daly_s(calibration["checkpoint_s"], mtbf)
                system = Torchrun(where, args,
                                  max(1, round(interval / calibration["step_s"])),
                                  calibration["checkpoint_s"])
            result = await measure(system, args, mtbf)
            if name == "torchrun":
                assert calibration is not None
                result["young_daly_s"] = round(young_daly_s(calibration["checkpoint_s"],
                                                            mtbf), 2)
            report["runs"].append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "injected"}),
                  flush=True)
    return report


# --- the record and the plot -----------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in SYSTEMS:
        runs = sorted((r["mtbf_s"], r["efficiency"]) for r in report["runs"]
                      if r["system"] == name)
        if runs:
            ax.plot([m for m, _ in runs], [e * 100 for _, e in runs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("mean time between failures (s)")
    ax.set_ylabel("efficiency (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"W on 4 CPU ranks, {report['duration_s']:g} s per system and MTBF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section(report: dict[str, Any]) -> str:
    rows = []
    for r in report["runs"]:
        causes = ", ".join(f"{k} {v:.2f}" for k, v in r["lost_per_failure_by_cause_s"].items())
        kinds = ", ".join(f"{k} {v}" for k, v in r["by_kind"].items())
        rows.append(f"| {r['mtbf_s']:g} | {r['system']} | {r['efficiency'] * 100:.1f} % | "
                    f"{r['committed_steps']:g} | {r['fault_free_step_s'] * 1000:.0f} | "
                    f"{r['failures']} ({kinds}) | {r['samples_lost_or_repeated']} | "
                    f"{r['lost_s_by_part']['stalled']:.1f} | "
                    f"{r['lost_per_failure_s']:.2f} | {causes} | "
                    f"{r['load_before']:.1f} / {r['load_after']:.1f} |")
    calibration = report.get("torchrun_calibration")
    ckpt = "" if calibration is None else (
        f" torchrun's calibration: step {calibration['step_s'] * 1000:.0f} ms, DCP "
        f"checkpoint {calibration['checkpoint_s'] * 1000:.0f} ms; checkpoint every " + ", ".join(
            f"{r['ckpt_every_steps']} steps ({r['young_daly_s']:g} s) at MTBF {r['mtbf_s']:g} s"
            for r in report["runs"] if r["system"] == "torchrun") + ".")
    return (f"\n## goodput.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
            f"W widths {report['widths']}, 4 ranks on two nodes of two; "
            f"{report['duration_s']:g} s of failures per system and MTBF after a fault-free "
            f"calibration; failures Poisson from seed {report['seed']}, mix "
            + ", ".join(f"{k} {v:.0%}" for k, v in report["mix"].items()) + "." + ckpt
            + "\n\n| MTBF (s) | system | efficiency | steps | fault-free step (ms) | "
            "failures | samples lost or repeated | stalled (s) | lost per failure (s) | "
            "lost per failure by cause (s) | load avg before / after |\n"
            "|---:|---|---:|---:|---:|---|---:|---:|---:|---|---|\n" + "\n".join(rows)
            + f"\n\nPlot: bench/{PLOT.name}.\n")


#: The numeric options: flag, type, default, help.
NUMBERS: tuple[tuple[str, type, float, str], ...] = (
    ("--duration", float, 300.0, "seconds of failures per system and MTBF"),
    ("--seed", int, 0, "of the failure schedule"),
    ("--calibrate", float, 15.0, "fault-free seconds before the failures: the step time"),
    ("--calibrate-steps", int, 30, "torchrun's calibration run (a checkpoint every 5 steps)"),
    ("--hang-s", float, 30.0, "a hung rank its system has not killed is let go on after this"),
    ("--node-down-s", float, 30.0, "a lost node's agents and ranks start again after this"),
    ("--torch-timeout", float, 5.0, "torchft's and torchrun's collective timeout (s)"),
    ("--samples", int, 64 * 40, "W's dataset"),
    ("--timeout", float, 300.0, "seconds a system may take to start training"),
)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtbf", type=float, nargs="+", default=[300.0, 60.0, 15.0],
                        help="mean seconds between failures, one run of each system each")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        type=lambda s: [x for x in s.split(",") if x])
    for flag, kind, default, text in NUMBERS:
        parser.add_argument(flag, type=kind, default=kind(default), help=text)
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)))
    parser.add_argument("--data-dir", type=Path,
                        help="default: phalanx-bench-goodput in the temporary directory")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--project", action="store_true",
                        help="run nothing: print ETTR projected to 1k-100k GPUs "
                             "(bench/goodput_model.py, docs/goodput.md)")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it (logs, records) instead of a temp dir")
    return parser


def projection_section(table: str, argv: Sequence[str]) -> str:
    return (f"\n## goodput.py --project — {utc_date()}\n\nCommand: "
            f"`{command_line('goodput.py', argv)}`\n\nETTR projected from the costs "
            "measured here, Meta's failure rate and Llama 3's mix (the model, every input "
            "and its source: docs/goodput.md and the JSON line):\n\n" + table)


def project(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the projection's table and, last, its JSON; record it unless --no-record."""
    rows = goodput_model.projections()
    table = goodput_model.table(rows)
    print(table)
    if not args.no_record:
        append(projection_section(table, argv))
    print(json.dumps({"project": goodput_model.report(rows, MAX_PAYLOAD_BYTES),
                      "date": utc_date(), "command": command_line("goodput.py", argv)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if args.project:
        return project(args, sys.argv[1:] if argv is None else argv)
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; of {','.join(SYSTEMS)}")
    args.data_dir = args.data_dir or Path(tempfile.gettempdir()) / "phalanx-bench-goodput"
    with tempfile.TemporaryDirectory(prefix="phalanx-goodput-") as tmp:
        report = asyncio.run(run(args, args.keep or Path(tmp)))
    plot(report, args.plot)
    if not args.no_record:
        append(section(report))
    print(json.dumps({"goodput": report["runs"],
                      **{k: v for k, v in report.items() if k != "runs"}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

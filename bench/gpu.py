"""The runtime on a GPU: recovery of the GPT on CUDA, NCCL generations, snapshots off the
device, and a ported DDP script that keeps NCCL and its DDP wrapper.

Four phases, each in a process of its own (a phase that hangs or fails is reported
and the next still runs; each writes what it has measured as it goes):

* **(a) recovery on CUDA.** ``examples/train_gpt.py`` as a 4-replica job of a local
  cluster whose 2 agents list GPU 0 for each of their 2 slots (``agent.gpus``): the
  ranks share the GPU over gloo with CUDA tensors (``backend: gloo``; NCCL refuses two
  ranks on one device), in deterministic mode, with the default checkpoint policy.
  ``r1-0`` SIGKILLs itself mid-all-reduce at ``--kill-step``; the survivors go on, a
  replacement joins. Measured from the records and the bus: the survivors' downtime,
  steps lost, and whether the final parameters are bitwise those of the same script
  alone (``PHALANX_DETERMINISTIC=1``, no job).
* **(b) NCCL generations at world size 1.** ``--generations`` rounds of what the session
  does at a fault, in this process: rendezvous of an NCCL group (non-blocking
  communicator, through the same :func:`~phalanx.runtime.group.rendezvous`), a collective
  (a device tensor and a staged host one), abort (:meth:`~phalanx.runtime.group.Waits.abandon`,
  the call the session's ``_abandon`` makes: the training thread's share, and the abort on
  its own thread until released), and a step on the device after it; every other
  generation is built while the last one's abort is under way. With the GPU memory in use
  (``cudaMemGetInfo``: NCCL's buffers are outside torch's allocator) and the process's
  threads once the aborts ended. Then the same rebuild as a split of a long-lived parent
  communicator (``ncclCommSplit``), and a communicator given up while it waits for a
  peer that never comes. A collective blocked on a *dead peer* cannot be staged on one
  GPU: that needs two ranks, two GPUs.
* **(c) snapshots of a GPU state** of ``--state-gb``: device → pinned host on the side
  stream (:class:`~phalanx.runtime.device_staging.DeviceStaging`) against one plain ``copy_``
  of the same bytes into pageable memory (and the CPU path's copy of the state, tensor
  by tensor); the host side (pinned → a /dev/shm buffer, xxh3); how much a copy running
  beside compute slows the compute. Then the GPT's step with the default checkpoint
  policy against the same loop under torchrun + DDP, one rank each (NCCL), the arms
  alternated (``--overhead-rounds``). Target: at most 5 % slower.

* **(d) the ported DDP script on CUDA** (``examples/chargpt.py``: on a GPU its own
  ``init_process_group("nccl")``, ``cuda:LOCAL_RANK`` and ``DDP(model, device_ids=...)``,
  its scheduler not registered) as a 1-replica job that declares its session, with the
  memory tier every step, on one agent whose 2 slots are GPU 0; ``r0-0`` SIGKILLs itself
  at ``--port-kill-step``, so the whole job is restored from its node's memory by a
  replacement, started cold, then (second job) from a warm spare, which becomes the
  replica of the other slot (``LOCAL_RANK`` must be 0 there). Each must end bitwise equal
  to the script alone, its scheduler too.

``--cpu`` runs the same phases on the CPU with small sizes, to show the script works end
to end where there is no GPU: the NCCL phases run gloo instead, and the JSON says so.

    python bench/gpu.py                 # on a GPU, under 8 minutes
    python bench/gpu.py --cpu           # here

Prints one JSON line per phase, then one JSON object as its last line; appends its
figures to bench/RESULTS.md naming the device (``--no-record``: not).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.schemas import environment, settings

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

PHASES = ("a", "b", "c", "d")


# --- (a) recovery of the GPT on CUDA ----------------------------------------------------------


def gpt_options(args: argparse.Namespace) -> list[str]:
    return ["--data-dir", str(args.data_dir), *args.gpt_options.split()]


def run_alone(args: argparse.Namespace, save: Path, steps: int) -> None:
    """The GPT script alone (no job: world size 1), deterministic, saving its result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    env[environment.DETERMINISTIC] = "1"  # alone, the script trains on cuda:0 where there is one
    subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), *gpt_options(args),
                    "--steps", str(steps), "--save", str(save)], env=env, check=True,
                   capture_output=True, timeout=args.timeout)


def phase_a(args: argparse.Namespace, out: Callable[[dict[str, Any]], None]) -> None:
    from phalanx.bench import recovery
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig
    from phalanx.examples import train_gpt
    from phalanx.runtime import record
    from phalanx.runtime.data import ElasticOrder
    from phalanx.runtime.dataset import TokenWindows
    from phalanx.schemas.messages import (
        CollectiveBackend,
        JobSpec,
        JobState,
        ReplicaRange,
    )

    gpt = train_gpt.arguments().parse_args(gpt_options(args))
    result: dict[str, Any] = {"backend": "gloo", "device": device_name(args),
                              "ranks": 4, "steps": args.steps, "kill_step": args.kill_step,
                              "spares": args.spares}
    # A spare waits on a node with a free slot, and a replacement starts on its slot's
    # node: with spares, one agent of 5 slots (admission would pack 2 x 3 as 3 + 1).
    agents, slots = (1, 5) if args.spares else (2, 2)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.cpu:  # every slot on GPU 0
            os.environ[settings.AGENT("gpus")] = ",".join(["0"] * slots)
        url = recovery.cluster_up(work / "cluster", agents, slots)
        events: recovery.Arrivals = {"fault": [], "generation": []}
        try:
            async def run() -> Any:
                async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
                    await recovery.watch_recovery(bus, events)
                    spec = JobSpec(
                        name="gpt", team="bench", priority_class="normal",
                        replicas=ReplicaRange(min=2, max=4), backend=CollectiveBackend.GLOO,
                        command=[sys.executable, str(ROOT / "examples" / "train_gpt.py"),
                                 *gpt_options(args), "--steps", str(args.steps),
                                 "--save", str(work / "phalanx.pt")],
                        env={environment.RECORD_DIR: str(work / "records"),
                             environment.DETERMINISTIC: "1",
                             environment.CHAOS_KILL: f"r1-0:{args.kill_step}:allreduce"},
                        hang_timeout_s=10.0, grace_period_s=5.0, spares=args.spares)
                    return await recovery.run_job(bus, spec, "gpt-gpu", args.timeout)

            ended = asyncio.run(run())
        finally:
            recovery.cli("down", "--data-dir", str(work / "cluster"))
            result["rank_starts"] = rank_starts(work / "cluster" / "logs")
        result["job"] = ended.state.value
        if ended.state is not JobState.FINISHED:
            result["error"] = f"the job ended {ended.state.value}: {ended.reason}"
            out(result)
            return
        order = ElasticOrder(len(TokenWindows(args.data_dir, gpt.block_size)), gpt.global_batch,
                             gpt.seed)
        result |= recovery.analyse_phalanx(record.read(work / "records"), events, order,
                                           args.steps)
        result["replacement_joined"] = "join_pause_s" in result
        out(result)
        run_alone(args, work / "alone.pt", args.steps)
        ours, alone = (torch.load(work / name, map_location="cpu")["model"]
                       for name in ("phalanx.pt", "alone.pt"))
        result["bitwise_equal_to_alone"] = all(torch.equal(ours[k], alone[k]) for k in alone)
        result["max_abs_difference"] = max(float((ours[k].double() - alone[k].double())
                                                 .abs().max()) for k in alone)
    out(result)


def rank_starts(logs: Path) -> dict[str, int]:
    """How the agents started processes, read from their logs: zygotes ready, and the
    launches that fell back to a cold start (a zygote refuses to fork once CUDA is up)."""
    text = "".join(path.read_text(errors="replace") for path in sorted(logs.glob("*.log")))
    return {"zygotes_ready": text.count("zygote ready"),
            "cold_fallbacks": text.count("starting cold") + text.count("ranks start cold"),
            "spares_started": text.count("spare started"),
            "spares_taken": text.count("spare taken")}


# --- (d) the ported DDP script on CUDA -------------------------------------------------------

PORT = ROOT / "examples" / "chargpt.py"


def port_options(args: argparse.Namespace) -> list[str]:
    return ["--data-dir", str(args.data_dir), "--epochs", "1", "--log-every", "100",
            *args.port_options.split()]


def phase_d(args: argparse.Namespace, out: Callable[[dict[str, Any]], None]) -> None:
    from phalanx.bench import recovery
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig
    from phalanx.runtime import record
    from phalanx.runtime.data import ElasticOrder
    from phalanx.runtime.dataset import TokenWindows
    from phalanx.schemas.messages import CheckpointPolicy, JobSpec, JobState, ReplicaRange

    port = vars(train_options(port_options(args)))
    order = ElasticOrder(len(TokenWindows(args.data_dir, port["block_size"])),
                         port["global_batch"], port["seed"])
    result: dict[str, Any] = {"device": device_name(args), "steps": order.steps_per_epoch,
                              "kill_step": args.port_kill_step, "jobs": {}}
    plain = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.monotonic()
        # The reference: one process, a world of one (torchrun --nproc-per-node 1).
        subprocess.run([sys.executable, str(PORT), *port_options(args), "--save",
                        str(work / "alone.pt")], check=True, capture_output=True,
                       timeout=args.timeout, env={**plain, **environment.WORLD_OF_ONE,
                                                  environment.DETERMINISTIC: "1"})
        result["alone_s"] = time.monotonic() - started
        out(result)
        alone = torch.load(work / "alone.pt", map_location="cpu")
        if not args.cpu:  # both slots on GPU 0: a spare waits beside the rank
            os.environ[settings.AGENT("gpus")] = "0,0"
        url = recovery.cluster_up(work / "cluster", 1, 2)
        try:
            for name, spares in (("cold", 0), ("spare", 1)):
                job = work / name
                spec = JobSpec(
                    name=f"port-{name}", team="bench", priority_class="normal",
                    replicas=ReplicaRange(min=1, max=1), spares=spares, session=True,
                    checkpoint=CheckpointPolicy(memory_every_steps=1),
                    command=[sys.executable, str(PORT), *port_options(args),
                             "--save", str(job / "phalanx.pt")],
                    env={environment.RECORD_DIR: str(job / "records"),
                         environment.DETERMINISTIC: "1",
                         environment.CHAOS_KILL: f"r0-0:{args.port_kill_step}:boundary"},
                    hang_timeout_s=30.0, grace_period_s=5.0)

                async def run(spec: JobSpec = spec, name: str = name) -> Any:
                    async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
                        return await recovery.run_job(bus, spec, f"port-{name}", args.timeout)

                job_started = time.monotonic()
                ended = asyncio.run(run())
                outcome: dict[str, Any] = {"job": ended.state.value,
                                           "seconds": time.monotonic() - job_started}
                result["jobs"][name] = outcome
                if ended.state is not JobState.FINISHED:
                    outcome["error"] = f"the job ended {ended.state.value}: {ended.reason}"
                    out(result)
                    continue
                records = record.read(job / "records")
                outcome["replicas"] = sorted(records)
                outcome["restores"] = [
                    {k: line.get(k) for k in ("step", "tier", "reached", "seconds")}
                    for lines in records.values() for line in lines
                    if line["kind"] == "restore"]
                outcome["problems"] = record.verify(records, order, order.steps_per_epoch)
                ours = torch.load(job / "phalanx.pt", map_location="cpu")
                outcome["bitwise_equal_to_alone"] = all(
                    torch.equal(ours["model"][k], v) for k, v in alone["model"].items())
                outcome["scheduler_equal"] = ours["scheduler"] == alone["scheduler"]
                outcome["max_abs_difference"] = max(
                    float((ours["model"][k].double() - v.double()).abs().max())
                    for k, v in alone["model"].items())
                out(result)
        finally:
            recovery.cli("down", "--data-dir", str(work / "cluster"))
            result["rank_starts"] = rank_starts(work / "cluster" / "logs")
    out(result)


def train_options(argv: list[str]) -> argparse.Namespace:
    from phalanx.examples.chargpt_model import arguments

    return arguments("the port's options").parse_args(argv)


# --- (b) NCCL generations at world size 1 ---------------------------------------------------


def used_memory(on: torch.device) -> int:
    """Device memory in use (the GPU's, by anyone), or this process's resident memory."""
    if on.type == "cuda":
        free, total = torch.cuda.mem_get_info(on)
        return total - free
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def phase_b(args: argparse.Namespace, out: Callable[[dict[str, Any]], None]) -> None:
    from phalanx.runtime.group import Waits, rendezvous
    from phalanx.runtime.inbox import Inbox
    from phalanx.runtime.placement import Backend
    from phalanx.schemas.messages import Generation, GenerationReason, Member

    on = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    backend = Backend.GLOO if args.cpu else Backend.NCCL
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timeout, use_libuv=True)
    waits = Waits(Inbox("r0-0"), lambda: None)
    model = torch.nn.Linear(1024, 1024, device=on)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    result: dict[str, Any] = {"device": device_name(args), "backend": backend.value,
                              "generations": args.generations}
    if args.cpu:
        result["substituted"] = ("gloo at world size 1 on the CPU in place of NCCL: the "
                                 "generation cycle's code, not NCCL's costs; a gloo group is "
                                 "kept when given up, not aborted")

    def generation(number: int, name: str) -> Generation:
        return Generation(job_id="bench", generation=number, world_size=1,
                          rendezvous=f"{name}-g{number}", resume_step=0,
                          reason=GenerationReason.FAULT,
                          members=[Member(replica_id="r0-0", rank=0, node_id="n",
                                          endpoint=f"127.0.0.1:{store.port}")])

    def step() -> float:
        """A training step on the device after the abort; its loss."""
        loss = model(torch.randn(64, 1024, device=on)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    cycles = []
    for number in range(args.generations):
        # Every other generation is built while the last one's abort is still under way
        # (the session never waits for an abort); the others wait for it, then measure.
        started = time.perf_counter()
        group = rendezvous(waits, {}, ("r0-0", store), generation(number, "full"), 0, timeout,
                           lambda: None, backend, on)
        built = time.perf_counter()
        summed, staged = torch.ones(1 << 20, device=on), torch.arange(8)
        for tensor in (summed, staged):
            waits.work(group.allreduce([tensor]), lambda: False)
        right = summed.eq(1).all().item() and staged.tolist() == list(range(8))
        collective = time.perf_counter()
        waits.abandon(group)
        given_up = time.perf_counter()
        loss = step()
        cycle = {"init_s": built - started, "collective_s": collective - built,
                 "abandon_s": given_up - collective, "step_ok": loss == loss and right}
        if number % 2:
            if not waits.aborted(60):
                raise RuntimeError(f"generation {number}'s NCCL abort did not end in 60 s")
            cycle |= {"abort_s": time.perf_counter() - collective,
                      "memory": used_memory(on), "threads": threads()}
        cycles.append(cycle)
    measured = [c for c in cycles if "memory" in c]
    memory = [c["memory"] for c in measured]
    result["full_init"] = summary([c["init_s"] for c in cycles])
    result["abandon"] = summary([c["abandon_s"] for c in cycles])
    if not args.cpu:
        result["abort_until_released"] = summary([c["abort_s"] for c in measured])
    result["collective"] = summary([c["collective_s"] for c in cycles])
    result["step_after_every_abort"] = all(c["step_ok"] for c in cycles)
    result["memory_bytes"] = {"after_4": memory[min(1, len(memory) - 1)], "last": memory[-1],
                              "growth_after_4": memory[-1] - memory[min(1, len(memory) - 1)],
                              "max": max(memory)}
    result["threads"] = {"first": measured[0]["threads"], "last": measured[-1]["threads"]}
    result["kept_groups"] = len(waits.abandoned)
    out(result)
    if not args.cpu:
        result["split"] = split_cycles(args, store, on, timeout, waits)
        out(result)
        result["blocked_init"] = blocked_init(store, on, timeout, waits, generation, step)
    out(result)


def split_cycles(args: argparse.Namespace, store: Any, on: torch.device, timeout: Any,
                 waits: Any) -> dict[str, Any]:
    """The rebuild as ``ncclCommSplit`` of a parent communicator that lives on."""
    from torch.distributed import ProcessGroupNCCL

    from phalanx.runtime.group import DeviceGroup, connect, nccl_ready
    from phalanx.runtime.placement import Backend

    try:
        parent = connect(dist.PrefixStore("parent/", store), 0, 1, timeout, Backend.NCCL, on)
        assert isinstance(parent, DeviceGroup)
        nccl_ready(parent)
        times = []
        for number in range(args.generations):
            started = time.perf_counter()
            options = ProcessGroupNCCL.Options()
            options.config.blocking = 0
            options._timeout = timeout
            options.split_from = parent.backend
            options.split_color = 1
            options.global_ranks_in_group = [0]
            child = DeviceGroup(ProcessGroupNCCL(dist.PrefixStore(f"split-{number}/", store),
                                                 0, 1, options), Backend.NCCL, on)
            nccl_ready(child)
            times.append(time.perf_counter() - started)
            waits.abandon(child)
        splits = parent.backend.comm_split_count()
        waits.abandon(parent)
        waits.aborted(60)
        return {"init": summary(times), "comm_split_count": splits,
                "note": "a split needs every rank of the parent alive and calling it: usable "
                        "for a planned leave, not after a fault (the parent is aborted then) "
                        "nor for a join (the joiner is in no parent)"}
    except Exception as exc:  # an API this torch lacks, or NCCL's refusal: reported
        return {"error": f"{type(exc).__name__}: {exc}"}


def blocked_init(store: Any, on: torch.device, timeout: Any, waits: Any,
                 generation: Callable[[int, str], Any], step: Callable[[], float]
                 ) -> dict[str, Any]:
    """A communicator of two ranks whose second never comes (a member dead before the
    generation formed), given up while NCCL initialises it and aborted; then a new
    generation's collective and a step on the device, while that abort is under way.
    (A receive that no send matches would be the in-flight case, but NCCL 2.28 refuses a
    receive from itself as invalid usage; a peer that dies mid-collective needs two GPUs.)"""
    from phalanx.runtime.group import Aborted, DeviceGroup, connect, nccl_ready, rendezvous
    from phalanx.runtime.placement import Backend

    try:
        group = connect(dist.PrefixStore("blocked/", store), 0, 2, timeout, Backend.NCCL, on)
        assert isinstance(group, DeviceGroup)
        deadline = time.monotonic() + 0.5
        try:
            waits.call(lambda: nccl_ready(group),
                       lambda: "rank 1 never came" if time.monotonic() > deadline else None)
            return {"error": "a communicator of two initialised with one rank"}
        except Aborted:
            pass
        started = time.perf_counter()
        waits.abandon(group)
        abandon_s = time.perf_counter() - started
        after = rendezvous(waits, {}, ("r0-0", store), generation(1, "blocked"), 0, timeout,
                           lambda: None, Backend.NCCL, on)
        probe = torch.ones(4, device=on)
        waits.work(after.allreduce([probe]), lambda: False)
        next_collective_s = time.perf_counter() - started
        loss = step()
        waits.abandon(after)
        released = waits.aborted(60)
        return {"abandon_s": abandon_s, "next_generation_collective_s": next_collective_s,
                "aborts_ended_s": time.perf_counter() - started if released else None,
                "collective_after": probe.tolist() == [1.0] * 4, "step_after": loss == loss}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# --- (c) snapshots of a GPU state, and the GPT step against DDP -----------------------------


def phase_c(args: argparse.Namespace, out: Callable[[dict[str, Any]], None]) -> None:
    result: dict[str, Any] = {"device": device_name(args)}
    result["snapshot"] = snapshot_bandwidth(args)
    out(result)
    result["overhead"] = {}
    step_overhead(args, result["overhead"], lambda: out(result))
    out(result)


def snapshot_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    from phalanx.runtime.device_staging import DeviceStaging
    from phalanx.runtime.flat_state import copy_range, flat_state
    from phalanx.runtime.snapshot import write_share

    on = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    # Parameters a third of the state, AdamW's two moments the rest.
    width = 4096 if args.state_gb >= 1 else 1024
    layers = max(1, round(args.state_gb * 1e9 / 3 / (width * width * 4)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False, device=on)
                                  for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = flat_state(model, optimizer, {}, 1)
    total = state.total
    result: dict[str, Any] = {"state_bytes": total}

    def best(run: Callable[[], object], repeat: int = 3) -> float:
        times = []
        for _ in range(repeat):
            sync(on)
            started = time.perf_counter()
            run()
            sync(on)
            times.append(time.perf_counter() - started)
        return min(times)

    pageable = torch.empty(total, dtype=torch.uint8)
    result["copy_range_pageable_gbps"] = total / best(
        lambda: copy_range(state, 0, pageable)) / 1e9
    if not args.cpu:
        flat = torch.empty(total, dtype=torch.uint8, device=on)
        result["plain_copy_pageable_gbps"] = total / best(lambda: pageable.copy_(flat)) / 1e9
        staging = DeviceStaging(on)

        def staged() -> None:
            staging.start(state, 0, 1)
            assert staging.copied is not None
            staging.copied.synchronize()

        result["staged_to_pinned_gbps"] = total / best(staged) / 1e9
        result["overlap"] = overlap(on, staging, state)
        source = staging.start(state, 0, 1)
        assert staging.copied is not None
        staging.copied.synchronize()
        del flat
    else:
        source = None
    meta = b"m" * 4096
    shm = Path("/dev/shm")  # where agents keep snapshots; a small one would SIGBUS the write
    room = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize if shm.is_dir() else 0
    result["host_write_to"] = "/dev/shm" if room > 2 * total else tempfile.gettempdir()
    with tempfile.NamedTemporaryFile(dir=result["host_write_to"]) as f:
        f.truncate(total + 2 * 4096 + len(meta))
        buffer = mmap.mmap(f.fileno(), 0)
        result["host_write_gbps"] = total / best(lambda: write_share(
            memoryview(buffer), state, meta, "bench", 1, 0, 0, 1, source)) / 1e9
        buffer.close()
    result["what"] = ("host_write: pinned (GPU) or the live state (CPU) -> a /dev/shm buffer, "
                      "xxh3 over it, header; on a GPU the writer thread does it, off the "
                      "training thread")
    return result


def overlap(on: torch.device, staging: Any, state: Any) -> dict[str, float]:
    """Compute time alone, and while a snapshot's copy runs on the side stream."""
    a = torch.randn(4096, 4096, device=on)

    def compute() -> float:
        sync(on)
        started = time.perf_counter()
        for _ in range(20):
            a @ a
        sync(on)
        return time.perf_counter() - started

    compute()
    alone = min(compute() for _ in range(3))
    staging.start(state, 0, 1)
    beside = compute()
    staging.copied.synchronize()
    return {"compute_alone_s": alone, "compute_beside_copy_s": beside,
            "slowdown": beside / alone - 1}


def step_overhead(args: argparse.Namespace, result: dict[str, Any],
                  written: Callable[[], None]) -> None:
    """The GPT's median step under phalanx (one replica, the default checkpoint policy) and
    under torchrun + DDP (one rank), alternated, into ``result``; ``written()`` after each
    run, so a phase out of time still reports the runs it made."""
    from phalanx.bench import recovery, recovery_baseline
    from phalanx.bus.client import Bus
    from phalanx.bus.config import BusConfig
    from phalanx.runtime import record
    from phalanx.schemas.messages import JobSpec, JobState, ReplicaRange

    device = "cpu" if args.cpu else "cuda"
    runs: dict[str, list[float]] = {"phalanx": [], "ddp": []}
    result |= {"backend": "gloo" if args.cpu else "nccl", "world_size": 1, "runs_step_s": runs}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.cpu:
            os.environ[settings.AGENT("gpus")] = "0,0"
        started = time.monotonic()
        url = recovery.cluster_up(work / "cluster")
        result["cluster_up_s"] = time.monotonic() - started
        try:
            for n in range(args.overhead_rounds):
                for arm in ("phalanx", "ddp") if n % 2 == 0 else ("ddp", "phalanx"):
                    if arm == "ddp":
                        figures = recovery_baseline.run_fault_free(
                            steps=args.overhead_steps, worker_args=[
                                "--workload", "gpt", "--device", device, *gpt_options(args)],
                            work_dir=work / f"ddp-{n}", skip=args.overhead_skip, world=1,
                            timeout_s=args.timeout)
                        runs["ddp"].append(figures["step_s"])
                        written()
                        continue
                    rec = work / f"phalanx-{n}"

                    async def run(rec: Path = rec, n: int = n) -> Any:
                        async with await Bus.connect(BusConfig.load(env={}, servers=[url])
                                                     ) as bus:
                            spec = JobSpec(
                                name="gpt", team="bench", priority_class="normal",
                                replicas=ReplicaRange(min=1, max=1),
                                command=[sys.executable,
                                         str(ROOT / "examples" / "train_gpt.py"),
                                         *gpt_options(args), "--steps",
                                         str(args.overhead_steps)],
                                env={environment.RECORD_DIR: str(rec)}, hang_timeout_s=30.0)
                            return await recovery.run_job(bus, spec, f"gpt-overhead-{n}",
                                                          args.timeout)

                    ended = asyncio.run(run())
                    if ended.state is not JobState.FINISHED:
                        raise RuntimeError(f"the job ended {ended.state.value}: {ended.reason}")
                    steps = [s for s in record.timeline(record.read(rec))
                             if s.step >= args.overhead_skip]
                    runs["phalanx"].append(statistics.median(
                        b.committed_at - a.committed_at for a, b in itertools.pairwise(steps)))
                    written()
        finally:
            recovery.cli("down", "--data-dir", str(work / "cluster"))
    medians = {arm: statistics.median(values) for arm, values in runs.items()}
    overhead = medians["phalanx"] / medians["ddp"] - 1
    result |= {"median_step_s": medians, "overhead": overhead,
               "target_5_percent": overhead <= 0.05}


# --- the driver -------------------------------------------------------------------------------


def sync(on: torch.device) -> None:
    if on.type == "cuda":
        torch.cuda.synchronize(on)


def summary(values: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values)}


def device_name(args: argparse.Namespace) -> str:
    if args.cpu:
        return f"CPU ({os.cpu_count()} cores), no GPU"
    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA " \
           f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"


PHASE_RUNS = {"a": phase_a, "b": phase_b, "c": phase_c, "d": phase_d}


def run_phase(args: argparse.Namespace, phase: str, argv: list[str]) -> dict[str, Any]:
    """One phase in a process of its own; what it wrote last, and how it ended. One that
    outlasts its time gets SIGTERM (it stops the cluster it started), then SIGKILL."""
    limit = args.phase_timeouts[phase]
    with tempfile.NamedTemporaryFile(suffix=".json") as out, \
            tempfile.TemporaryFile("w+") as errors:
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, __file__, *argv, "--phase", phase,
                                    "--out", out.name], stdout=errors, stderr=errors)
        try:
            code = process.wait(timeout=limit)
            ended = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            ended = f"timed out after {limit:.0f} s"
        errors.seek(0)
        tail = errors.read()[-3000:]
        text = Path(out.name).read_text()
        result = json.loads(text) if text else {}
        return {**result, "ended": ended, "seconds": time.monotonic() - started,
                **({} if ended == "ok" else {"output_tail": tail})}


def record_results(report: dict[str, Any]) -> None:
    from phalanx.bench.results import append

    append(results_section(report))


def results_section(report: dict[str, Any]) -> str:
    """bench/RESULTS.md's section: the headline figures of each phase, then its JSON."""
    def get(result: dict[str, Any], *path: str) -> Any:
        for key in path:
            result = result.get(key, {}) if isinstance(result, dict) else {}
        return None if result == {} else result

    def fmt(value: Any, scale: float = 1.0, unit: str = "", digits: int = 3) -> str:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "-" if value is None else str(value)
        if isinstance(value, int) and scale == 1.0:
            return f"{value}{unit}"
        return f"{value * scale:.{digits}f}{unit}"

    a, b, c, d = (report["phases"].get(p, {}) for p in PHASES)
    port_rows = [
        ("(d)", f"the DDP port, {job} replacement: job; restored from; bitwise equal to "
                "alone; scheduler equal; problems",
         f"{fmt(get(d, 'jobs', job, 'job'))}; "
         f"{fmt(get(d, 'jobs', job, 'restores') and json.dumps(get(d, 'jobs', job, 'restores')))}"
         f"; {fmt(get(d, 'jobs', job, 'bitwise_equal_to_alone'))}; "
         f"{fmt(get(d, 'jobs', job, 'scheduler_equal'))}; "
         f"{fmt(get(d, 'jobs', job, 'problems') and json.dumps(get(d, 'jobs', job, 'problems')))}")
        for job in ("cold", "spare")]
    rows = [
        ("(a)", "survivors' downtime beyond a step", fmt(get(a, "downtime_s"), unit=" s")),
        ("(a)", "steps lost or redone", fmt(get(a, "steps_lost_or_redone"))),
        ("(a)", "replacement joined; its pause", f"{fmt(get(a, 'replacement_joined'))}; "
                                                 f"{fmt(get(a, 'join_pause_s'), unit=' s')}"),
        ("(a)", "warm spares per node; spares taken",
         f"{fmt(get(a, 'spares'))}; {fmt(get(a, 'rank_starts', 'spares_taken'))}"),
        ("(a)", "from the kill to full strength", fmt(get(a, "full_strength_s"), unit=" s")),
        ("(a)", "final parameters bitwise equal to the script alone",
         fmt(get(a, "bitwise_equal_to_alone"))),
        ("(a)", "median step, 4 ranks", fmt(get(a, "median_step_s"), unit=" s")),
        ("(b)", f"rebuild, full initialisation ({get(b, 'backend')}), median",
         fmt(get(b, "full_init", "median_s"), 1000, " ms", 1)),
        ("(b)", "rebuild, split of a parent, median",
         fmt(get(b, "split", "init", "median_s"), 1000, " ms", 1)
         if get(b, "split", "init") else fmt(get(b, "split", "error"))),
        ("(b)", "giving a generation up, the training thread's share, median",
         fmt(get(b, "abandon", "median_s"), 1000, " ms", 2)),
        ("(b)", "the abort on its own thread, until released (NCCL), median",
         fmt(get(b, "abort_until_released", "median_s"), 1000, " ms", 1)),
        ("(b)", f"memory growth over generations 5..{get(b, 'generations')}",
         fmt(get(b, "memory_bytes", "growth_after_4"), 2**-20, " MiB", 1)),
        ("(b)", "threads, first and last generation",
         f"{fmt(get(b, 'threads', 'first'))} → {fmt(get(b, 'threads', 'last'))}"),
        ("(b)", "a step on the device after every abort",
         fmt(get(b, "step_after_every_abort"))),
        ("(b)", "abort of an initialisation waiting for a peer that never comes",
         fmt(get(b, "blocked_init") and json.dumps(get(b, "blocked_init")))),
        ("(c)", "state", fmt(get(c, "snapshot", "state_bytes"), 1e-9, " GB", 2)),
        ("(c)", "device → pinned, side stream",
         fmt(get(c, "snapshot", "staged_to_pinned_gbps"), unit=" GB/s", digits=1)),
        ("(c)", "plain copy_ to pageable memory",
         fmt(get(c, "snapshot", "plain_copy_pageable_gbps"), unit=" GB/s", digits=1)),
        ("(c)", "the CPU path's copy, tensor by tensor",
         fmt(get(c, "snapshot", "copy_range_pageable_gbps"), unit=" GB/s", digits=1)),
        ("(c)", "host side: into /dev/shm, xxh3",
         fmt(get(c, "snapshot", "host_write_gbps"), unit=" GB/s", digits=1)),
        ("(c)", "compute slowed by a copy beside it",
         fmt(get(c, "snapshot", "overlap", "slowdown"), 100, " %", 1)),
        ("(c)", "GPT step, phalanx (default checkpoint policy) against DDP, one rank",
         fmt(get(c, "overhead", "overhead"), 100, " %", 1)),
        *port_rows,
    ]
    lines = [f"\n## gpu.py — {report['date']}\n", f"Command: `{report['command']}`\n",
             f"Device: {report['device']}.\n"]
    if report["cpu"]:
        lines.append("No GPU: the phases ran on the CPU with small sizes, NCCL's phases over "
                     "gloo, to show the script works end to end; none of these figures is a "
                     "GPU's.\n")
    ran = {f"({p})" for p in report["phases"]}
    lines.append("| phase | figure | value |\n|---|---|---|\n" + "\n".join(
        f"| {phase} | {name} | {value} |" for phase, name, value in rows if phase in ran) + "\n")
    lines.append("Ended: " + ", ".join(f"({p}) {r['ended']} in {r['seconds']:.0f} s"
                                        for p, r in report["phases"].items()) + ".\n")
    lines += [f"({p}) `{json.dumps(r, sort_keys=True)}`\n" for p, r in report["phases"].items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="the same phases on the CPU with small sizes (no GPU)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--steps", type=int, help="(a) the job's steps")
    parser.add_argument("--kill-step", type=int, help="(a)")
    parser.add_argument("--spares", type=int, default=0,
                        help="(a) warm spares (then one agent of 5 slots, not 2 of 2)")
    parser.add_argument("--gpt-options", help="(a), (c): the GPT's size options")
    parser.add_argument("--generations", type=int, help="(b)")
    parser.add_argument("--state-gb", type=float, help="(c) the snapshot's state")
    parser.add_argument("--overhead-steps", type=int, help="(c)")
    parser.add_argument("--overhead-skip", type=int, default=10, help="(c) start-up steps")
    parser.add_argument("--overhead-rounds", type=int, help="(c) pairs of runs")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--timeout", type=float, default=300, help="one job or run")
    parser.add_argument("--port-options", help="(d) the GPT's size options")
    parser.add_argument("--port-kill-step", type=int, help="(d)")
    parser.add_argument("--phase-timeouts", default="a=200,b=120,c=200,d=200",
                        help="seconds each phase may take, e.g. a=200,b=120,c=200")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    small = args.cpu
    # (a) runs long enough after the kill for the replacement (a new process: torch, CUDA)
    # to join the survivors before the end.
    defaults = {"steps": 200 if small else 300, "kill_step": 8 if small else 20,
                "gpt_options": "--layers 2 --embd 64 --heads 4" if small else "",
                "generations": 10 if small else 50, "state_gb": 0.05 if small else 1.2,
                "overhead_steps": 40 if small else 300, "overhead_rounds": 1 if small else 2,
                "port_options": "--layers 2 --embd 64 --heads 4 --global-batch 64",
                "port_kill_step": 40 if small else 120}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.data_dir = args.data_dir or Path(tempfile.gettempdir()) / "phalanx-bench-gpt"
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU, or with --cpu")
    args.phase_timeouts = {name: float(value) for name, _, value in (
        item.partition("=") for item in args.phase_timeouts.split(","))}
    if args.phase is not None:  # one phase, in this process
        def out(result: dict[str, Any]) -> None:
            args.out.write_text(json.dumps(result))

        # SIGTERM (the phase ran out of time) unwinds: a cluster it started is stopped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

        PHASE_RUNS[args.phase](args, out)
        return 0

    from phalanx.bench.results import utc_date
    from phalanx.examples import chargpt_model
    from phalanx.runtime.dataset import TokenWindows

    os.environ.setdefault(settings.HEALTH("cordon_faults"), "1000")
    try:
        TokenWindows(args.data_dir, 64)
    except FileNotFoundError:
        chargpt_model.prepare(args.data_dir)
    argv = [a for a in sys.argv[1:] if a != "--no-record"]
    report: dict[str, Any] = {"date": utc_date(), "command": " ".join(sys.argv),
                              "cpu": args.cpu, "phases": {}}
    for phase in [p for p in args.phases.split(",") if p]:
        report["phases"][phase] = run_phase(args, phase, argv)
        print(json.dumps({phase: report["phases"][phase]}), flush=True)
    # Named by the phases (this process never starts CUDA: its context would hold memory).
    report["device"] = next((r["device"] for r in report["phases"].values() if "device" in r),
                            "unknown: no phase ran")
    if not args.no_record:
        record_results(report)
    print(json.dumps(report))
    return 0 if all(r["ended"] == "ok" for r in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the in-memory snapshot costs a step on W: step time with snapshots every step vs
without, in one run, next to the bound a memcpy of the bytes per step sets.

* **Step time**: ``examples/train_mlp.py`` on W as a 4-replica job on a local cluster
  (``phalanx up``, 2 agents x 2 slots), alternately with ``checkpoint.memory_every_steps``
  0 (no snapshot) and 1 (every committed step), ``--repeat`` pairs; the median gap
  between consecutive committed steps (the replicas' records), the first
  ``--warmup`` steps left out. Overhead = on / off - 1.
  Beside it, the median time of a rank's snapshot in the training thread (the
  ``snapshot_s`` of the replicas' commit records: state views, meta, copy, checksum).
* **Bound**: the bytes one rank snapshots per step (its 1/4 share of W's model and
  AdamW state, as ``runtime/snapshot.py`` lays it out), timed in this process: a plain
  ``memcpy`` of them (``torch`` copy into a preallocated buffer) and the runtime's own
  ``write_share`` (copy + xxh3-64 + header) into a buffer of the same size. Bound =
  write_share time / step time without snapshots.

Not measured yet (issue 12): buddy replication, recovery time per source, and the
torchrun + DCP restart next to them.

Prints one JSON object as its last line and appends the figures to bench/RESULTS.md::

    python bench/snapshot.py                 # W, 1 pair of runs of 60 steps
    python bench/snapshot.py --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import pickle
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

import torch  # noqa: E402
import workload_w  # noqa: E402
from results import append, utc_date  # noqa: E402

from phalanx.bus.client import Bus, Delivery  # noqa: E402
from phalanx.bus.config import BusConfig  # noqa: E402
from phalanx.runtime import record, snapshot_file  # noqa: E402
from phalanx.runtime.snapshot import flat_state, write_share  # noqa: E402
from phalanx.schemas import subjects  # noqa: E402
from phalanx.schemas.messages import (  # noqa: E402
    CheckpointPolicy,
    JobRecord,
    JobSpec,
    JobState,
    ReplicaRange,
)
from phalanx.services.client import AdmissionClient  # noqa: E402

SCRIPT = BENCH.parent / "examples" / "train_mlp.py"
WORLD = 4


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "phalanx.services.cli", *args], check=True,
                   capture_output=True, timeout=120)


async def step_time(bus: Bus, args: argparse.Namespace, work: Path, name: str,
                    every: int) -> tuple[float, float | None]:
    """Median seconds between committed steps of one run with snapshots every ``every``,
    and the median time a rank's snapshot took in it (the runtime's ``snapshot_s``)."""
    rec = work / name
    done: asyncio.Future[JobRecord] = asyncio.get_running_loop().create_future()

    async def on_state(r: JobRecord, _: Delivery) -> None:
        if r.job_id == name and r.state.terminal and not done.done():
            done.set_result(r)

    sub = await bus.subscribe(subjects.job_states(), JobRecord, on_state)
    spec = JobSpec(
        name="w", team="bench", priority_class="normal",
        replicas=ReplicaRange(min=WORLD, max=WORLD),
        command=[sys.executable, str(SCRIPT), "--data-dir", str(args.data_dir),
                 "--widths", args.widths, "--samples", str(args.samples),
                 "--steps", str(args.steps)],
        env={"PHALANX_RECORD_DIR": str(rec)},
        checkpoint=CheckpointPolicy(memory_every_steps=every),
        hang_timeout_s=30.0, grace_period_s=5.0)
    await AdmissionClient(bus).submit(spec, name)
    ended = await asyncio.wait_for(done, args.timeout)
    await sub.unsubscribe()
    if ended.state is not JobState.FINISHED:
        raise RuntimeError(f"{name} ended {ended.state.value}: {ended.reason}")
    records = record.read(rec)
    steps = [s for s in record.timeline(records) if s.step >= args.warmup]
    taken = [line["snapshot_s"] for lines in records.values() for line in lines
             if line["kind"] == "commit" and line["step"] >= args.warmup
             and "snapshot_s" in line]
    return (statistics.median(b.committed_at - a.committed_at
                              for a, b in itertools.pairwise(steps)),
            statistics.median(taken) if taken else None)


def bound(widths: tuple[int, ...]) -> dict[str, float]:
    """The bytes one of WORLD ranks snapshots per step, and what copying them costs here."""
    torch.set_num_threads(1)
    model = workload_w.build_model(widths)
    optimizer = workload_w.build_optimizer(model)
    inputs = torch.randn(8, widths[0])
    torch.nn.functional.mse_loss(model(inputs), torch.randn(8, widths[-1])).backward()
    optimizer.step()  # the AdamW moments exist from here
    state = flat_state(model, optimizer, {}, 1)
    meta = pickle.dumps(state.meta)
    _, share = snapshot_file.share(state.total, 0, WORLD)
    source = torch.empty(share, dtype=torch.uint8)
    target = torch.empty(share, dtype=torch.uint8)
    buffer = bytearray(snapshot_file.HEADER_BYTES + len(meta) + share)

    def best_of(fn, n: int = 7) -> float:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return {"state_bytes": state.total, "share_bytes": share,
            "memcpy_s": best_of(lambda: target.copy_(source)),
            "write_share_s": best_of(lambda: write_share(memoryview(buffer), state, meta,
                                                         "bench", 1, 0, 0, WORLD))}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    widths = tuple(int(w) for w in args.widths.split(","))
    workload_w.prepare(args.data_dir, args.samples, widths)
    report: dict[str, Any] = {"date": utc_date(), "command": " ".join(sys.argv),
                              "widths": args.widths, "world_size": WORLD, "steps": args.steps,
                              "off_s": [], "on_s": [], "snapshot_s": []}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Path(tmp) / "cluster"
        cli("up", "--agents", "2", "--slots-per-agent", "2", "--detach", "--data-dir",
            str(cluster), "--nats-port", "0")
        try:
            url = json.loads((cluster / "up.json").read_text())["nats_url"]
            async with await Bus.connect(BusConfig.load(env={}, servers=[url])) as bus:
                for n in range(args.repeat):
                    for every, key in ((0, "off_s"), (1, "on_s")):
                        step_s, snapshot_s = await step_time(bus, args, Path(tmp),
                                                             f"w-{key[:-2]}-{n}", every)
                        report[key].append(step_s)
                        if every:
                            report["snapshot_s"].append(snapshot_s)
                        print(json.dumps({key: step_s, "snapshot_s": snapshot_s}), flush=True)
        finally:
            cli("down", "--data-dir", str(cluster))
    report.update(bound(widths))
    off, on = statistics.median(report["off_s"]), statistics.median(report["on_s"])
    report["overhead"] = on / off - 1
    report["bound"] = report["write_share_s"] / off
    return report


def record_results(report: dict[str, Any]) -> None:
    runs = ", ".join(f"{a * 1000:.1f}/{b * 1000:.1f}"
                     for a, b in zip(report["off_s"], report["on_s"], strict=True))
    append(f"\n## snapshot.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
           f"W widths {report['widths']}, {report['world_size']} ranks, {report['steps']} "
           "steps per run, runs without and with a memory snapshot every step alternated "
           "on one local cluster (2 agents x 2 slots).\n\n"
           "| figure | value |\n|---|---:|\n"
           f"| step time without / with snapshots, per pair (ms) | {runs} |\n"
           f"| overhead (medians) | {report['overhead'] * 100:.1f} % |\n"
           "| a rank's snapshot in the training thread, median per run (ms) | "
           + ", ".join(f"{s * 1000:.2f}" for s in report["snapshot_s"] if s is not None)
           + " |\n"
           f"| state bytes (model + AdamW) | {report['state_bytes']} |\n"
           f"| bytes one rank snapshots per step (1/{report['world_size']}) | "
           f"{report['share_bytes']} |\n"
           f"| plain memcpy of them (ms) | {report['memcpy_s'] * 1000:.2f} |\n"
           f"| write_share of them: copy + xxh3 + header (ms) | "
           f"{report['write_share_s'] * 1000:.2f} |\n"
           f"| bound: write_share / step time without (%) | {report['bound'] * 100:.1f} |\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(map(str, workload_w.W_WIDTHS)))
    parser.add_argument("--samples", type=int, default=64 * 40)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs (off, on)")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "phalanx-bench-w")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    if not args.no_record:
        record_results(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What SyncBatchNorm costs under the session: a micro-batch's forward and backward with it
over two gloo ranks, against plain BatchNorm.

Two ranks as threads of one process on a real gloo group, each running
examples/cnn_model.py's CNN on a micro-batch of its own: with ``BatchNorm2d``, or
converted with ``convert_sync_batchnorm`` and adopted by the session
(:mod:`phalanx.runtime.sync_batchnorm`: its statistics all-reduced over the group,
waited for as the session waits). Reported per micro-batch: the wall time (median
over the rounds; a loaded machine stretches it) and the process's CPU time (both
ranks, gloo's threads included), and SyncBatchNorm's against BatchNorm's. torch's
own SyncBatchNorm refuses CPU tensors, so it is not beside them.

    .venv/bin/python bench/sync_batchnorm.py [--rounds 200] [--batch 32] [--width 16]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from phalanx.bench.results import RESULTS_PATH, append, command_line, utc_date
from phalanx.examples.cnn_model import CNN, images
from phalanx.runtime.group import Aborted, GroupWork, Waits
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.sync_batchnorm import SyncRounds, adopt


class Members:
    """One gloo group as the session's membership: waits abortably, never gives up here."""

    def __init__(self, pg: Any) -> None:  # a ProcessGroupGloo (torch's stub: no collectives)
        self.pg = pg
        self.waits = Waits(Inbox("bench"), lambda: None)

    def wait(self, work: GroupWork) -> None:
        self.waits.work(work, lambda: False)

    def give_up(self, step: int, why: Aborted, kept: object = None) -> None:
        raise why  # nobody dies in a benchmark


def run(sync: bool, args: argparse.Namespace) -> tuple[list[float], float]:
    """Each round's wall seconds (both ranks done) and the process CPU seconds a round."""
    template = CNN(args.width)
    data = images(2 * args.batch, seed=1)
    store = dist.HashStore()
    barrier = threading.Barrier(2)
    walls: list[float] = []
    cpu: list[float] = []

    def rank(r: int) -> None:
        model = copy.deepcopy(template)
        rounds = None
        if sync:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=60))
            rounds = SyncRounds(Members(pg), adopt(model, deterministic=False,
                                                   grouped=False))
        x = data.tensors[0][r * args.batch:(r + 1) * args.batch]
        y = data.tensors[1][r * args.batch:(r + 1) * args.batch]
        for n in range(args.warmup + args.rounds):
            barrier.wait()
            if r == 0:
                started, started_cpu = time.perf_counter(), time.process_time()
            if rounds is not None:
                rounds.start(n)
                rounds.handing(0.5)
            (F.cross_entropy(model(x), y) * 0.5).backward()
            if rounds is not None:
                rounds.end()
            barrier.wait()
            if r == 0 and n >= args.warmup:
                walls.append(time.perf_counter() - started)
                cpu.append(time.process_time() - started_cpu)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return walls, statistics.mean(cpu)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="images a rank a round")
    parser.add_argument("--width", type=int, default=16, help="the CNN's first channels")
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the results to {RESULTS_PATH.name}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(1)
    figures: dict[str, float] = {}
    for name, sync in (("batchnorm", False), ("syncbatchnorm", True)):
        walls, cpu = run(sync, args)
        figures[f"{name}_wall_ms_p50"] = round(statistics.median(walls) * 1e3, 3)
        figures[f"{name}_cpu_ms"] = round(cpu * 1e3, 3)
    figures["wall_ratio"] = round(figures["syncbatchnorm_wall_ms_p50"]
                                  / figures["batchnorm_wall_ms_p50"], 2)
    figures["cpu_ratio"] = round(figures["syncbatchnorm_cpu_ms"] / figures["batchnorm_cpu_ms"],
                                 2)
    report = {"bench": "sync_batchnorm", "rounds": args.rounds, "batch": args.batch,
              "width": args.width, **figures}
    if not args.no_record:
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        append(f"\n## sync_batchnorm.py — {utc_date()}\n\n"
               f"Command: `{command_line('sync_batchnorm.py', argv)}`\n\n"
               f"Two gloo ranks as threads, examples/cnn_model.py's CNN (width {args.width}, "
               f"two BatchNorms), {args.batch} images a rank, {args.rounds} rounds; load "
               f"average {load} at the end.\n\n"
               "| a micro-batch's forward and backward | BatchNorm | SyncBatchNorm | ratio |\n"
               "|---|---:|---:|---:|\n"
               f"| wall ms, p50 | {figures['batchnorm_wall_ms_p50']} | "
               f"{figures['syncbatchnorm_wall_ms_p50']} | {figures['wall_ratio']} |\n"
               f"| CPU ms, both ranks | {figures['batchnorm_cpu_ms']} | "
               f"{figures['syncbatchnorm_cpu_ms']} | {figures['cpu_ratio']} |\n")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

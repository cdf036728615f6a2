"""A generation's rendezvous with 1k to 16k members: the runtime's own, beside torch's barrier.

What it measures
----------------
Every generation rendezvouses on the ``TCPStore`` its rank 0 hosts (``runtime/group.py``):
each member connects to it (unless it still holds a connection to the same host from a
generation before), counts itself in and waits until every member has; only then is
the process group built. This benchmark runs that part for ``N`` simulated members
with the runtime's own code: :func:`phalanx.runtime.group.arrive` against a store
hosted as a replica hosts it (:func:`phalanx.runtime.group.host_store`), in this
process, on loopback.

* **Members** are threads, ``N / --processes`` in each worker process, each with its
  own inbox, waits and store connection, as a member process has. Their waits run each
  blocking call on the member's own thread: the runtime's put each on a helper thread
  it can give up on, which at 16k members would be 32k threads, past this machine's
  ``pid_max`` (32,768). The requests the store sees are the same.
* **warm**: the connections were made beforehand (a fault's generation keeps its rank
  0, and the survivors their connection). **cold** (``--cold``): each member connects to
  the store first (the generation has a new rank 0: the job's first, or its rank 0
  died). Off by default: on this project's VMs (gVisor) about one torch store client
  connect in 25 stalls for 5 s (plain sockets do not), so cold figures measure that.
* **The store**: torch's ``TCPStore`` (libuv), as a job without a rendezvous secret
  hosts it; with ``--secured``, the members-only store a job with one hosts
  (:mod:`phalanx.runtime.store`: every connection proves the job's secret first, one
  thread serves them all) and its client, plain sockets.
* **Baseline**: torch's store barrier, as torchrun's c10d rendezvous and torch
  elastic's agents use it (``torch.distributed.elastic.utils.store.barrier``: an
  ``add``, a ``set`` by the last member, a ``wait`` on its key), called by the same
  threads over the same connections and store.

Each round's time runs from the instant the workers are told to go (every member
thread started and waiting on an event) to the last member's return; the median
member's is given too. The store's CPU seconds over the round are this process's (it
does nothing else meanwhile: its CPU is the store's libuv thread). At real scale every
member has a machine of its own, and the one store's work is what grows with N; here
the members' threads and the store share the machine's cores, so when the store's CPU
is well below the round's time, the rest is the simulation's.

Variants run in alternating order, ``--repeat`` rounds each; the figure is the median
round. Target (issue 55): the runtime's rendezvous <= 1 s at 16k members. The last
line of output is one JSON object; unless ``--no-record`` a section is appended to
bench/RESULTS.md. The exit status is 1 when a target is missed or a
member failed.

Run: ``.venv/bin/python bench/rendezvous.py [--members 1024 4096 16384] [--repeat 3]
[--secured]``
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier

from phalanx.bench.results import RESULTS_PATH, append, command_line, utc_date
from phalanx.runtime.group import Waits, arrive, host_store, store_client
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.store import StoreClient
from phalanx.schemas import environment
from phalanx.schemas.messages import Generation, GenerationReason, Member

T = TypeVar("T")
#: The stores' timeout: far beyond any round (a round that waits this long failed).
TIMEOUT = datetime.timedelta(seconds=120)
#: Each member thread's stack (Python's default, 8 MiB of address space, times 4,000).
STACK_BYTES = 256 * 1024
#: Connections a worker makes at once for the warm rounds.
CONNECTING = 512
TARGET_S = 1.0
TARGET_MEMBERS = 16_000
PHALANX, TORCH = "phalanx", "torch"
#: Which store the members meet on, by ``--secured``.
STORES = {False: "torch's TCPStore, libuv", True: "the members-only store, runtime/store.py"}
VARIANTS: list[tuple[str, bool]] = [(PHALANX, True), (TORCH, True), (PHALANX, False),
                                    (TORCH, False)]
WARM: list[tuple[str, bool]] = [(kind, cold) for kind, cold in VARIANTS if not cold]


def variant_name(kind: str, cold: bool) -> str:
    return f"{kind} {'cold' if cold else 'warm'}"


class InlineWaits(Waits):
    """The runtime's waits, each blocking call run on the calling member's thread."""

    def call(self, call: Callable[[], T], give_up: Callable[[], str | None]) -> T:
        return call()


def connection(port: int, secret: bytes | None) -> dist.Store:
    """A member's connection to the store, as :func:`arrive` makes it: torch's client, or
    with the job's ``secret`` the one that proves it."""
    return store_client("127.0.0.1", port, TIMEOUT, secret)


@dataclasses.dataclass(frozen=True)
class HostedAt:
    """Where the store the member of rank 0 hosts listens (hosted by the main process
    here): all :func:`arrive` reads of a replica's own store."""

    port: int


def generation(members: int, port: int, namespace: str) -> Generation:
    """A generation of ``members`` simulated replicas ``m<rank>``, rank 0's store at
    ``port``."""
    endpoint = f"127.0.0.1:{port}"
    return Generation(job_id="bench", generation=1, world_size=members,
                      members=[Member(replica_id=f"m{rank}", rank=rank, node_id="n",
                                      endpoint=endpoint) for rank in range(members)],
                      rendezvous=namespace, resume_step=0, reason=GenerationReason.FAULT)


def never() -> str | None:
    return None


# --- the worker processes --------------------------------------------------------------


class Round:
    """One round of a worker's members: each thread waits for ``go``, rendezvouses and
    notes when it returned."""

    def __init__(self, order: dict[str, Any], ranks: range, port: int, secret: bytes | None,
                 pool: list[dist.Store]) -> None:
        self.order, self.ranks, self.port, self.secret, self.pool = (order, ranks, port,
                                                                      secret, pool)
        self.go = threading.Event()
        self.ends = [0.0] * len(ranks)
        self.failures: list[str] = []
        members, namespace = order["members"], order["namespace"]
        self.generation = generation(members, port, namespace) if order["kind"] == PHALANX \
            else None
        self.threads = [threading.Thread(target=self.member, args=(i,), daemon=True)
                        for i in range(len(ranks))]

    def member(self, i: int) -> None:
        order, rank = self.order, self.ranks[i]
        pooled = None if order["cold"] else self.pool[i]
        self.go.wait()
        try:
            if self.generation is not None:
                stores: dict[str, dist.Store] = {} if pooled is None else {
                    self.generation.members[0].endpoint: pooled}
                waits = InlineWaits(Inbox(f"m{rank}"), lambda: None)
                own: Any = HostedAt(self.port)  # duck-typed: arrive reads its port alone
                arrive(waits, stores, (f"m{rank}", own), self.generation, TIMEOUT, never)
            else:
                store = pooled if pooled is not None else connection(self.port, self.secret)
                barrier(store, order["members"], key_prefix=f"{order['namespace']}/",
                        barrier_timeout=TIMEOUT.total_seconds())
        except Exception as exc:  # counted and reported: a member that did not get through
            self.failures.append(f"{type(exc).__name__}: {exc}")
        self.ends[i] = time.time()


def worker(conn: Connection, port: int, index: int, processes: int,
           secret: bytes | None) -> None:
    """Serve the orders of the main process: ``connect`` (the warm connections),
    ``close`` (them), ``round`` (start the members, say ``ready``, run them on ``go``,
    send back their end times and failures), ``None`` (exit)."""
    threading.stack_size(STACK_BYTES)
    if secret is not None:  # where arrive finds it, as a rank of such a job does
        os.environ[environment.STORE_SECRET] = secret.hex()
    pool: list[dist.Store] = []
    while (order := conn.recv()) is not None:
        ranks = range(index, order["members"], processes)
        if order["op"] == "connect":
            # Many at once: the VMs' 5 s connect stalls (see above) overlap.
            with ThreadPoolExecutor(CONNECTING) as connecting:
                pool = list(connecting.map(lambda _: connection(port, secret), ranks))
            conn.send("connected")
        elif order["op"] == "close":
            for store in pool:
                if isinstance(store, StoreClient):  # kept open until closed (its _open)
                    store.close()
            pool = []
            conn.send("closed")
        else:
            round_ = Round(order, ranks, port, secret, pool)
            for thread in round_.threads:
                thread.start()
            conn.send("ready")
            conn.recv()
            round_.go.set()
            for thread in round_.threads:
                thread.join()
            conn.send((round_.ends, round_.failures))


# --- the main process ------------------------------------------------------------------


class Workers:
    """The worker processes and the store they rendezvous on, hosted here."""

    def __init__(self, processes: int, secret: bytes | None) -> None:
        self.store = host_store(TIMEOUT, secret)
        context = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.processes = []
        for index in range(processes):
            here, there = context.Pipe()
            process = context.Process(target=worker, args=(there, self.store.port, index,
                                                           processes, secret), daemon=True)
            process.start()
            self.conns.append(here)
            self.processes.append(process)
        self.rounds = 0

    def order(self, order: dict[str, Any] | None) -> list[Any]:
        for conn in self.conns:
            conn.send(order)
        return [] if order is None else [conn.recv() for conn in self.conns]

    def round(self, members: int, kind: str, cold: bool) -> dict[str, Any]:
        """One rendezvous of ``members``; its figures."""
        self.rounds += 1
        self.order({"op": "round", "members": members, "kind": kind, "cold": cold,
                    "namespace": f"bench-{self.rounds}"})
        cpu, started = time.process_time(), time.time()
        for conn in self.conns:
            conn.send("go")
        results = [conn.recv() for conn in self.conns]
        store_cpu = time.process_time() - cpu
        ends = sorted(end for got, _ in results for end in got)
        failures = [failure for _, failed in results for failure in failed]
        return {"seconds": round(ends[-1] - started, 4),
                "median_member_s": round(ends[len(ends) // 2] - started, 4),
                "store_cpu_s": round(store_cpu, 3), "failures": len(failures),
                "first_failure": failures[0] if failures else ""}

    def close(self) -> None:
        self.order(None)
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()


def measure(workers: Workers, members: int, repeat: int,
            variants: list[tuple[str, bool]]) -> dict[str, Any]:
    """Each of ``variants`` at ``members``, ``repeat`` rounds each in alternating order:
    cold ones first, then warm ones over connections made for them."""
    rounds: dict[str, list[dict[str, Any]]] = {variant_name(*v): [] for v in variants}
    for cold in sorted({cold for _, cold in variants}, reverse=True):
        if not cold:
            workers.order({"op": "connect", "members": members})
        for _ in range(repeat):
            for kind, variant_cold in variants:
                if variant_cold is cold:
                    got = workers.round(members, kind, cold)
                    rounds[variant_name(kind, cold)].append(got)
                    failed = f", {got['failures']} failed" if got["failures"] else ""
                    print(f"  {members:>6} members, {variant_name(kind, cold):<13} "
                          f"{got['seconds']:8.3f} s (median member {got['median_member_s']:.3f} "
                          f"s, store CPU {got['store_cpu_s']:.2f} s{failed})", flush=True)
        if not cold:
            workers.order({"op": "close", "members": members})
    figures: dict[str, Any] = {}
    for name, each in rounds.items():
        median = sorted(each, key=lambda r: r["seconds"])[len(each) // 2]
        figures[name] = {**median, "rounds_s": [r["seconds"] for r in each],
                         "failures": sum(r["failures"] for r in each)}
    return figures


def judge(sizes: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The target at the sizes from :data:`TARGET_MEMBERS` up: the runtime's rendezvous,
    cold and warm, within :data:`TARGET_S`."""
    targets = {}
    for members, figures in sizes.items():
        if members < TARGET_MEMBERS:
            continue
        for cold in (True, False):
            if variant_name(PHALANX, cold) not in figures:
                continue
            measured = figures[variant_name(PHALANX, cold)]["seconds"]
            targets[f"{variant_name(PHALANX, cold).replace(' ', '_')}_{members}_s"] = {
                "target": f"<= {TARGET_S:g}", "measured": measured,
                "pass": measured <= TARGET_S}
    return targets


def markdown_section(report: dict[str, Any]) -> str:
    names = [variant_name(*v) for v in VARIANTS
             if variant_name(*v) in next(iter(report["sizes"].values()))]
    lines = [
        f"\n## rendezvous.py — {report['date']}\n",
        f"Command: `{report['command']}`\n",
        f"Python {report['python']}, torch {report['torch']}, {report['cpus']} CPUs, no GPU; "
        f"members are threads of {report['processes']} processes on loopback, the store "
        f"({report['store']}) in one more; median of {report['repeat']} round(s). Seconds "
        "from go to the last member through; in brackets the store's CPU seconds.\n",
        "| members | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for members, figures in report["sizes"].items():
        cells = [f"{figures[n]['seconds']:.3f} ({figures[n]['store_cpu_s']:.2f})"
                 + (f" **{figures[n]['failures']} failed**" if figures[n]["failures"] else "")
                 for n in names]
        lines.append(f"| {int(members):,} | " + " | ".join(cells) + " |")
    for name, target in report["targets"].items():
        lines.append(f"\n{name}: {target['measured']:.3f} s, target {target['target']} s: "
                     f"{'pass' if target['pass'] else '**FAIL**'}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="the sizes, simulated members (default 1024 4096 16384)")
    parser.add_argument("--processes", type=int, default=4,
                        help="worker processes the members' threads run in (default 4)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds per variant and size (default 3)")
    parser.add_argument("--cold", action="store_true",
                        help="also the variants that connect first (see above)")
    parser.add_argument("--secured", action="store_true",
                        help="the store a job with a rendezvous secret hosts "
                             "(runtime/store.py; its members prove the secret) rather "
                             "than torch's TCPStore")
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the results to {RESULTS_PATH.name}")
    args = parser.parse_args(argv)
    if min(args.members) < 1 or args.processes < 1 or args.repeat < 1:
        parser.error("--members, --processes and --repeat must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # The store holds a connection per member, and each worker its share.
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    if max(args.members) + 256 > most:
        print(f"at most {most} open files here: {max(args.members)} members do not fit",
              file=sys.stderr)
        return 2
    print(f"rendezvous benchmark: {args.members} members in {args.processes} processes, "
          f"{args.repeat} round(s) per variant", flush=True)
    secret = bytes.fromhex(environment.derive_store_secret(os.urandom(32), "bench")) \
        if args.secured else None
    workers = Workers(args.processes, secret)
    try:
        variants = VARIANTS if args.cold else WARM
        sizes = {members: measure(workers, members, args.repeat, variants)
                 for members in args.members}
    finally:
        workers.close()
    targets = judge(sizes)
    failed = sum(f["failures"] for figures in sizes.values() for f in figures.values())
    report = {
        "benchmark": "rendezvous",
        "date": utc_date(),
        "command": command_line("rendezvous.py", argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processes": args.processes,
        "store": STORES[args.secured],
        "repeat": args.repeat,
        "sizes": sizes,
        "targets": targets,
        "failures": failed,
        "pass": failed == 0 and all(t["pass"] for t in targets.values()),
    }
    for name, target in targets.items():
        print(f"target {name} {target['target']}: measured {target['measured']:.3f} -> "
              f"{'pass' if target['pass'] else 'FAIL'}", flush=True)
    if not args.no_record:
        append(markdown_section(report))
        print(f"appended to {RESULTS_PATH}", flush=True)
    print(json.dumps(report), flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the bus: request/reply latency over a real nats-server, and codec throughput.

What it measures
----------------
1. **Request/reply round trip on loopback.** A real ``nats-server`` is started
   (:class:`~phalanx.services.natsd.NatsServer`, free port, temporary JetStream
   store). A :class:`~phalanx.services.base.Service` serves one typed endpoint
   the way services do (``add_endpoint`` in ``setup()``, a handler returning a
   :class:`NodeRecord`), and a separate :class:`~phalanx.bus.client.Bus`
   connection calls ``bus.request(subject, NodeStatusRequest(), NodeRecord)``
   one request at a time, timing each with :func:`time.perf_counter_ns`.
   As a baseline, the same two connections do the same round trip with plain
   nats-py: ``nc.request`` against an ``nc.subscribe`` responder that echoes
   the request bytes. The difference is the cost of our typed, traced layer
   (codec, validation, span context managers, ``nats.micro`` dispatch).
   After a warm-up of each, the two variants run in alternating batches so
   that drift in the machine's state during the run hits both alike.
   Client, service and baseline responder share one process and one event
   loop (uvloop when importable); nats-server is a separate process.
   Tracing is measured as configured by the environment, which by default
   (no ``OTEL_*`` variables) means off.
2. **Codec throughput.** ``encode`` then ``decode`` of a ``NodeHeartbeat``
   in a tight loop, ``--codec-iterations`` pairs per repeat, 5 repeats; the
   best and the median rate are reported. Messages are built before timing.

Targets: typed round trip p99 < 1 ms; codec median >= 200,000 encode+decode/s.

Output: progress lines, then one JSON object with every figure as the last
line. Unless ``--no-record``, a section is appended to ``bench/RESULTS.md``.
The exit status is 1 when a target is missed.

Run: ``.venv/bin/python bench/bus.py [--requests N] [--codec-iterations N] [--no-record]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from phalanx.bench.results import RESULTS_PATH, append, command_line, utc_date
from phalanx.bus import telemetry
from phalanx.bus.client import Bus, Delivery
from phalanx.bus.config import BusConfig
from phalanx.schemas.codec import decode, encode
from phalanx.schemas.messages import NodeHeartbeat, NodeInfo, NodeRecord, NodeStatusRequest
from phalanx.services.base import Service
from phalanx.services.natsd import NatsServer

TYPED_SUBJECT = "phalanx.bench.status"
RAW_SUBJECT = "phalanx.bench.raw"
REQUEST_TIMEOUT_S = 2.0
CODEC_REPEATS = 5
ROUNDS = 10  # request batches, alternating between the variants
CODEC_POOL = 4096  # distinct heartbeats cycled through by the codec loop (power of two)

TARGET_P99_US = 1000.0
TARGET_CODEC_PER_S = 200_000.0

Call = Callable[[], Awaitable[object]]



# --- request/reply ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Latency:
    """Summary of one request/reply series, in microseconds."""

    requests: int
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float
    mean_us: float
    rate_per_s: float


class BenchService(Service):
    """A service with one typed status endpoint answering a fixed :class:`NodeRecord`."""

    description = "phalanx bus benchmark"

    def __init__(self, bus_config: BusConfig) -> None:
        super().__init__("phalanx-bench", "bench-0", bus_config)
        self.record = NodeRecord(
            node=NodeInfo(node_id="node-0001", host="bench-host", slots=8,
                          failure_domain="rack-1", labels={"gpu": "none"}, agent_pid=os.getpid(),
                          agent_version="0.1.0", started_at=time.time()),
            heartbeat_seq=42, heartbeat_at=time.time(), slots_used=2,
        )

    async def setup(self) -> None:
        await self.add_endpoint("status", TYPED_SUBJECT, NodeStatusRequest, self.on_status)

    async def on_status(self, request: NodeStatusRequest, delivery: Delivery) -> NodeRecord:
        return self.record


def percentile(sorted_values: Sequence[int], pct: float) -> int:
    """Nearest-rank percentile of an ascending sequence."""
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarise(samples_ns: list[int], elapsed_ns: int) -> Latency:
    ordered = sorted(samples_ns)
    return Latency(
        requests=len(ordered),
        p50_us=round(percentile(ordered, 50) / 1e3, 1),
        p90_us=round(percentile(ordered, 90) / 1e3, 1),
        p99_us=round(percentile(ordered, 99) / 1e3, 1),
        max_us=round(ordered[-1] / 1e3, 1),
        mean_us=round(statistics.fmean(ordered) / 1e3, 1),
        rate_per_s=round(len(ordered) / (elapsed_ns / 1e9)),
    )


@dataclasses.dataclass
class Series:
    """Latencies collected for one variant across rounds, and the time they took in total."""

    samples_ns: list[int] = dataclasses.field(default_factory=list)
    elapsed_ns: int = 0


async def time_batch(call: Call, count: int, series: Series) -> None:
    """Await ``call`` ``count`` times, one at a time, adding each latency to ``series``."""
    clock = time.perf_counter_ns
    samples = series.samples_ns
    started = clock()
    for _ in range(count):
        t0 = clock()
        await call()
        samples.append(clock() - t0)
    series.elapsed_ns += clock() - started


async def compare(calls: dict[str, Call], warmup: int, requests: int) -> dict[str, Latency]:
    """Time ``requests`` calls of each variant, interleaved in rounds.

    Each variant first gets ``warmup`` untimed calls. The timed calls are split
    into :data:`ROUNDS` batches that alternate between the variants (and swap
    their order every round), so drift in the machine's state over the run
    affects every variant alike.
    """
    for call in calls.values():
        for _ in range(warmup):
            await call()
    rounds = min(ROUNDS, requests)
    series = {name: Series() for name in calls}
    names = list(calls)
    for r in range(rounds):
        count = requests // rounds + (1 if r < requests % rounds else 0)
        for name in names if r % 2 == 0 else reversed(names):
            await time_batch(calls[name], count, series[name])
    return {name: summarise(s.samples_ns, s.elapsed_ns) for name, s in series.items()}


async def serve_raw_echo(nc: Client) -> None:
    """Answer every request on :data:`RAW_SUBJECT` with its own payload."""
    async def echo(msg: Msg) -> None:
        await nc.publish(msg.reply, msg.data)

    await nc.subscribe(RAW_SUBJECT, cb=echo)


async def bench_request_reply(url: str, warmup: int, requests: int) -> dict[str, Latency]:
    """Run the raw nats-py baseline and the typed ``Bus.request`` against one server."""
    config = BusConfig.load(servers=[url])
    service = BenchService(config)
    await service.start()
    assert service.bus is not None
    try:
        await serve_raw_echo(service.bus.nc)
        async with await Bus.connect(config, name="phalanx-bench-client") as bus:
            payload = encode(NodeStatusRequest())

            async def raw() -> Msg:
                return await bus.nc.request(RAW_SUBJECT, payload, timeout=REQUEST_TIMEOUT_S)

            async def typed() -> NodeRecord:
                return await bus.request(TYPED_SUBJECT, NodeStatusRequest(), NodeRecord,
                                         timeout_s=REQUEST_TIMEOUT_S)

            reply = await typed()
            if reply != service.record:
                raise RuntimeError(f"typed endpoint answered {reply!r}")
            print(f"  {warmup} warm-up + {requests} timed requests per variant, "
                  f"interleaved in {min(ROUNDS, requests)} rounds ...", flush=True)
            results = await compare({"raw": raw, "typed": typed}, warmup, requests)
            print_latency("raw nats-py", results["raw"])
            print_latency("typed Bus.request", results["typed"])
            return results
    finally:
        await service.stop()


def print_latency(label: str, lat: Latency) -> None:
    print(f"  {label:<18} p50 {lat.p50_us:7.1f} us  p90 {lat.p90_us:7.1f} us  "
          f"p99 {lat.p99_us:7.1f} us  max {lat.max_us:8.1f} us  "
          f"{lat.rate_per_s:8.0f} req/s", flush=True)


# --- codec ------------------------------------------------------------------------------------


def heartbeat_pool(size: int) -> list[NodeHeartbeat]:
    now = time.time()
    return [NodeHeartbeat(node_id="node-0001", seq=i, sent_at=now + i * 0.5, slots_used=2)
            for i in range(size)]


def codec_pairs_per_s(pool: list[NodeHeartbeat], iterations: int) -> float:
    """Encode+decode ``iterations`` heartbeats from ``pool``; pairs per second."""
    mask = len(pool) - 1
    clock = time.perf_counter_ns
    started = clock()
    for i in range(iterations):
        decode(encode(pool[i & mask]), NodeHeartbeat)
    return iterations / ((clock() - started) / 1e9)


def bench_codec(iterations: int, repeats: int) -> dict[str, Any]:
    pool = heartbeat_pool(CODEC_POOL)
    sample = pool[7]
    if decode(encode(sample), NodeHeartbeat) != sample:
        raise RuntimeError("codec round trip changed the heartbeat")
    rates = []
    for run in range(1, repeats + 1):
        rates.append(codec_pairs_per_s(pool, iterations))
        print(f"  run {run}/{repeats}: {rates[-1]:,.0f} encode+decode/s", flush=True)
    return {
        "iterations": iterations,
        "repeats": repeats,
        "encoded_bytes": len(encode(sample)),
        "best_per_s": round(max(rates)),
        "median_per_s": round(statistics.median(rates)),
        "runs_per_s": [round(r) for r in rates],
    }


# --- report -----------------------------------------------------------------------------------


def build_report(args: argparse.Namespace, argv: Sequence[str], loop_name: str, tracing: str,
                 latency: dict[str, Latency], codec: dict[str, Any]) -> dict[str, Any]:
    typed, raw = latency["typed"], latency["raw"]
    targets = {
        "typed_p99_us": {"target": f"< {TARGET_P99_US:g}", "measured": typed.p99_us,
                         "pass": typed.p99_us < TARGET_P99_US},
        "codec_median_per_s": {"target": f">= {TARGET_CODEC_PER_S:g}",
                               "measured": codec["median_per_s"],
                               "pass": codec["median_per_s"] >= TARGET_CODEC_PER_S},
    }
    return {
        "benchmark": "bus",
        "date": utc_date(),
        "command": command_line("bus.py", argv),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "event_loop": loop_name,
        "tracing": tracing,
        "request_reply": {
            "warmup": args.warmup,
            "raw": dataclasses.asdict(raw),
            "typed": dataclasses.asdict(typed),
            "overhead_p50_us": round(typed.p50_us - raw.p50_us, 1),
            "overhead_p99_us": round(typed.p99_us - raw.p99_us, 1),
        },
        "codec": codec,
        "targets": targets,
        "pass": all(t["pass"] for t in targets.values()),
    }


def markdown_section(report: dict[str, Any]) -> str:
    rr, codec, targets = report["request_reply"], report["codec"], report["targets"]
    raw, typed = rr["raw"], rr["typed"]

    def verdict(name: str) -> str:
        return "pass" if targets[name]["pass"] else "**FAIL**"

    def row(label: str, key: str, digits: int, target: str = "", result: str = "") -> str:
        return (f"| {label} | {raw[key]:,.{digits}f} | {typed[key]:,.{digits}f} "
                f"| {target} | {result} |")

    rows = [
        row("round trip p50 (us)", "p50_us", 1),
        row("round trip p90 (us)", "p90_us", 1),
        row("round trip p99 (us)", "p99_us", 1, "< 1000", verdict("typed_p99_us")),
        row("round trip max (us)", "max_us", 1),
        row("requests/s, one in flight", "rate_per_s", 0),
    ]
    lines = [
        f"\n## bus.py — {report['date']}\n",
        f"Command: `{report['command']}`\n",
        f"Python {report['python']}, {report['event_loop']}, {report['cpus']} CPUs, "
        f"tracing: {report['tracing']}; {typed['requests']} requests after {rr['warmup']} "
        f"warm-up, one in flight; codec: {codec['iterations']:,} pairs x {codec['repeats']}.\n",
        "| figure | raw nats-py | typed `Bus.request` | target | result |",
        "|---|---:|---:|---|---|",
        *rows,
        "",
        "| figure | measured | target | result |",
        "|---|---:|---|---|",
        f"| codec encode+decode/s, median | {codec['median_per_s']:,.0f} | >= 200,000 | "
        f"{verdict('codec_median_per_s')} |",
        f"| codec encode+decode/s, best | {codec['best_per_s']:,.0f} | | |",
        f"| heartbeat size (bytes) | {codec['encoded_bytes']} | | |",
        "",
    ]
    return "\n".join(lines)


def record(report: dict[str, Any]) -> None:
    """Append the run's section to bench/RESULTS.md."""
    append(markdown_section(report))


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=5000,
                        help="timed requests per variant (default 5000)")
    parser.add_argument("--warmup", type=int, default=200,
                        help="untimed requests before each series (default 200)")
    parser.add_argument("--codec-iterations", type=int, default=200_000,
                        help="encode+decode pairs per codec repeat (default 200000)")
    parser.add_argument("--no-record", action="store_true",
                        help=f"do not append the results to {RESULTS_PATH.name}")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.codec_iterations < 1:
        parser.error("--requests and --codec-iterations must be >= 1, --warmup >= 0")
    return args


def run_async(coro: Awaitable[dict[str, Latency]]) -> tuple[dict[str, Latency], str]:
    """Run ``coro`` on uvloop when importable, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro), "asyncio"  # type: ignore[arg-type]
    return uvloop.run(coro), f"uvloop {uvloop.__version__}"  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    tracing = telemetry.setup_tracing("phalanx-bench")
    print(f"bus benchmark: tracing exporter = {tracing}", flush=True)

    print("request/reply round trip over a real nats-server on loopback", flush=True)
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as store, \
            NatsServer(store, port=0) as server:
        print(f"  nats-server at {server.url}", flush=True)
        latency, loop_name = run_async(
            bench_request_reply(server.url, args.warmup, args.requests))
    typed, raw = latency["typed"], latency["raw"]
    print(f"  typed layer overhead: p50 +{typed.p50_us - raw.p50_us:.1f} us, "
          f"p99 +{typed.p99_us - raw.p99_us:.1f} us ({loop_name})", flush=True)

    print(f"codec: NodeHeartbeat encode+decode, {args.codec_iterations:,} pairs "
          f"x {CODEC_REPEATS}", flush=True)
    codec = bench_codec(args.codec_iterations, CODEC_REPEATS)
    print(f"  best {codec['best_per_s']:,.0f}/s, median {codec['median_per_s']:,.0f}/s, "
          f"{codec['encoded_bytes']} bytes", flush=True)

    report = build_report(args, argv, loop_name, tracing, latency, codec)
    for name, target in report["targets"].items():
        print(f"target {name} {target['target']}: measured {target['measured']:,.1f} -> "
              f"{'pass' if target['pass'] else 'FAIL'}", flush=True)
    if not args.no_record:
        record(report)
        print(f"appended to {RESULTS_PATH}", flush=True)
    print(json.dumps(report), flush=True)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

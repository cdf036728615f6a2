"""What replicating one rank's snapshot to its buddy costs, next to a plain TCP copy of the
same bytes, on this machine.

One committed snapshot buffer of ``--bytes`` (default: one of 4 ranks' share of W's model
and AdamW state, 50 MB) is written into a snapshot store on the tmpfs, as a rank would.
Then, in this process, over 127.0.0.1:

* **replication**: the agents' own code (:mod:`phalanx.services.agent.replication`): the
  sender reads the buffer file and streams it, the listener writes it into another
  store's replica file (header marked writing, bytes, xxh3-64 checked, commit mark) and
  answers; timed from the send to the answer.
* **replication over TLS**: the same, with the replication certificate of a cluster made
  for the run (``phalanx auth init``'s): mutual TLS 1.3, as ``phalanx up --secure`` and
  the Kubernetes agents run it.
* **a fetch**: the same buffer sent as an agent answers a rank's fetch before a
  restore (:meth:`ReplicaSender.send_copy`): one copy on a connection of its own, so
  the connection and its handshake (and TLS's) are in the figure; in the clear and
  over TLS.
* **plain TCP copy**: the same bytes from memory, in the same chunks, over a kept
  connection, received straight into a preallocated buffer (a buffered protocol, as
  the listener receives), then a one-byte answer.

Both sides of each run share one thread (one event loop), as neither is what a rank
waits for: the figure is the cost of the bytes on this machine's CPU, not a network's.
The median of ``--repeat`` runs each. Prints one JSON object as its last line and
appends the figures to bench/RESULTS.md (``--no-record``: not)::

    python bench/replication.py
    python bench/replication.py --bytes 1000000 --repeat 9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.bench.results import append, utc_date
from phalanx.schemas import snapshot_file
from phalanx.schemas.messages import SnapshotRecord, SnapshotReserve
from phalanx.services.agent import replica_tls
from phalanx.services.agent.replication import (
    CHUNK,
    ReplicaListener,
    ReplicaSender,
)
from phalanx.services.agent.snapshots import SnapshotStore
from phalanx.services.auth import tls

BENCH = Path(__file__).resolve().parent

#: W's state (model + AdamW moments) is 201 MB; one of 4 ranks snapshots a quarter.
W_SHARE_BYTES = 50_331_648
JOB = "bench"


def snapshot(store: SnapshotStore, nbytes: int) -> Path:
    """A committed snapshot of ``nbytes`` random bytes in a ring buffer of ``store``."""
    meta = os.urandom(64 * 1024)  # about W's pickled meta
    path = store.reserve(SnapshotReserve(job_id=JOB, replica_id="r0-0", shard=0, shards=4,
                                         nbytes=snapshot_file.HEADER_BYTES + len(meta)
                                         + nbytes))[0]
    payload = os.urandom(nbytes)

    def fill(view: memoryview) -> None:
        view[:] = payload

    buffer = snapshot_file.open_buffer(path)
    try:
        header = snapshot_file.Header(JOB, 1, 0, 0, 4, 4 * nbytes, 0, nbytes, 0, 0)
        snapshot_file.write(memoryview(buffer), header, meta, fill)
    finally:
        buffer.close()
    return path


async def replication_s(source: SnapshotStore, target: SnapshotStore, repeat: int,
                        tls_dir: Path | None = None, fetch: bool = False) -> list[float]:
    async def announce(_: SnapshotRecord) -> None:
        pass

    listener = ReplicaListener(target, "buddy", announce, lambda _: False, tls=None
                               if tls_dir is None else replica_tls.context(tls_dir, server=True))
    port = await listener.start("127.0.0.1")

    async def buddy() -> tuple[str, str, int]:
        return "buddy", "127.0.0.1", port

    sender = ReplicaSender(source, "node", buddy, tls=None if tls_dir is None
                           else replica_tls.context(tls_dir, server=False))
    times = []
    try:
        for _ in range(repeat):
            sender.sent.clear()  # send the same buffer again
            started = time.perf_counter()
            if fetch:  # as an agent answers a fetch: one copy, on a connection of its own
                path, header = next((p, h) for p in source.own_rings()
                                    if (h := snapshot_file.committed_header(p)) is not None)
                if await sender.send_copy(("buddy", "127.0.0.1", port), path, header,
                                          "node"):
                    raise RuntimeError("the member's node did not take the copy")
            elif await sender.send_pending() != 1:
                raise RuntimeError("the buddy did not take the replica")
            times.append(time.perf_counter() - started)
    finally:
        await sender.close()
        await listener.stop()
    return times


class _Into(asyncio.BufferedProtocol):
    """Receives each copy straight into one preallocated buffer; answers one byte."""

    def __init__(self, size: int) -> None:
        self.into, self.got = memoryview(bytearray(size)), 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.into[self.got:]

    def buffer_updated(self, nbytes: int) -> None:
        self.got += nbytes
        if self.got == len(self.into):
            self.got = 0
            self.transport.write(b"k")  # type: ignore[attr-defined]


async def tcp_copy_s(data: bytes, repeat: int) -> list[float]:
    server = await asyncio.get_running_loop().create_server(lambda: _Into(len(data)),
                                                            "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1",
                                                   server.sockets[0].getsockname()[1])
    view, times = memoryview(data), []
    try:
        for _ in range(repeat):
            started = time.perf_counter()
            for at in range(0, len(data), CHUNK):
                writer.write(view[at:at + CHUNK])
                await writer.drain()
            await reader.readexactly(1)
            times.append(time.perf_counter() - started)
    finally:
        writer.close()
        server.close()
    return times


def measure(nbytes: int, repeat: int) -> dict[str, Any]:
    """Both copies of a ``nbytes`` share, ``repeat`` times each, on an event loop of their
    own (call it from a thread when one runs)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None,
                                     prefix="phalanx-bench-") as tmp:
        source = SnapshotStore(Path(tmp) / "node", 1 << 40)
        target = SnapshotStore(Path(tmp) / "buddy", 1 << 40)
        path = snapshot(source, nbytes)
        header = snapshot_file.committed_header(path)
        assert header is not None
        payload = path.read_bytes()[:header.nbytes]
        replicated = asyncio.run(replication_s(source, target, repeat))
        tls_dir = Path(tmp) / "tls"
        tls.make_ca_and_server_cert(tls_dir, ["127.0.0.1"])
        tls.make_replication_cert(tls_dir)
        encrypted = asyncio.run(replication_s(source, target, repeat, tls_dir))
        fetched = asyncio.run(replication_s(source, target, repeat, fetch=True))
        fetched_tls = asyncio.run(replication_s(source, target, repeat, tls_dir, fetch=True))
        copied = asyncio.run(tcp_copy_s(payload, repeat))
    mb = len(payload) / 1e6
    return {"replica_bytes": len(payload),
            "replication_s": statistics.median(replicated),
            "replication_tls_s": statistics.median(encrypted),
            "fetch_s": statistics.median(fetched),
            "fetch_tls_s": statistics.median(fetched_tls),
            "tcp_copy_s": statistics.median(copied),
            "replication_MBps": mb / statistics.median(replicated),
            "replication_tls_MBps": mb / statistics.median(encrypted),
            "fetch_MBps": mb / statistics.median(fetched),
            "fetch_tls_MBps": mb / statistics.median(fetched_tls),
            "tcp_copy_MBps": mb / statistics.median(copied)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=W_SHARE_BYTES)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    report = {"date": utc_date(), "command": " ".join(sys.argv), "load": os.getloadavg()[0],
              **measure(args.bytes, args.repeat)}
    if not args.no_record:
        append(f"\n## replication.py — {report['date']}\n\nCommand: `{report['command']}`\n\n"
               f"One snapshot buffer of {report['replica_bytes']} B (header, meta, shard) "
               "sent to a buddy by the agents' replication code, next to a plain TCP copy "
               f"of the same bytes, both over 127.0.0.1 in one process, median of "
               f"{args.repeat}; 1-minute load average {report['load']:.1f} (2 cores).\n\n"
               "| copy | time (ms) | MB/s |\n|---|---:|---:|\n"
               f"| replication (file read, stream, replica write, xxh3, commit) | "
               f"{report['replication_s'] * 1000:.1f} | {report['replication_MBps']:.0f} |\n"
               f"| the same over mutual TLS 1.3 (the replication certificate) | "
               f"{report['replication_tls_s'] * 1000:.1f} | "
               f"{report['replication_tls_MBps']:.0f} |\n"
               f"| a fetch before a restore (the same, on a new connection: handshake "
               f"included) | {report['fetch_s'] * 1000:.1f} | {report['fetch_MBps']:.0f} |\n"
               f"| the fetch over mutual TLS 1.3 | {report['fetch_tls_s'] * 1000:.1f} | "
               f"{report['fetch_tls_MBps']:.0f} |\n"
               f"| plain TCP copy | {report['tcp_copy_s'] * 1000:.1f} | "
               f"{report['tcp_copy_MBps']:.0f} |\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

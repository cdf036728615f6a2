"""The processes of a simulated-cluster bench run (bench/scale.py, bench/bigjob.py), stopped
together at its end, whatever state the run left them in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from phalanx.services.natsd import NatsServer


def stop_all(procs: dict[str, list[subprocess.Popen[bytes]]], server: NatsServer,
             logs: Path | None = None) -> None:
    """SIGTERM every process of ``procs``, SIGKILL those still there after 20 s, stop the
    server; with ``logs``, the end of each ``*.log`` there on stderr (``--show-logs``)."""
    for group in procs.values():
        for p in group:
            if p.poll() is None:
                p.terminate()
    for group in procs.values():
        for p in group:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    server.stop()
    if logs is not None:
        for log_path in sorted(logs.glob("*.log")):
            print(f"--- {log_path.name}", log_path.read_text()[-3000:], file=sys.stderr)

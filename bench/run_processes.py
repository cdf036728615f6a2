"""The processes of a simulated-cluster bench run (bench/scale.py, bench/bigjob.py): a
nats-server with its monitoring port, the control-plane services, and whatever the run
adds (its load generators), started in one temporary folder and stopped together at the
run's end, whatever state it left them in."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from phalanx.schemas import settings
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import free_port


@dataclasses.dataclass
class SimulatedRun:
    """A run's folder, server and processes (by kind: each service's name, ``loadgen``)."""

    folder: Path
    server: NatsServer
    http_port: int  # the server's monitoring port (``/varz``)
    procs: dict[str, list[subprocess.Popen[bytes]]]
    files: contextlib.ExitStack

    def log(self, name: str) -> BinaryIO:
        """``<name>.log`` in the run's folder, open for the run's length."""
        return self.files.enter_context((self.folder / f"{name}.log").open("wb"))


@contextlib.contextmanager
def simulated_run(services: Sequence[str], env: Mapping[str, str] | None = None,
                  show_logs: bool = False) -> Iterator[SimulatedRun]:
    """A nats-server and an instance of each of ``services`` (this environment and
    ``env``, at WARNING); at the end every process of the run is stopped (:func:`stop_all`),
    the end of each log on stderr with ``show_logs``."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        folder = Path(tmp)
        http_port = free_port()
        conf = folder / "nats.conf"
        conf.write_text(f"http: 127.0.0.1:{http_port}\n")
        server = NatsServer(folder / "js", port=free_port(), config_file=conf).start()
        run = SimulatedRun(folder, server, http_port, defaultdict(list), files)
        try:
            environment = {**os.environ, settings.NATS_URL: server.url, **(env or {})}
            for name in services:
                log = run.log(name)
                run.procs[name].append(subprocess.Popen(
                    [sys.executable, "-m", f"phalanx.services.{name}", "--log-level", "WARNING"],
                    env=environment, stdout=log, stderr=log))
            yield run
        finally:
            stop_all(run.procs, server, folder if show_logs else None)


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

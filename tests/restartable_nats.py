"""A test's own nats-server that it can kill and start again (the ``restartable_nats``
fixture's): a module of its own, importable by name from any test folder (``conftest`` is
not: each folder may have one)."""

from __future__ import annotations

from pathlib import Path

from phalanx.services.natsd import NatsServer


class RestartableNats:
    """A test's own nats-server that it can SIGKILL and start again on the same port and
    JetStream store, as a Deployment restarts a dead server."""

    def __init__(self, root: Path) -> None:
        self.server = NatsServer(root / "jetstream", port=0, log_path=root / "nats.log").start()

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        assert self.server.process is not None
        self.server.process.kill()
        self.server.process.wait()

    def start(self) -> None:
        old = self.server
        self.server = NatsServer(old.store_dir, port=old.port, log_path=old.log_path).start()

    def stop(self) -> None:
        self.server.stop()

"""Step progress from inside a rank, for health's hang and straggler rules.

A training loop is synchronous; the bus client is asyncio. The reporter runs
its own event loop on a background thread, connects there, and
:meth:`ProgressReporter.report` only hands a message to that loop, so it
never blocks a step. If the bus is unreachable, reports are dropped and
counted while the client reconnects; training never waits for the bus.

Under an agent, :meth:`ProgressReporter.from_env` reads ``PHALANX_NATS_URL``,
``PHALANX_JOB_ID`` and ``PHALANX_RANK``; outside phalanx it returns None, so
the same script runs under plain ``python`` too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Mapping

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import RankProgress

log = logging.getLogger("phalanx.runtime.progress")


class ProgressReporter:
    """Publishes one :class:`RankProgress` per step from a background thread.

    Args:
        bus_config: where the bus is.
        job_id / rank: who is reporting.
        generation: the membership generation the rank trains in.
        connect_timeout_s: how long :meth:`start` waits for the first connection.
    """

    def __init__(self, bus_config: BusConfig, job_id: str, rank: int, *, generation: int = 0,
                 connect_timeout_s: float = 10.0) -> None:
        self.bus_config = bus_config
        self.job_id = job_id
        self.rank = rank
        self.generation = generation
        self.connect_timeout_s = connect_timeout_s
        self.subject = subjects.health_rank(job_id, rank)
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="phalanx-progress", daemon=True)
        self._bus: Bus | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProgressReporter | None:
        """A started reporter for the rank an agent launched, or None outside phalanx."""
        env = os.environ if env is None else env
        if not env.get("PHALANX_JOB_ID") or not env.get("PHALANX_NATS_URL"):
            return None
        reporter = cls(BusConfig.load(env=env), env["PHALANX_JOB_ID"],
                       int(env.get("PHALANX_RANK", "0")))
        return reporter.start()

    def start(self) -> ProgressReporter:
        """Start the loop thread and connect.

        Raises:
            BusUnavailable: no connection within ``connect_timeout_s``.
        """
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            Bus.connect(self.bus_config, name=f"rank:{self.job_id}:{self.rank}"), self._loop)
        self._bus = future.result(self.connect_timeout_s + 1)
        return self

    def report(self, step: int, step_time_s: float) -> None:
        """Report that ``step`` finished after ``step_time_s`` (never blocks)."""
        message = RankProgress(job_id=self.job_id, rank=self.rank, replica_id=f"r{self.rank}",
                               generation=self.generation, step=step,
                               step_time_s=max(0.0, step_time_s), sent_at=time.time())
        self._loop.call_soon_threadsafe(self._publish, message)

    def _publish(self, message: RankProgress) -> None:
        async def send() -> None:
            assert self._bus is not None
            try:
                await self._bus.publish(self.subject, message)
            except (PhalanxError, OSError, TimeoutError) as exc:
                self.dropped += 1
                log.debug("progress report dropped: %s", exc)

        self._loop.create_task(send())

    def close(self) -> None:
        """Flush, disconnect and stop the thread (idempotent)."""
        if not self._thread.is_alive():
            return
        if self._bus is not None:
            asyncio.run_coroutine_threadsafe(self._bus.close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Step progress from inside a rank, for health's hang and straggler rules.

Reports go out through a :class:`~phalanx.runtime.bus_thread.BusThread`, so
:meth:`ProgressReporter.report` never blocks a step. At most one goes out per
``min_interval_s`` (0.1 s; a final report always goes): a small model steps
hundreds of times a second, and a report per step only loaded health, which
then fell behind and judged ranks hung on progress still in its queue (seen in
the chaos benchmark at 4 ms steps). A hang timeout of seconds needs no more. If the bus is
unreachable, reports are dropped and counted while the client reconnects;
training never waits for the bus.

Under an agent, :meth:`ProgressReporter.from_env` reads ``PHALANX_NATS_URL``,
``PHALANX_JOB_ID`` and ``PHALANX_RANK``; outside phalanx it returns None, so
the same script runs under plain ``python`` too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from phalanx.bus.config import BusConfig
from phalanx.runtime.bus_thread import BusThread
from phalanx.schemas import subjects
from phalanx.schemas.environment import RankEnvironment
from phalanx.schemas.messages import RankProgress


class ProgressReporter:
    """Publishes one :class:`RankProgress` per step from a background thread.

    Args:
        bus_config: where the bus is (ignored when ``bus`` is given).
        job_id / rank: who is reporting (``rank`` is the rank's slot in the job).
        replica_id: the replica in that slot.
        generation: the membership generation the rank trains in.
        bus: an already started :class:`BusThread` to share.
        min_interval_s: reports closer together than this are skipped (not final ones).
    """

    def __init__(self, bus_config: BusConfig | None, job_id: str, rank: int, *,
                 replica_id: str | None = None, generation: int = 0,
                 connect_timeout_s: float = 10.0, bus: BusThread | None = None,
                 min_interval_s: float = 0.1) -> None:
        self.job_id = job_id
        self.min_interval_s = min_interval_s
        self._last_sent = float("-inf")
        self.rank = rank
        self.replica_id = replica_id or f"r{rank}-0"
        self.generation = generation
        self.total_steps: int | None = None  # the steps the training runs to, once known
        self.subject = subjects.health_rank(job_id, rank)
        self._owns_bus = bus is None
        if bus is None:
            assert bus_config is not None
            bus = BusThread(bus_config, f"rank:{job_id}:{rank}",
                            connect_timeout_s=connect_timeout_s)
        self.bus = bus

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProgressReporter | None:
        """A started reporter for the rank an agent launched, or None outside phalanx."""
        env = os.environ if env is None else env
        rank = RankEnvironment.from_env(env)
        if not rank.job_id or not rank.nats_url:
            return None
        reporter = cls(BusConfig.load(env=env), rank.job_id, rank.slot,
                       replica_id=rank.replica_id)
        return reporter.start()

    @property
    def dropped(self) -> int:
        return self.bus.dropped

    def start(self) -> ProgressReporter:
        """Start the bus thread and connect (when this reporter owns it).

        Raises:
            BusUnavailable: no connection within ``connect_timeout_s``.
        """
        if self._owns_bus:
            self.bus.start()
        return self

    def report(self, step: int, step_time_s: float, *, final: bool = False) -> None:
        """Report that ``step`` finished after ``step_time_s`` (never blocks).

        ``final``: it was the last step; health does not judge the rank's silence
        while it exits.
        """
        now = time.monotonic()
        if not final and now - self._last_sent < self.min_interval_s:
            return
        self._last_sent = now
        self.bus.publish(self.subject, RankProgress(
            job_id=self.job_id, rank=self.rank, replica_id=self.replica_id,
            generation=self.generation, step=step, step_time_s=max(0.0, step_time_s),
            sent_at=time.time(), final=final, total_steps=self.total_steps or None))

    def close(self) -> None:
        """Flush, disconnect and stop the thread, when this reporter owns it (idempotent)."""
        if self._owns_bus:
            self.bus.close()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The node's GPU health and its cordoned slots: the poll, and what a GPU fault makes the
agent do.

On a node whose GPUs NVML sees (:mod:`.nvml`), their health is polled every
``agent.gpu_poll_interval_s`` (:meth:`GpuHealth.run`). A fatal fault cordons that GPU's
slots (:func:`~.core.gpu_slots`; the node's other slots stay in use) and SIGKILLs the
ranks there, each exit reported ``gpu_fault`` at once; a throttled GPU is only logged
(straggler evidence). A cordon is kept here until the registry stores it in the node
record (``cordoned_slots``, with the reason: the agent's next record write, which this
poll asks for at once), and nothing starts on a cordoned slot until an operator
uncordons it there. ``phalanx chaos gpu-fault`` injects a fault at the NVML boundary
(:meth:`GpuHealth.inject`; on a CPU node too, where the GPU index names a slot) and
polls at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

import nats.errors

from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import GpuFaultKind, NodeRecord
from phalanx.services.agent import core
from phalanx.services.agent.nvml import GpuFault, GpuWatch, describe
from phalanx.services.agent.ranks import Rank

log = logging.getLogger("phalanx.agent")


class GpuHealth:
    """The health of a node's GPUs (or CPU slots, where a fault is injected) and the
    slots this agent cordoned for them.

    Args:
        watch: the poll of the node's GPUs and the injection point of faults.
        gpus: the GPU of each of the node's slots (empty: CPU slots).
        slots: the node's slot count.
        stored: the node's record as the registry last stored it (None: not yet).
        read: reads the node's record from the registry now (None: it has none).
        kill: SIGKILLs the ranks holding the slots of a failed GPU (the slots, the
            fault's description, when it was seen); returns them.
        write: writes the node's record, with the cordons not yet stored.
    """

    def __init__(self, watch: GpuWatch, gpus: tuple[int, ...], slots: int, *,
                 stored: Callable[[], NodeRecord | None],
                 read: Callable[[], Awaitable[NodeRecord | None]],
                 kill: Callable[[Collection[int], str, float], Sequence[Rank]],
                 write: Callable[[], Awaitable[None]]) -> None:
        self.watch = watch
        self.gpus = gpus
        self.slots = slots
        self._stored = stored
        self._read = read
        self._kill = kill
        self._write = write
        self._poll = asyncio.Lock()  # one poll at a time: NVML reads are not shared
        #: Slots this agent cordoned that the stored record does not show yet.
        self.unstored: dict[int, str] = {}

    @property
    def cordoned(self) -> dict[int, str]:
        """This node's slots out of use (local slot -> why): as the registry last stored
        them (an operator's uncordon shows there at the next heartbeat), plus those this
        agent cordoned since."""
        stored = self._stored()
        return {**(stored.cordoned_slots if stored is not None else {}), **self.unstored}

    def written(self, cordons: Collection[int]) -> None:
        """The registry stores ``cordons`` now: they are no longer this agent's alone."""
        for slot in cordons:
            self.unstored.pop(slot, None)

    async def cordoned_now(self) -> Collection[int]:
        """The cordoned slots a launch must avoid: read from the registry when any are
        known (an operator's uncordon counts at once, not at the next heartbeat: admission
        may already have placed work there), else none without a read."""
        if self.cordoned:
            try:
                stored = await self._read()
            except (PhalanxError, TimeoutError, OSError, nats.errors.Error) as exc:
                log.warning("cannot read this node's cordoned slots: %s", exc)
            else:
                if stored is not None:
                    return {**stored.cordoned_slots, **self.unstored}.keys()
        return self.cordoned.keys()

    async def run(self, sleep_or_stop: Callable[[float], Awaitable[bool]],
                  interval_s: float) -> None:
        """Poll the GPUs' health every ``interval_s`` until ``sleep_or_stop`` says stop."""
        while not await sleep_or_stop(interval_s):
            await self.poll()

    async def poll(self) -> list[str]:
        """One health poll of the GPUs (NVML's reads on a worker thread) and what its
        faults made this agent do, one line each."""
        async with self._poll:
            watch = self.watch
            faults = await asyncio.to_thread(watch.poll) if watch.nvml is not None \
                else watch.poll()
            return await self._act_on(faults, time.time())

    async def inject(self, gpu: int, kind: GpuFaultKind, code: int | None) -> list[str]:
        """Make the next poll see fault ``kind`` on GPU ``gpu`` (a slot, on a node without
        NVML), and poll now; returns what the poll did, one line each.

        Raises:
            ValueError: there is no such GPU (or slot) here.
        """
        if self.watch.nvml is None and not core.gpu_slots(gpu, self.gpus, self.slots):
            raise ValueError(f"no GPU and no slot {gpu} (slots 0..{self.slots - 1})")
        self.watch.inject(gpu, kind, code)
        return await self.poll()

    async def close(self) -> None:
        """Release NVML, once no poll is reading it."""
        async with self._poll:
            self.watch.close()

    async def _act_on(self, faults: list[GpuFault], seen_at: float) -> list[str]:
        """Act on one poll's observations: a fatal fault's GPU has its slots cordoned and
        the ranks on them killed at once (their exits carry ``seen_at``); the rest (a
        throttled GPU: straggler evidence) are logged."""
        done: list[str] = []
        fatal: dict[int, list[GpuFault]] = {}
        for fault in faults:
            if fault.fatal:
                fatal.setdefault(fault.gpu, []).append(fault)
                continue
            log.warning("GPU %d: %s (reported, not a fault)", fault.gpu, fault.what,
                        extra={"gpu": fault.gpu, "kind": fault.kind.value})
            done.append(f"GPU {fault.gpu}: {fault.what} (reported, not a fault)")
        info = {g.index: g for g in self.watch.gpus}
        cordoned = self.cordoned
        for gpu, seen in sorted(fatal.items()):
            why = describe(gpu, seen, info.get(gpu))
            slots = core.gpu_slots(gpu, self.gpus, self.slots)
            for slot in slots:
                if slot not in cordoned:
                    self.unstored[slot] = why
            killed = self._kill(slots, why, seen_at)
            ranks = ", ".join(f"rank {r.rank} of {r.job_id} (pid {r.pid})" for r in killed)
            log.error("GPU fault: %s", why, extra={
                "gpu": gpu, "kinds": [f.kind.value for f in seen], "slots": list(slots),
                "killed": [r.pid for r in killed]})
            done.append(f"{why}: " + (f"slot(s) {', '.join(map(str, slots))} cordoned, "
                                      f"killed {ranks or 'no rank'}" if slots
                                      else "no slot runs on it"))
        if self.unstored:
            await self._write()
        return done

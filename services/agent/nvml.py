"""The agent's NVML boundary: which GPUs its node has, whether they are healthy, and the
GPU faults an operator injects there.

**Discovery** (:func:`discover`, at agent start). NVML (the ``nvidia-ml-py`` package,
``import pynvml``) gives each GPU's index, UUID, name, memory, PCI bus id, NUMA node and
the CPUs close to it (its CPU affinity), which the node record carries
(:class:`~phalanx.schemas.messages.GpuInfo`). Where NVML is absent — the package missing,
no ``libnvidia-ml`` (``NVMLError_LibraryNotFound``), no driver loaded
(``NVMLError_DriverNotLoaded``) — or it sees no GPU, discovery gives None and the node
runs CPU slots exactly as without this module. Any other NVML error at start is raised
(:class:`GpuDiscoveryError`): GPUs that are there but cannot be read are not silently
taken for none.

**Health** (:class:`GpuWatch`, polled by the agent every ``agent.gpu_poll_interval_s``).
One poll reads, for each GPU: the Xid critical errors and double-bit ECC events NVML
queued in its event set since the last poll (drained with 0 ms waits), the volatile
uncorrectable ECC count, whether retired pages are pending and whether row remapping
failed, and the clocks' throttle reasons; any query answering ``NVMLError_GpuIsLost``
makes the GPU lost. What a GPU cannot report (ECC off, an older GPU) is left out, not
failed. :func:`gpu_faults`, pure, turns the previous and the new readings into
:class:`GpuFault` observations:

* *Fatal* — the agent cordons the GPU's slots and SIGKILLs the ranks on them: the GPU
  newly lost; an Xid critical error, except those NVIDIA's Xid catalogue lays at the
  application (:data:`APPLICATION_XIDS`: the rank fails by itself there, and the GPU is
  fine); a rise of the uncorrectable ECC count or a double-bit ECC event; retired pages
  newly pending; a row remapping failure newly set.
* *Reported*, not a fault — clocks newly held down for heat, power or a hardware
  slowdown (:data:`STRAGGLER_REASONS`): evidence for a straggler, which health judges by
  step times; and application Xids.
* The reading taken at start is the baseline: an ECC count already there is no news (a
  pending retirement or a failed remap is: the GPU needs a reset before use).

**Injection** (:meth:`GpuWatch.inject`, ``phalanx chaos gpu-fault``). An injected fault
changes one GPU's readings in the next poll as the real fault would (an Xid event, the
ECC count up by one and a double-bit event, the GPU lost, …), so it goes through
:func:`gpu_faults` and everything after it exactly as a real one; it never becomes the
baseline, so the next poll reads NVML's truth again. On a node without NVML nothing is
read, and the index of the GPU injected into is a slot's.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import GpuFaultKind, GpuInfo

log = logging.getLogger("phalanx.agent.nvml")

#: Xids that NVIDIA's catalogue lays at the application (graphics engine exception,
#: GPU memory page fault, GPU stopped processing, preemptive clean-up after them): the
#: rank that caused one fails by itself, and the GPU stays usable.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
#: What an ``xid`` fault injected without a code is: the GPU fell off the bus.
DEFAULT_XID = 79
#: NVML's clocks event (throttle) reasons that say a GPU runs slow for a cause of its
#: own, with their names (``nvmlClocksEventReason*``).
STRAGGLER_REASONS = {
    0x04: "SW power cap",
    0x08: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
}
#: NVML event types the event set is registered for (where the GPU supports them).
XID_EVENT, DOUBLE_BIT_ECC_EVENT = 0x08, 0x02
#: The most events one poll drains (an event storm must not hold the poll for ever).
EVENTS_PER_POLL = 1024


class GpuDiscoveryError(PhalanxError, RuntimeError):
    """NVML is there but cannot read the node's GPUs."""


@dataclasses.dataclass(frozen=True)
class GpuReading:
    """One poll's view of one GPU."""

    lost: bool = False
    xids: tuple[int, ...] = ()  # Xid critical errors since the last poll
    ecc_events: int = 0  # double-bit ECC events since the last poll
    ecc_uncorrected: int | None = None  # volatile uncorrectable count; None: not reported
    retired_pending: bool = False
    remap_failed: bool = False
    throttle: int = 0  # clocks event reasons (a bit mask)
    injected: bool = False  # changed by an injected fault


@dataclasses.dataclass(frozen=True)
class GpuFault:
    """What a poll saw on one GPU."""

    gpu: int
    kind: GpuFaultKind
    what: str  # "Xid 79", "uncorrectable ECC errors 3 (+1)" …
    fatal: bool  # cordon the GPU's slots and kill its ranks; False: reported only
    injected: bool = False


def gpu_faults(previous: Mapping[int, GpuReading],
               current: Mapping[int, GpuReading]) -> list[GpuFault]:
    """The observations ``current`` makes against ``previous`` (a GPU absent from it is
    seen for the first time), by GPU index."""
    return [GpuFault(gpu, kind, what, fatal, current[gpu].injected)
            for gpu in sorted(current)
            for kind, what, fatal in _observations(previous.get(gpu), current[gpu])]


def _observations(before: GpuReading | None,
                  now: GpuReading) -> list[tuple[GpuFaultKind, str, bool]]:
    """What one GPU's reading ``now`` says against its last one (None: its first)."""
    was = before or GpuReading()
    seen: list[tuple[GpuFaultKind, str, bool]] = []
    if now.lost and not was.lost:
        seen.append((GpuFaultKind.LOST, "GPU lost (fallen off the bus or unreachable)", True))
    for xid in now.xids:
        if xid in APPLICATION_XIDS:
            seen.append((GpuFaultKind.XID, f"Xid {xid} (the application's own error)", False))
        else:
            seen.append((GpuFaultKind.XID, f"Xid {xid}", True))
    rise = 0
    if before is not None and now.ecc_uncorrected is not None \
            and was.ecc_uncorrected is not None:
        rise = now.ecc_uncorrected - was.ecc_uncorrected
    if rise > 0 or now.ecc_events:
        count = "" if now.ecc_uncorrected is None else f" {now.ecc_uncorrected}"
        seen.append((GpuFaultKind.ECC, f"uncorrectable ECC errors{count}"
                     + (f" (+{rise})" if rise > 0 else ""), True))
    if now.retired_pending and not was.retired_pending:
        seen.append((GpuFaultKind.RETIRED_PAGES,
                     "retired pages pending (the GPU needs a reset)", True))
    if now.remap_failed and not was.remap_failed:
        seen.append((GpuFaultKind.ROW_REMAP, "row remapping failed", True))
    slow = [name for bit, name in STRAGGLER_REASONS.items()
            if now.throttle & bit and not was.throttle & bit]
    if slow:
        seen.append((GpuFaultKind.THROTTLE, "clocks throttled: " + ", ".join(slow), False))
    return seen


def injected_reading(base: GpuReading, kind: GpuFaultKind, code: int | None) -> GpuReading:
    """``base`` as a GPU with fault ``kind`` (Xid ``code``) reads in the next poll."""
    match kind:
        case GpuFaultKind.XID:
            change: dict[str, Any] = {"xids": (*base.xids, DEFAULT_XID if code is None
                                               else code)}
        case GpuFaultKind.ECC:
            change = {"ecc_events": base.ecc_events + 1,
                      "ecc_uncorrected": (base.ecc_uncorrected or 0) + 1}
        case GpuFaultKind.RETIRED_PAGES:
            change = {"retired_pending": True}
        case GpuFaultKind.ROW_REMAP:
            change = {"remap_failed": True}
        case GpuFaultKind.LOST:
            change = {"lost": True}
        case GpuFaultKind.THROTTLE:
            change = {"throttle": base.throttle | sum(STRAGGLER_REASONS)}
    return dataclasses.replace(base, injected=True, **change)


def describe(gpu: int, faults: Sequence[GpuFault], info: GpuInfo | None) -> str:
    """One line naming the GPU (index, UUID; a slot on a node without NVML) and what
    failed: the reason a slot is cordoned for and its rank's exit detail."""
    what = "; ".join(f.what for f in faults)
    where = f"GPU {gpu} ({info.uuid})" if info is not None else \
        f"slot {gpu} (a CPU slot: no GPU seen here)"
    injected = ", injected by phalanx chaos" if any(f.injected for f in faults) else ""
    return f"{what} on {where}{injected}"


def cpus_of(words: Iterable[int], bits: int = 64) -> list[int]:
    """The CPUs set in NVML's affinity bit mask (``bits`` per word, lowest CPU first)."""
    return [w * bits + b for w, word in enumerate(words) for b in range(bits) if word >> b & 1]


_T = TypeVar("_T")


class Nvml:
    """An initialised NVML and this node's GPUs, read one poll at a time (not from two
    threads at once). Made by :func:`discover`; :meth:`close` shuts NVML down."""

    def __init__(self, lib: Any, handles: list[Any], gpus: list[GpuInfo],
                 events: Any | None) -> None:
        self.lib = lib
        self.handles = handles
        self.gpus = gpus
        self.events = events  # the event set (None: no GPU could register one)

    def read(self) -> dict[int, GpuReading]:
        """Every GPU's reading now (a GPU whose read failed other than by being lost is
        left out: the poll keeps its previous reading)."""
        events = self._drain()
        readings = {}
        for gpu, handle in zip(self.gpus, self.handles, strict=True):
            xids, ecc_events = events.get(gpu.index, ((), 0))
            reading = self._read(gpu.index, handle, tuple(xids), ecc_events)
            if reading is not None:
                readings[gpu.index] = reading
        return readings

    def _drain(self) -> dict[int, tuple[list[int], int]]:
        """The Xids and double-bit ECC events queued since the last poll, by GPU."""
        lib = self.lib
        if self.events is None:
            return {}
        events: dict[int, tuple[list[int], int]] = {}
        for _ in range(EVENTS_PER_POLL):
            try:
                data = lib.nvmlEventSetWait_v2(self.events, 0)
                index = lib.nvmlDeviceGetIndex(data.device)
            except lib.NVMLError_Timeout:
                break  # nothing (more) queued
            except lib.NVMLError as exc:
                log.warning("cannot read the GPU event set: %s", exc)
                break
            xids, dbe = events.get(index, ([], 0))
            if data.eventType & XID_EVENT:
                xids.append(int(data.eventData))
            if data.eventType & DOUBLE_BIT_ECC_EVENT:
                dbe += 1
            events[index] = (xids, dbe)
        return events

    def _read(self, index: int, handle: Any, xids: tuple[int, ...],
              ecc_events: int) -> GpuReading | None:
        lib = self.lib

        def optional(query: Callable[[], _T]) -> _T | None:
            """A query the GPU may not support (ECC off, an older GPU or driver): None."""
            try:
                return query()
            except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound,
                    lib.NVMLError_NoPermission):
                return None

        try:
            ecc = optional(lambda: lib.nvmlDeviceGetTotalEccErrors(
                handle, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC))
            pending = optional(lambda: lib.nvmlDeviceGetRetiredPagesPendingStatus(handle))
            remap = optional(lambda: lib.nvmlDeviceGetRemappedRows(handle))
            throttle = optional(lambda: lib.nvmlDeviceGetCurrentClocksEventReasons(handle))
            if throttle is None:  # drivers before 535 name it by throttling
                throttle = optional(
                    lambda: lib.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        except lib.NVMLError_GpuIsLost:
            return GpuReading(lost=True, xids=xids, ecc_events=ecc_events)
        except lib.NVMLError as exc:
            log.warning("cannot read GPU %d: %s", index, exc)
            return None
        return GpuReading(xids=xids, ecc_events=ecc_events,
                          ecc_uncorrected=None if ecc is None else int(ecc),
                          retired_pending=bool(pending), remap_failed=bool(remap and remap[3]),
                          throttle=int(throttle or 0))

    def close(self) -> None:
        lib = self.lib
        try:
            if self.events is not None:
                lib.nvmlEventSetFree(self.events)
            lib.nvmlShutdown()
        except lib.NVMLError as exc:
            log.warning("NVML did not shut down cleanly: %s", exc)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def discover() -> Nvml | None:
    """This node's GPUs through NVML; None where NVML is absent or sees no GPU.

    Raises:
        GpuDiscoveryError: NVML starts but fails otherwise, or cannot read a GPU.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return None
    except pynvml.NVMLError as exc:
        raise GpuDiscoveryError(f"NVML cannot start: {exc}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            pynvml.nvmlShutdown()
            return None
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = [_info(pynvml, i, h) for i, h in enumerate(handles)]
        events = _event_set(pynvml, gpus, handles)
    except pynvml.NVMLError as exc:
        pynvml.nvmlShutdown()
        raise GpuDiscoveryError(f"NVML cannot read this node's GPUs: {exc}") from None
    return Nvml(pynvml, handles, gpus, events)


def _info(lib: Any, index: int, handle: Any) -> GpuInfo:
    """What the node record says of one GPU."""
    try:
        numa = lib.nvmlDeviceGetNumaNodeId(handle)
    except lib.NVMLError:  # not reported (one socket, or a driver without it)
        numa = None
    words = math.ceil((os.cpu_count() or 1) / 64)
    try:
        cpus = cpus_of(lib.nvmlDeviceGetCpuAffinity(handle, words))
    except lib.NVMLError:
        cpus = []
    return GpuInfo(index=index, uuid=_text(lib.nvmlDeviceGetUUID(handle)),
                   name=_text(lib.nvmlDeviceGetName(handle)),
                   memory_bytes=int(lib.nvmlDeviceGetMemoryInfo(handle).total),
                   pci_bus_id=_text(lib.nvmlDeviceGetPciInfo(handle).busId),
                   numa_node=numa if numa is not None and numa >= 0 else None, cpus=cpus)


def _event_set(lib: Any, gpus: list[GpuInfo], handles: list[Any]) -> Any | None:
    """An event set with every GPU registered for the Xid and double-bit ECC events it
    supports; None when none can be (their Xids then go unseen, logged)."""
    events = lib.nvmlEventSetCreate()
    registered = 0
    for gpu, handle in zip(gpus, handles, strict=True):
        try:
            kinds = lib.nvmlDeviceGetSupportedEventTypes(handle) \
                & (XID_EVENT | DOUBLE_BIT_ECC_EVENT)
            if kinds:
                lib.nvmlDeviceRegisterEvents(handle, kinds, events)
                registered += 1
                continue
        except lib.NVMLError as exc:
            log.warning("GPU %d: no Xid events (%s)", gpu.index, exc)
            continue
        log.warning("GPU %d supports no Xid or ECC events: its Xids go unseen", gpu.index)
    if registered:
        return events
    lib.nvmlEventSetFree(events)
    return None


class GpuWatch:
    """The health poll of a node's GPUs (``nvml``: None on a node without NVML) and the
    injection point of GPU faults. The first reading is taken now, as the baseline."""

    def __init__(self, nvml: Nvml | None) -> None:
        self.nvml = nvml
        self.previous: dict[int, GpuReading] = nvml.read() if nvml is not None else {}
        # Appended from the event loop while a poll may run on a worker thread: a deque's
        # append and popleft are atomic.
        self._injected: collections.deque[tuple[int, GpuFaultKind, int | None]] = \
            collections.deque()

    @property
    def gpus(self) -> list[GpuInfo]:
        return [] if self.nvml is None else self.nvml.gpus

    def inject(self, gpu: int, kind: GpuFaultKind, code: int | None = None) -> None:
        """Make the next poll see fault ``kind`` on GPU ``gpu``.

        Raises:
            ValueError: NVML lists no GPU ``gpu`` here.
        """
        known = [g.index for g in self.gpus]
        if self.nvml is not None and gpu not in known:
            raise ValueError(f"no GPU {gpu} on this node (NVML lists {known})")
        self._injected.append((gpu, kind, code))

    def poll(self) -> list[GpuFault]:
        """Read every GPU (blocking NVML calls: run it off the event loop when NVML is
        there), apply the faults injected since the last poll, and classify."""
        real = self.nvml.read() if self.nvml is not None else {}
        current = dict(real)
        while self._injected:
            gpu, kind, code = self._injected.popleft()
            current[gpu] = injected_reading(current.get(gpu, GpuReading()), kind, code)
        faults = gpu_faults(self.previous, current)
        self.previous.update(real)  # an injection never becomes the baseline
        return faults

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()

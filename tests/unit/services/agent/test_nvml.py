"""The agent's NVML boundary: discovery where NVML is absent (this machine, for real), the
pure classification of GPU health readings, and faults injected at the boundary.

No fake NVML: discovery is the real ``pynvml`` against this machine's (missing)
library; the classifier is a pure function of readings, tested as one; an injected
fault goes through the same classifier as a real reading.
"""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest

from phalanx.schemas.messages import GpuFaultKind, GpuInfo
from phalanx.services.agent import nvml
from phalanx.services.agent.nvml import (
    GpuFault,
    GpuReading,
    GpuWatch,
    cpus_of,
    describe,
    discover,
    gpu_faults,
    injected_reading,
)

XID, ECC, LOST = GpuFaultKind.XID, GpuFaultKind.ECC, GpuFaultKind.LOST


def test_without_nvml_discovery_finds_nothing_and_polls_see_nothing() -> None:
    """This machine has no libnvidia-ml: the real pynvml says so, and discovery is None."""
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this machine (the GPU path is bench/gpu_node.py's)")
    assert discover() is None
    watch = GpuWatch(None)
    assert watch.gpus == [] and watch.poll() == [] and watch.previous == {}


def test_a_first_reading_is_the_baseline_for_counts_but_not_for_a_reset_due() -> None:
    """ECC errors counted before the agent started are no news; a pending retirement or a
    failed remap is (the GPU needs a reset before use)."""
    assert gpu_faults({}, {0: GpuReading(ecc_uncorrected=7, throttle=0)}) == []
    assert [(f.kind, f.fatal) for f in gpu_faults({}, {0: GpuReading(retired_pending=True),
                                                       1: GpuReading(remap_failed=True)})] \
        == [(GpuFaultKind.RETIRED_PAGES, True), (GpuFaultKind.ROW_REMAP, True)]


@pytest.mark.parametrize(("before", "now", "seen"), [
    (GpuReading(), GpuReading(), []),
    (GpuReading(), GpuReading(lost=True),
     [(LOST, "GPU lost (fallen off the bus or unreachable)", True)]),
    (GpuReading(lost=True), GpuReading(lost=True), []),  # still lost: said once
    (GpuReading(), GpuReading(xids=(79, 48)), [(XID, "Xid 79", True), (XID, "Xid 48", True)]),
    (GpuReading(), GpuReading(xids=(13,)),
     [(XID, "Xid 13 (the application's own error)", False)]),
    (GpuReading(ecc_uncorrected=2), GpuReading(ecc_uncorrected=5),
     [(ECC, "uncorrectable ECC errors 5 (+3)", True)]),
    (GpuReading(ecc_uncorrected=5), GpuReading(ecc_uncorrected=5), []),
    (GpuReading(ecc_uncorrected=5), GpuReading(ecc_uncorrected=0), []),  # reset: no news
    (GpuReading(ecc_uncorrected=None), GpuReading(ecc_uncorrected=4), []),  # ECC turned on
    (GpuReading(), GpuReading(ecc_events=1), [(ECC, "uncorrectable ECC errors", True)]),
    (GpuReading(ecc_uncorrected=1), GpuReading(ecc_uncorrected=2, ecc_events=1),
     [(ECC, "uncorrectable ECC errors 2 (+1)", True)]),  # one fault, not two
    (GpuReading(retired_pending=True), GpuReading(retired_pending=True), []),
    (GpuReading(), GpuReading(throttle=0x08 | 0x40),
     [(GpuFaultKind.THROTTLE, "clocks throttled: HW slowdown, HW thermal slowdown", False)]),
    (GpuReading(throttle=0x08), GpuReading(throttle=0x08 | 0x01), []),  # idle is no reason
])
def test_what_a_reading_says_against_the_last(before: GpuReading, now: GpuReading,
                                              seen: list[tuple]) -> None:
    assert [(f.kind, f.what, f.fatal) for f in gpu_faults({3: before}, {3: now})] == seen
    assert all(f.gpu == 3 and not f.injected for f in gpu_faults({3: before}, {3: now}))


@pytest.mark.parametrize(("kind", "code", "what", "fatal"), [
    (XID, None, "Xid 79", True),
    (XID, 94, "Xid 94", True),
    (ECC, None, "uncorrectable ECC errors 1", True),
    (GpuFaultKind.RETIRED_PAGES, None, "retired pages pending (the GPU needs a reset)", True),
    (GpuFaultKind.ROW_REMAP, None, "row remapping failed", True),
    (LOST, None, "GPU lost (fallen off the bus or unreachable)", True),
    (GpuFaultKind.THROTTLE, None, "clocks throttled: SW power cap, HW slowdown, SW thermal "
     "slowdown, HW thermal slowdown, HW power brake slowdown", False),
])
def test_an_injected_fault_is_classified_as_a_real_one(kind: GpuFaultKind, code: int | None,
                                                       what: str, fatal: bool) -> None:
    """On a node without NVML (the GPU index names a slot): the next poll sees the fault
    once, marked injected; the poll after sees nothing; injected again, seen again."""
    watch = GpuWatch(None)
    for _ in range(2):
        watch.inject(1, kind, code)
        assert watch.poll() == [GpuFault(1, kind, what, fatal, injected=True)]
        assert watch.poll() == []
    assert watch.previous == {}  # an injection never becomes the baseline


def test_an_injection_changes_the_real_reading_it_lands_on() -> None:
    """On a GPU, the injected ECC error counts up from the count NVML read."""
    base = GpuReading(ecc_uncorrected=4, throttle=0x08)
    hit = injected_reading(base, ECC, None)
    assert (hit.ecc_uncorrected, hit.ecc_events, hit.throttle, hit.injected) == (5, 1, 0x08, True)
    [fault] = gpu_faults({0: base}, {0: hit})
    assert (fault.what, fault.injected) == ("uncorrectable ECC errors 5 (+1)", True)


def test_describe_names_the_gpu_or_the_slot_standing_in_for_it() -> None:
    gpu = GpuInfo(index=2, uuid="GPU-5d2c")
    faults = [GpuFault(2, XID, "Xid 48", True), GpuFault(2, ECC, "uncorrectable ECC errors 1",
                                                         True)]
    assert describe(2, faults, gpu) == "Xid 48; uncorrectable ECC errors 1 on GPU 2 (GPU-5d2c)"
    injected = [GpuFault(0, XID, "Xid 79", True, injected=True)]
    assert describe(0, injected, None) == \
        "Xid 79 on slot 0 (a CPU slot: no GPU seen here), injected by phalanx chaos"


def test_cpu_affinity_words_become_cpu_lists() -> None:
    assert cpus_of([0b1011]) == [0, 1, 3]
    assert cpus_of([0, 1 << 63, 0b1]) == [127, 128]
    assert cpus_of([]) == []


def test_every_nvml_name_the_boundary_uses_exists_in_the_installed_pynvml() -> None:
    """No GPU here to call them: at least each function, constant and error class the
    boundary names is one the real package has (a typo would surface only on a GPU)."""
    source = Path(nvml.__file__).read_text()
    used = set(re.findall(r"\b(?:lib|pynvml)\.(\w+)", source))
    assert {"nvmlInit", "nvmlEventSetWait_v2", "NVMLError_GpuIsLost"} <= used
    assert sorted(name for name in used if not hasattr(pynvml, name)) == []


def test_on_a_gpu_discovery_describes_each_gpu_and_a_poll_reads_them_healthy() -> None:
    """Where NVML is there (a GPU machine; skipped here): the real view, a real poll, and
    an injected fault landing on the real reading of GPU 0."""
    found = discover()
    if found is None:
        pytest.skip("no NVML here: the GPU path runs on a GPU machine (bench/gpu_run.sh)")
    watch = GpuWatch(found)
    try:
        assert [g.index for g in found.gpus] == list(range(len(found.gpus)))
        for gpu in found.gpus:
            assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpu.memory_bytes > 0, gpu
            assert gpu.pci_bus_id and gpu.name, gpu
        assert set(watch.previous) == {g.index for g in found.gpus}
        assert not [f for f in watch.poll() if f.fatal]  # a healthy machine
        watch.inject(0, XID, 79)
        [fault] = [f for f in watch.poll() if f.fatal]
        assert (fault.gpu, fault.what, fault.injected) == (0, "Xid 79", True)
        assert describe(0, [fault], found.gpus[0]).startswith(
            f"Xid 79 on GPU 0 ({found.gpus[0].uuid})")
    finally:
        watch.close()

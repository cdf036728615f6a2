"""GPU nodes' slots: which GPUs are the slots, the slots a GPU fault takes out of use, how
the node record keeps them, and the CPUs a rank on a GPU is pinned to."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from phalanx.schemas.codec import decode, encode
from phalanx.schemas.errors import ConfigError, WireError
from phalanx.schemas.messages import ExitCause, GpuInfo, NodeInfo, NodeRecord
from phalanx.schemas.registry import view
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import (
    StopReason,
    exit_cause,
    gpu_slots,
    heartbeat,
    node_gpus,
    rank_cpus,
    register,
)
from phalanx.services.agent.ranks import RankSet

T0 = 1_717_000_000.0
H100 = [GpuInfo(index=i, uuid=f"GPU-{i}", cpus=list(range(8 * i, 8 * i + 8)))
        for i in range(4)]


def info(slots: int = 4, pid: int = 100) -> NodeInfo:
    return NodeInfo(node_id="gpu-07", host="h", slots=slots, failure_domain="r", agent_pid=pid)


@pytest.mark.parametrize(("slots", "gpus", "found", "expected"), [
    (None, (), None, (16, ())),  # no NVML: one CPU slot per CPU, as before
    (3, (), None, (3, ())),
    (None, (), H100, (4, (0, 1, 2, 3))),  # NVML's GPUs, one slot each
    (4, (), H100, (4, (0, 1, 2, 3))),
    (None, (2, 3), H100, (2, (2, 3))),  # configured GPUs win
    (4, (0, 0, 0, 0), H100, (4, (0, 0, 0, 0))),
    (None, (1,), None, (1, (1,))),
])
def test_the_slots_are_the_configured_gpus_else_nvmls_else_the_cpus(
        slots: int | None, gpus: tuple[int, ...], found: list[GpuInfo] | None,
        expected: tuple[int, tuple[int, ...]]) -> None:
    assert node_gpus(slots, gpus, found, cpus=16) == expected


def test_a_slot_count_that_contradicts_the_gpus_found_is_refused_saying_what_to_set() -> None:
    with pytest.raises(ConfigError, match=r"agent.slots is 2 but NVML found 4 GPUs, one slot "
                                          r"each: set agent.gpus .* \(e.g. 0,1\)"):
        node_gpus(2, (), H100, cpus=16)


def test_config_leaves_the_slots_to_discovery_and_reads_the_gpu_settings() -> None:
    config = AgentConfig.from_env({"PHALANX_AGENT_NODE_ID": "n",
                                   "PHALANX_AGENT_DISCOVER_GPUS": "0",
                                   "PHALANX_AGENT_GPU_POLL_INTERVAL_S": "0.25"})
    assert (config.slots, config.gpus, config.discover_gpus, config.gpu_poll_interval_s) \
        == (None, (), False, 0.25)
    assert AgentConfig(node_id="n").discover_gpus is True
    with pytest.raises(ConfigError, match="agent.gpu_poll_interval_s must be > 0, got 0"):
        AgentConfig(node_id="n", gpu_poll_interval_s=0.0)


@pytest.mark.parametrize(("gpu", "gpus", "slots", "hit"), [
    (1, (0, 1, 2, 3), 4, (1,)),
    (0, (0, 0, 1, 1), 4, (0, 1)),  # slots sharing a GPU fail together
    (5, (0, 1), 2, ()),  # a GPU no slot runs on
    (2, (), 4, (2,)),  # a CPU node: the index names a slot
    (4, (), 4, ()),
])
def test_the_slots_a_gpu_fault_takes(gpu: int, gpus: tuple[int, ...], slots: int,
                                     hit: tuple[int, ...]) -> None:
    assert gpu_slots(gpu, gpus, slots) == hit


def test_a_rank_is_pinned_to_its_gpus_cpus_and_a_cpu_rank_nowhere() -> None:
    assert rank_cpus((0, 1, 2, 3), H100, (1,)) == set(range(8, 16))
    assert rank_cpus((0, 1, 2, 3), H100, (2, 3)) == set(range(16, 32))
    assert rank_cpus((), H100, (0,)) == set()  # CPU slots
    assert rank_cpus((7,), H100, (0,)) == set()  # a GPU NVML did not describe


def test_a_gpu_faults_exit_is_its_own_cause() -> None:
    assert exit_cause(StopReason.GPU_FAULT) is ExitCause.GPU_FAULT


def test_heartbeats_add_the_agents_cordons_and_keep_the_stored_ones() -> None:
    record = register(None, info(), T0)
    assert record.cordoned_slots == {}
    record = heartbeat(record, info(), T0 + 1, cordons={2: "Xid 79 on GPU 2 (GPU-2)"})
    assert record.cordoned_slots == {2: "Xid 79 on GPU 2 (GPU-2)"}
    # Cordoned again meanwhile: the first reason stays; another slot is added.
    record = heartbeat(record, info(), T0 + 2, cordons={2: "Xid 48", 0: "GPU lost on GPU 0"})
    assert record.cordoned_slots == {0: "GPU lost on GPU 0", 2: "Xid 79 on GPU 2 (GPU-2)"}
    # An operator's uncordon (the stored record) is kept by the next heartbeat.
    uncordoned = msgspec.structs.replace(record, cordoned_slots={0: "GPU lost on GPU 0"})
    assert heartbeat(uncordoned, info(), T0 + 3).cordoned_slots == {0: "GPU lost on GPU 0"}


def test_a_re_registration_keeps_the_cordons_the_node_still_has_slots_for() -> None:
    held = heartbeat(register(None, info(), T0), info(), T0,
                     cordons={1: "Xid 79", 3: "ECC"})
    restarted = register(held, info(pid=101), T0 + 10, silent=held)
    assert restarted.cordoned_slots == {1: "Xid 79", 3: "ECC"}
    # Back with fewer slots (fewer GPUs): a cordon beyond them goes.
    fewer = register(held, info(slots=2, pid=101), T0 + 10, silent=held)
    assert fewer.cordoned_slots == {1: "Xid 79"}


def test_a_node_record_refuses_cordons_beyond_its_slots() -> None:
    record = NodeRecord(node=info(slots=4), cordoned_slots={3: "Xid 79"})
    assert record.usable_slots == 3
    with pytest.raises(ValueError, match=r"cordoned_slots \[4, 9\] are beyond the node's 4 "
                                         r"slots \(0\.\.3\)"):
        NodeRecord(node=info(slots=4), cordoned_slots={4: "x", 9: "y", 0: "z"})
    wire = encode(NodeRecord(node=info(slots=8), cordoned_slots={7: "Xid 79"}))
    assert decode(wire, NodeRecord).cordoned_slots == {7: "Xid 79"}
    fields = msgspec.msgpack.decode(wire)
    fields["node"]["slots"] = 4  # a peer's record whose cordons its slots do not hold
    as_four = msgspec.msgpack.encode(fields)
    with pytest.raises(WireError, match="beyond the node's 4 slots"):
        decode(as_four, NodeRecord)


def test_the_registry_view_offers_no_cordoned_slot() -> None:
    record = NodeRecord(node=info(slots=4), heartbeat_at=T0, slots_used=2,
                        cordoned_slots={0: "Xid 79"})
    node = view(record, T0)
    assert node.cordoned_slots == {0: "Xid 79"} and node.schedulable_slots == 1


async def test_a_rank_on_a_gpu_slot_is_pinned_to_the_cpus_nvml_gave_its_gpu(
        tmp_path: Path) -> None:
    """The pinning itself, for real, on a process like a rank just spawned: GPU 1's CPUs
    as NVML would give them (here the agent's second CPU)."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin to")

    async def nowhere(_: object) -> None:
        raise AssertionError("nothing is reported")

    found = [GpuInfo(index=0, uuid="GPU-0", cpus=allowed[:1]),
             GpuInfo(index=1, uuid="GPU-1", cpus=[allowed[1], 10_000])]  # one not ours
    ranks = RankSet("n", tmp_path, "nats://127.0.0.1:4222", nowhere, nowhere,
                    gpus=(0, 1), found_gpus=found)
    cpu_ranks = RankSet("n", tmp_path, "nats://127.0.0.1:4222", nowhere, nowhere)
    rank = subprocess.Popen(["sleep", "30"])
    other = subprocess.Popen(["sleep", "30"])
    try:
        ranks.pin(rank.pid, (1,))
        cpu_ranks.pin(other.pid, (1,))
        assert os.sched_getaffinity(rank.pid) == {allowed[1]}
        assert os.sched_getaffinity(other.pid) == set(allowed)  # a CPU slot: not pinned
    finally:
        for process in (rank, other):
            process.kill()
            process.wait()

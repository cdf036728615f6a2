"""A GPU node's agent: its GPU per slot (``agent.gpus``), and the slot a replica runs in."""

from __future__ import annotations

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import node_slots, rank_devices

BASE = {"PHALANX_AGENT_NODE_ID": "gpu-07"}


def test_gpus_from_env_give_one_slot_each_unless_slots_are_set() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_GPUS": "0, 1,2,3"})
    assert config.gpus == (0, 1, 2, 3) and config.slots == 4
    shared = AgentConfig.from_env({**BASE, "PHALANX_AGENT_GPUS": "0,0,0,0",
                                   "PHALANX_AGENT_SLOTS": "4"})
    assert shared.gpus == (0, 0, 0, 0) and shared.slots == 4


def test_without_gpus_the_slots_are_the_cpus_as_before() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_SLOTS": "8"})
    assert config.gpus == () and config.slots == 8
    assert AgentConfig.from_env({**BASE, "PHALANX_AGENT_GPUS": ""}).gpus == ()


@pytest.mark.parametrize(("env", "message"), [
    ({"PHALANX_AGENT_GPUS": "0,1", "PHALANX_AGENT_SLOTS": "4"},
     "agent.gpus lists 2 GPUs for 4 slots: one GPU index per slot"),
    ({"PHALANX_AGENT_GPUS": "0,x"}, "gpus must be CUDA device indices separated by commas"),
    ({"PHALANX_AGENT_GPUS": "0,-1"}, "gpus must be CUDA device indices"),
])
def test_bad_gpus_are_refused_saying_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AgentConfig.from_env({**BASE, **env})


def test_negative_gpu_indices_are_refused_when_given_directly() -> None:
    with pytest.raises(ConfigError, match=r"CUDA device indices \(>= 0\), got \[0, -2\]"):
        AgentConfig(node_id="n", slots=2, gpus=(0, -2))


@pytest.mark.parametrize(("held", "count", "slots"), [
    (set(), 1, (0,)),
    ({0, 1}, 1, (2,)),
    ({1}, 1, (0,)),  # a slot freed by a replica that ended is taken again
    ({0, 2}, 2, (1, 3)),
])
def test_a_replica_takes_the_lowest_free_slots(held: set[int], count: int,
                                               slots: tuple[int, ...]) -> None:
    assert node_slots(held, count) == slots


def test_a_gpu_slot_sees_its_gpu_alone_and_a_cpu_slot_sees_none_set() -> None:
    # On a GPU node cuda:LOCAL_RANK is the slot's GPU: the first, and only, one it sees.
    assert rank_devices((3, 1, 1), (1,)) == {
        "LOCAL_RANK": "0", "PHALANX_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "1"}
    assert rank_devices((3, 1, 1), (0, 2)) == {
        "LOCAL_RANK": "0", "PHALANX_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "3,1"}
    assert rank_devices((), (5,)) == {"LOCAL_RANK": "5", "PHALANX_DEVICE": "cpu"}
    with pytest.raises(ValueError, match=r"slots \[2\] have no GPU: the node lists 2"):
        rank_devices((0, 1), (2,))

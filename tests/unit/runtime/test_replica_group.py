"""A replica group's checks and shard handling, on a one-rank gloo group in this process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from phalanx.runtime import replica_group
from phalanx.runtime.elastic import ElasticSession
from phalanx.runtime.flat_state import copy_range, flat_state, load_flat
from phalanx.runtime.replica_group import GroupMismatch

pytestmark = pytest.mark.usefixtures("no_default_group")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def sharded(whole: torch.nn.Module) -> torch.nn.Module:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in (whole[0], whole[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(whole, mesh=mesh)
    return whole


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, generator=g), torch.randn(1, generator=g)) for _ in range(32)]


def train(net: torch.nn.Module) -> ElasticSession:
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    session = ElasticSession(net, optimizer, data(), global_batch=8, micro_batch_size=3,
                             deterministic=True)
    for step in session.steps(6):
        for x, y in step:
            step.backward(torch.nn.functional.mse_loss(net(x), y))
        step.clip_grad_norm_(0.5)
        assert step.commit()
    return session


def test_a_sharded_model_trains_alone_as_the_same_model_whole() -> None:
    whole = model()
    reference = copy.deepcopy(whole)
    train(reference)
    dist.destroy_process_group()
    session = train(sharded(whole))
    assert dist.is_initialized() and dist.get_backend() == "gloo"  # the group's, kept
    for mine, theirs in zip(session.model.parameters(), reference.parameters(), strict=True):
        assert replica_group.is_dtensor(mine)
        assert torch.equal(replica_group.local(mine), theirs.detach())


def test_a_shard_leaves_as_its_local_tensor_and_comes_back_as_the_same_dtensor() -> None:
    net = sharded(model())
    weight = next(net.parameters())
    spec = replica_group.shard_spec(weight)
    assert spec is not None and replica_group.shard_spec(torch.zeros(1)) is None
    back = replica_group.rewrap(replica_group.local(weight).clone(), spec,
                                replica_group.meshes_of(net))
    assert back.placements == weight.placements and back.shape == weight.shape
    assert torch.equal(back.full_tensor(), weight.full_tensor())
    with pytest.raises(GroupMismatch, match="came from a peer"):
        replica_group.rewrap(torch.zeros(1), spec, {})


def test_a_group_whose_model_is_not_sharded_is_refused_with_the_fix() -> None:
    with pytest.raises(GroupMismatch, match=r"init_device_mesh\(device, \(2,\)\)"):
        replica_group.of(model(), 2)
    assert replica_group.of(model(), 1) is None


def test_a_model_sharded_over_another_group_than_the_replicas_is_refused_with_the_fix() -> None:
    net = sharded(model())  # over a world of one, but the job's groups are of 2
    with pytest.raises(GroupMismatch, match="default group has 1 ranks and its replica "
                                            "group 2"):
        replica_group.of(net, 2)
    assert replica_group.of(net, 1) == replica_group.ReplicaGroup(0, 1)


def test_a_group_ranks_snapshot_holds_its_shards_and_loads_back_as_dtensors() -> None:
    """The memory tier's layout of a sharded model: local shards only, and the optimizer's
    DTensors made again over the loading rank's mesh, bitwise."""
    net = sharded(model())
    session = train(net)
    state = flat_state(net, session.optimizer, {}, 6)
    assert state.meta["tensors"][0] == (tuple(replica_group.local(
        next(iter(net.state_dict().values()))).shape), "torch.float32")
    flat = torch.empty(state.total, dtype=torch.uint8)
    copy_range(state, 0, flat)
    fresh = sharded(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    load_flat(flat, state.meta, fresh, optimizer, {})
    for mine, theirs in zip(fresh.parameters(), net.parameters(), strict=True):
        assert torch.equal(replica_group.local(mine), replica_group.local(theirs))
    loaded, trained = optimizer.state_dict()["state"], session.optimizer.state_dict()["state"]
    for index, entry in trained.items():
        for key, value in entry.items():
            if replica_group.is_dtensor(value):
                assert replica_group.is_dtensor(loaded[index][key])
                assert loaded[index][key].placements == value.placements
            assert torch.equal(replica_group.local(loaded[index][key]),
                               replica_group.local(value)), (index, key)

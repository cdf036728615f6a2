"""A ZeroRedundancyOptimizer under the session's rules, on real gloo groups (one thread a
member): stepped, handed over, snapshotted and restored at another world size, it stays
bitwise equal to the plain optimizer it shards."""

from __future__ import annotations

import copy
import mmap
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_pair import in_group

from phalanx.runtime.flat_state import flat_state
from phalanx.runtime.sharded import Sharded, sharded_optimizer
from phalanx.runtime.snapshot import restore, write_share
from phalanx.schemas import snapshot_file


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 1))


def gradients(model: torch.nn.Module, step: int) -> None:
    """The same global gradient on every member (as after the session's all-reduce)."""
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def plain_run(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        gradients(model, step)
        optimizer.step()
    return model, optimizer


def member(model: torch.nn.Module) -> Sharded:
    return Sharded(sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01))


def train(shards: list[Sharded], models: list[torch.nn.Module], steps: range) -> None:
    """``steps`` sharded steps of every member, re-pointed at its rank of ``len(shards)``."""
    def work(rank: int, group: dist.ProcessGroup) -> None:
        for step in steps:
            gradients(models[rank], step)
            shards[rank].step(group, lambda w: w.wait())

    in_group(len(shards), work)


def assert_same(model: torch.nn.Module, optimizer_state: dict, reference: tuple) -> None:
    for mine, theirs in zip(model.parameters(), reference[0].parameters(), strict=True):
        assert torch.equal(mine, theirs)
    expected = reference[1].state_dict()["state"]
    assert sorted(optimizer_state) == sorted(expected)
    for index, state in expected.items():
        for name, value in state.items():
            assert torch.equal(optimizer_state[index][name], value), (index, name)


def owned_everywhere(shards: list[Sharded]) -> dict:
    """Every member's entries, each owned by exactly one member."""
    everything: dict = {}
    for shard in shards:
        assert not set(everything) & set(shard.owned_state())
        everything.update(shard.owned_state())
    return everything


def test_partitioned_steps_then_a_join_and_a_leave_hand_over_owner_to_owner(
        ) -> None:
    models = [build() for _ in range(3)]  # built before the threads: one RNG
    shards = [member(m) for m in models]
    for rank, shard in enumerate(shards[:2]):
        shard.repartition(rank, 2)
    assert sorted(len(s.zero.optim.param_groups[0]["params"]) for s in shards[:2]) == [3, 3]
    train(shards[:2], models, range(3))
    assert not shards[0].holds_all
    with pytest.raises(RuntimeError, match="holds only a partition"):
        shards[0].state_dict()
    # A join, 2 -> 3: the members hold their partitions through the switch; the joiner
    # receives the model and the replicated state only; the entries go owner to owner.
    for shard in shards[:2]:
        shard.hold()
    replicated = shards[0].state_dict()
    assert replicated["state"] == {}
    models[2].load_state_dict(models[0].state_dict())
    shards[2].load_state_dict(copy.deepcopy(replicated))
    assert not shards[2].holds_all  # until its entries come, it holds none
    moved = []

    def join(rank: int, group: dist.ProcessGroup) -> None:
        holders = shards[rank].agree(group, lambda w: w.wait(), rank, 3, 3)
        assert holders is not None
        moved.append(shards[rank].take_over(group, lambda w: w.wait(), rank, 3, holders))
        shards[rank].repartition(rank, 3)

    in_group(3, join)
    owners = shards[0].owners(3)
    for rank, shard in enumerate(shards):
        assert sorted(shard.owned_state()) == sorted(i for i, o in owners.items() if o == rank)
    # Only what changes owner moves: less than the whole state each (a gather moves all).
    whole = sum(v.numel() * v.element_size() for s in plain_run(3)[1].state_dict()["state"]
                .values() for v in s.values())
    assert 0 < max(moved) < whole
    for model in models:
        assert_same(model, owned_everywhere(shards), plain_run(3))
    train(shards, models, range(3, 5))
    # A leave, 3 -> 2: member 1 goes; before the switch the staying members receive their
    # new partitions' entries over the old group, the leaving one's included.

    def leave(rank: int, group: dist.ProcessGroup) -> None:
        shards[rank].hand_to(group, lambda w: w.wait(), [0, 2], 2)

    in_group(3, leave)
    assert shards[1].held is None and shards[0].held == (0, 2) and shards[2].held == (1, 2)
    staying = [shards[0], shards[2]]

    def switch(rank: int, group: dist.ProcessGroup) -> None:
        holders = staying[rank].agree(group, lambda w: w.wait(), rank, 2, 5)
        assert holders is not None and set(holders.values()) == {0, 1}
        assert staying[rank].take_over(group, lambda w: w.wait(), rank, 2, holders) == 0
        staying[rank].repartition(rank, 2)

    in_group(2, switch)
    assert_same(models[0], owned_everywhere(staying), plain_run(5))
    train(staying, [models[0], models[2]], range(5, 7))
    reference = plain_run(7)
    for model in (models[0], models[2]):
        assert_same(model, owned_everywhere(staying), reference)


def test_held_partitions_that_do_not_add_up_are_let_go() -> None:
    models = [build() for _ in range(3)]
    shards = [member(m) for m in models]
    for rank, shard in enumerate(shards):
        shard.repartition(rank, 3)
    train(shards, models, range(2))
    for shard in shards:
        shard.hold()
    # Member 1 died after the switch: the two left hold partitions 0 and 2 of 3.
    survivors = [shards[0], shards[2]]

    def agree(rank: int, group: dist.ProcessGroup) -> object:
        return survivors[rank].agree(group, lambda w: w.wait(), rank, 2, 2)

    assert in_group(2, agree) == [None, None]
    assert all(s.held is None and not s.holds_all for s in survivors)
    with pytest.raises(RuntimeError, match="holds only a partition"):
        survivors[0].state_dict()


def test_each_owner_snapshots_its_entries_once_and_a_restore_repartitions_them(
        tmp_path: Path) -> None:
    models = [build() for _ in range(3)]
    shards = [member(m) for m in models]
    scheduler = torch.optim.lr_scheduler.StepLR(shards[0].zero, 2)  # replicated state
    for rank, shard in enumerate(shards):
        shard.repartition(rank, 3)
    train(shards, models, range(4))
    # Member 0's node holds shards 0 and 1, member 1's shard 2: some extents are read where
    # they lie, the others broadcast by their holder.
    stores = [tmp_path / "node-0", tmp_path / "node-1"]
    for store in stores:
        store.mkdir()
    owned_bytes = []
    for rank, (model, shard) in enumerate(zip(models, shards, strict=True)):
        store = stores[rank // 2]
        state = flat_state(model, shard, {"scheduler": scheduler}, 4)
        assert state.owned is not None and "owned" in state.meta
        owned_bytes.append(state.owned.total)
        _, length = state.extent(rank, 3)
        path = store / f"s{rank}"
        meta = pickle.dumps(state.meta)
        path.write_bytes(b"\0" * (snapshot_file.HEADER_BYTES + len(meta) + length))
        with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as buffer:
            write_share(memoryview(buffer), state, meta, "job-z", 4, 1, rank, 3)
    # AdamW's entries (two moments and a step per parameter) each written by one owner.
    plain = plain_run(4)
    assert sum(owned_bytes) >= sum(v.numel() * v.element_size() for s in
                                    plain[1].state_dict()["state"].values() for v in s.values())
    # Restored by two members: each loads the model and keeps its new partition.
    targets = [build(7) for _ in range(2)]
    restored_shards = [member(m) for m in targets]
    schedulers = [torch.optim.lr_scheduler.StepLR(s.zero, 2) for s in restored_shards]

    def load(rank: int, group: dist.ProcessGroup) -> int:
        done = restore(group, lambda w: w.wait(), rank, 2, stores[rank], "job-z", 0,
                       targets[rank],
                       restored_shards[rank], {"scheduler": schedulers[rank]},
                       lambda *problem: pytest.fail(f"reported {problem}"))
        restored_shards[rank].repartition(rank, 2)
        return done.step

    assert in_group(2, load) == [4, 4]
    everything = {}
    for shard in restored_shards:
        everything.update(shard.owned_state())
    for model in targets:
        assert_same(model, everything, plain)
    assert schedulers[1].state_dict() == scheduler.state_dict()
    train(restored_shards, targets, range(4, 7))
    reference = plain_run(7)
    everything = {}
    for shard in restored_shards:
        everything.update(shard.owned_state())
    assert_same(targets[0], everything, reference)


def test_a_consolidated_snapshot_loads_into_a_plain_optimizer(tmp_path: Path) -> None:
    model = build()
    shard = member(model)
    train([shard], [model], range(2))
    state = flat_state(model, shard, {}, 2)
    meta = pickle.dumps(state.meta)
    _, length = state.extent(0, 1)
    path = tmp_path / "s0"
    path.write_bytes(b"\0" * (snapshot_file.HEADER_BYTES + len(meta) + length))
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as buffer:
        write_share(memoryview(buffer), state, meta, "job-p", 2, 0, 0, 1)
    target = build(3)
    optimizer = torch.optim.AdamW(target.parameters(), lr=0.01)

    def load(rank: int, group: dist.ProcessGroup) -> None:
        restore(group, lambda w: w.wait(), 0, 1, tmp_path, "job-p", 0, target, optimizer, {},
                lambda *problem: pytest.fail(f"reported {problem}"))

    in_group(1, load)
    assert_same(target, optimizer.state_dict()["state"], plain_run(2))


def test_a_sharded_optimizer_refuses_what_the_session_cannot_partition() -> None:
    model = build()
    zero = sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.01,
                             parameters_as_bucket_view=True)
    with pytest.raises(ValueError, match="parameters_as_bucket_view"):
        Sharded(zero)

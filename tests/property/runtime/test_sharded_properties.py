"""Whatever the world sizes, a sharded optimizer's state survives snapshots, durable
steps and planned membership changes whole: written by any number of owners, restored and
re-partitioned over any other, or handed owner to owner through a join and a leave, every
entry lands on exactly one new owner, bitwise as the plain optimizer holds it."""

from __future__ import annotations

import copy
import datetime
import itertools
import pickle
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
from gloo_pair import in_group
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.runtime import durable
from phalanx.runtime.flat_state import flat_state
from phalanx.runtime.sharded import Sharded, sharded_optimizer
from phalanx.runtime.snapshot import restore, write_share
from phalanx.schemas import snapshot_file

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=30)


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], int, int, int, list[int]]:
    widths = draw(st.lists(st.integers(1, 12), min_size=2, max_size=5))
    old = draw(st.integers(1, 5))
    return (widths, draw(st.integers(0, 3)), old, draw(st.integers(1, 5)),
            draw(st.permutations(range(old))))


def trained(widths: list[int], steps: int):
    torch.manual_seed(len(widths))
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def members(model: torch.nn.Module, full: dict, world: int) -> list[Sharded]:
    """``world`` owners of ``full`` (a consolidated state), each re-partitioned."""
    found = []
    for rank in range(world):
        sharded = Sharded(sharded_optimizer(copy.deepcopy(model).parameters(),
                                            torch.optim.AdamW, lr=0.01))
        sharded.load_state_dict(copy.deepcopy(full))
        sharded.repartition(rank, world)
        found.append(sharded)
    return found


def check_partitions(full: dict, expected: torch.optim.Optimizer, world: int,
                     model: torch.nn.Module) -> None:
    owners = members(model, full, world)
    owned = [s.owned_state() for s in owners]
    indices = [set(o) for o in owned]
    assert sum(map(len, indices)) == len(set().union(*indices))  # each entry on one owner
    union = {index: entry for o in owned for index, entry in o.items()}
    plain = expected.state_dict()
    assert sorted(union) == sorted(plain["state"])
    for index, entry in plain["state"].items():
        for name, value in entry.items():
            assert torch.equal(union[index][name], value), (index, name)
    for owner in owners:
        assert owner.zero.param_groups[0]["lr"] == plain["param_groups"][0]["lr"]


@SETTINGS
@given(case=cases())
def test_owners_snapshot_and_persist_any_world_restores_and_repartitions(
        case, tmp_path_factory) -> None:
    widths, steps, old, new, order = case
    tmp = Path(tmp_path_factory.mktemp("case"))
    model, optimizer, scheduler = trained(widths, steps)
    owners = members(model, optimizer.state_dict(), old)
    store = tmp / "store"
    store.mkdir()
    fs = fsspec.filesystem("file")
    committed = []
    for shard in order:  # the owners' snapshots, and their durable writes, in any order
        state = flat_state(model, owners[shard], {"scheduler": scheduler}, steps + 1)
        meta = pickle.dumps(state.meta)
        buffer = bytearray(snapshot_file.HEADER_BYTES + len(meta) + state.extent(shard, old)[1])
        header = write_share(memoryview(buffer), state, meta, "job-p", steps + 1, 2, shard,
                             old)
        (store / f"w-s{shard}").write_bytes(bytes(buffer))
        meta_view, data = snapshot_file.verify(memoryview(buffer), header)
        committed.append(durable.write_shard(fs, str(tmp / "durable"), header,
                                             bytes(meta_view), data, 2).committed)
    assert [c is not None for c in committed] == [False] * (old - 1) + [True]

    fresh = trained(widths, 0)[0]
    torch.manual_seed(99)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))
    target = Sharded(sharded_optimizer(fresh.parameters(), torch.optim.AdamW, lr=0.5))
    target_scheduler = torch.optim.lr_scheduler.StepLR(target.zero, 2)
    done = restore(group, lambda work: work.wait(), 0, 1, store, "job-p", 0, fresh, target,
                   {"scheduler": target_scheduler}, lambda *problem: None)
    assert done is not None and done.step == steps + 1
    for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert target_scheduler.state_dict() == scheduler.state_dict()
    assert target.full is not None
    check_partitions(target.full, optimizer, new, model)

    [step] = durable.committed_steps(fs, f"{tmp}/durable/job-p")
    record = durable.verify(fs, step)
    from_storage = Sharded(sharded_optimizer(copy.deepcopy(fresh).parameters(),
                                             torch.optim.AdamW, lr=0.5))
    durable.load(fs, step, record, copy.deepcopy(fresh), from_storage,
                 {"scheduler": torch.optim.lr_scheduler.StepLR(from_storage.zero, 2)})
    assert from_storage.full is not None
    check_partitions(from_storage.full, optimizer, new, model)

    # Each new owner restoring only its partition (as the session does) builds just that.
    plain = optimizer.state_dict()["state"]
    built: set[int] = set()
    for rank in range(new):
        for source in ("memory", "durable"):
            owner = Sharded(sharded_optimizer(copy.deepcopy(fresh).parameters(),
                                              torch.optim.AdamW, lr=0.5))
            keep = owner.keeps(rank, new)
            if source == "memory":
                restore(group, lambda work: work.wait(), 0, 1, store, "job-p", 0,
                        copy.deepcopy(fresh), owner, {"scheduler": scheduler}, print, keep)
            else:
                durable.load(fs, step, record, copy.deepcopy(fresh), owner,
                             {"scheduler": torch.optim.lr_scheduler.StepLR(owner.zero, 2)}, keep)
            assert owner.partial and not owner.holds_all
            expected = {index for index in plain if keep(index)}
            assert owner.full is not None and set(owner.full["state"]) == expected
            owner.repartition(rank, new)
            assert set(owner.owned_state()) == expected
            for index in expected:
                for name, value in plain[index].items():
                    assert torch.equal(owner.owned_state()[index][name], value)
            built |= expected
    assert built == set(plain)


def assert_owns_its_partition(shards: list[Sharded], plain: dict) -> None:
    owners = shards[0].owners(len(shards))
    for rank, shard in enumerate(shards):
        owned = shard.owned_state()
        assert set(owned) == {index for index in plain if owners[index] == rank}
        for index, entry in owned.items():
            for name, value in plain[index].items():
                assert torch.equal(entry[name], value), (rank, index, name)


@SETTINGS
@given(st.lists(st.integers(1, 12), min_size=2, max_size=5), st.integers(1, 3),
       st.integers(1, 4), st.integers(1, 2), st.data())
def test_a_join_then_a_leave_hand_every_entry_owner_to_owner(
        widths: list[int], steps: int, old: int, joining: int, data: st.DataObject) -> None:
    """Whatever the world sizes, a join and a leave handed over owner to owner leave each
    member owning exactly its new partition, bitwise as the plain optimizer holds it."""
    model, optimizer, _ = trained(widths, steps)
    plain = optimizer.state_dict()["state"]
    world = old + joining
    shards = members(model, optimizer.state_dict(), old)
    for shard in shards:
        shard.hold()
    replicated = shards[0].state_dict()
    for _ in range(joining):
        joiner = Sharded(sharded_optimizer(copy.deepcopy(model).parameters(),
                                           torch.optim.AdamW, lr=0.01))
        joiner.load_state_dict(copy.deepcopy(replicated))
        shards.append(joiner)

    def join(rank: int, group: dist.ProcessGroup) -> None:
        holders = shards[rank].agree(group, lambda w: w.wait(), rank, world, steps)
        assert holders is not None
        shards[rank].take_over(group, lambda w: w.wait(), rank, world, holders)
        shards[rank].repartition(rank, world)

    in_group(world, join)
    assert_owns_its_partition(shards, plain)
    staying = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1,
                                       max_size=world - 1)))  # some leave, some stay
    in_group(world, lambda rank, group: shards[rank].hand_to(
        group, lambda w: w.wait(), staying, len(staying)))
    left = [shards[rank] for rank in staying]

    def switch(rank: int, group: dist.ProcessGroup) -> None:
        holders = left[rank].agree(group, lambda w: w.wait(), rank, len(left), steps)
        assert holders is not None
        assert left[rank].take_over(group, lambda w: w.wait(), rank, len(left), holders) == 0
        left[rank].repartition(rank, len(left))

    in_group(len(left), switch)
    assert_owns_its_partition(left, plain)

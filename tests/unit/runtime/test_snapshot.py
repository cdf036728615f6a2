"""Snapshot buffers and the restore from them: the format, the share split, the plan, and
a restore over a real gloo group that skips a damaged copy for the next older step."""

from __future__ import annotations

import concurrent.futures
import datetime
import mmap
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.flat_state import copy_range, flat_state, load_flat
from phalanx.runtime.snapshot import (
    Held,
    held_in,
    in_every_column,
    plan_restore,
    restore,
    write_share,
)
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import HEADER_BYTES, Header, SnapshotFileError
from phalanx.services.ports import free_port


def trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return model, optimizer, scheduler


def buffer_file(path: Path, size: int) -> mmap.mmap:
    path.write_bytes(b"\0" * size)
    return snapshot_file.open_buffer(path)


def snapshot_into(path: Path, model, optimizer, scheduler, step: int, shard: int,
                  shards: int, column: tuple[int, int] = (0, 1)) -> Header:
    state = flat_state(model, optimizer, {"scheduler": scheduler}, step)
    meta = pickle.dumps(state.meta)
    buffer = buffer_file(path, HEADER_BYTES + len(meta) + state.total)
    header = write_share(memoryview(buffer), state, meta, "job-a", step, 1, shard, shards,
                         column=column)
    buffer.close()
    return header


def same_state(a, b) -> None:
    for x, y in zip(a[0].state_dict().values(), b[0].state_dict().values(), strict=True):
        assert torch.equal(x, y)
    sa, sb = a[1].state_dict(), b[1].state_dict()
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)
    assert a[2].state_dict() == b[2].state_dict()


def test_shares_tile_the_state_exactly() -> None:
    for total in (0, 1, 7, 1000):
        for shards in (1, 3, 4):
            parts = [snapshot_file.share(total, r, shards) for r in range(shards)]
            assert sum(length for _, length in parts) == total
            assert all(parts[i][0] + parts[i][1] == parts[i + 1][0] for i in range(shards - 1))
            assert all(offset % snapshot_file.ALIGN == 0 for offset, _ in parts)


def test_the_shares_of_every_rank_rebuild_model_optimizer_scheduler_and_rng(tmp_path) -> None:
    source = trained(0, 5)
    target = trained(1, 0)
    rng = torch.get_rng_state()
    parts = []
    for shard in range(3):
        header = snapshot_into(tmp_path / f"s{shard}", *source, 5, shard, 3)
        data = (tmp_path / f"s{shard}").read_bytes()
        parts.append(data[HEADER_BYTES + header.meta_length:header.nbytes])
        meta = pickle.loads(data[HEADER_BYTES:HEADER_BYTES + header.meta_length])
    torch.manual_seed(99)
    load_flat(torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8), meta,
              target[0], target[1], {"scheduler": target[2]})
    same_state(source, target)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_snapshot_holding_the_rng_as_a_tensor_still_loads() -> None:
    source, target = trained(0, 3), trained(1, 0)
    state = flat_state(*source[:2], {"scheduler": source[2]}, 3)
    meta = dict(state.meta, rng=torch.get_rng_state())  # as written before 2026-11-23
    flat = torch.zeros(state.total, dtype=torch.uint8)
    copy_range(state, 0, flat)
    torch.manual_seed(99)
    load_flat(flat, meta, target[0], target[1], {"scheduler": target[2]})
    same_state(source, target)
    assert torch.equal(torch.get_rng_state(), meta["rng"])


def test_a_buffer_is_trusted_only_when_committed_and_intact(tmp_path) -> None:
    model, optimizer, scheduler = trained(0, 2)
    path = tmp_path / "b"
    header = snapshot_into(path, model, optimizer, scheduler, 2, 0, 1)
    data = bytearray(path.read_bytes())
    assert snapshot_file.read_header(data) == header
    snapshot_file.verify(memoryview(data), header)
    flipped = bytearray(data)
    flipped[header.nbytes - 3] ^= 0xFF  # one byte of the shard
    with pytest.raises(SnapshotFileError, match="checksum mismatch"):
        snapshot_file.verify(memoryview(flipped), header)
    torn = bytearray(data)
    torn[:HEADER_BYTES] = header.pack(1).ljust(HEADER_BYTES, b"\0")  # marked writing
    with pytest.raises(SnapshotFileError, match="not committed"):
        snapshot_file.read_header(torn)
    damaged = bytearray(data)
    damaged[20] ^= 0x01  # inside the header: a write of it cut short
    with pytest.raises(SnapshotFileError, match="CRC"):
        snapshot_file.read_header(damaged)
    with pytest.raises(SnapshotFileError, match="never written"):
        snapshot_file.read_header(bytes(HEADER_BYTES))


def test_a_ring_never_overwrites_its_newest_commit() -> None:
    def at(step: int) -> Header:
        return Header("j", step, 0, 0, 1, 0, 0, 0, 0, 0)

    assert snapshot_file.pick_buffer([at(4), None]) == 1
    assert snapshot_file.pick_buffer([at(4), at(5)]) == 0
    assert snapshot_file.pick_buffer([at(7), at(6), at(8)]) == 1


def test_the_plan_takes_the_newest_step_whose_every_shard_a_member_holds() -> None:
    held = [[Held(10, 0, 2, 100), Held(9, 0, 2, 100), Held(12, 0, 3, 100)],
            [Held(10, 1, 2, 100), Held(9, 1, 2, 100)],
            [Held(9, 1, 2, 100)]]
    plan = plan_restore(held, newer_than=0)
    assert [(c.step, c.shards) for c in plan] == [(10, 2), (9, 2)]  # 12 misses two shards
    assert plan[1].holders == ((0,), (1, 2))
    assert plan_restore(held, newer_than=10) == []  # the members hold 10 already


def test_shards_of_one_step_from_two_generations_are_never_mixed() -> None:
    """Split brain: ranks cut off from the bus went on in generation 1 and committed step
    20 there; the job's generation 2 committed its own step 20. Generation 2's comes
    first; a step whose shards only add up across the two is no candidate."""
    held = [[Held(20, 0, 2, 100, 1), Held(20, 0, 2, 100, 2), Held(21, 0, 2, 100, 1)],
            [Held(20, 1, 2, 100, 1), Held(20, 1, 2, 100, 2), Held(21, 1, 2, 100, 2)]]
    plan = plan_restore(held, newer_than=0)
    assert [(c.step, c.generation) for c in plan] == [(20, 2), (20, 1)]  # 21 is mixed


def gloo_group(port: int, rank: int, world: int) -> dist.ProcessGroup:
    """Member ``rank`` of a ``world``-member gloo group rendezvousing on ``port``."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=10))
    return dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=10))


@pytest.fixture
def group() -> dist.ProcessGroup:
    return gloo_group(free_port(), 0, 1)


def test_a_damaged_copy_is_skipped_reported_and_the_older_step_restored(tmp_path,
                                                                        group) -> None:
    store = tmp_path / "store"
    store.mkdir()
    older = trained(0, 3)
    snapshot_into(store / "w1-s0.0", *older, 3, 0, 1)
    newer = trained(0, 4)
    replica = store / "buddy.n1.w1-s0.1"  # a buddy's replica, on this member's node
    header = snapshot_into(replica, *newer, 4, 0, 1)
    with open(replica, "r+b") as f:  # bytes flipped in memory after the commit
        f.seek(header.nbytes - 10)
        byte = f.read(1)
        f.seek(header.nbytes - 10)
        f.write(bytes([byte[0] ^ 0x5A]))
    target = trained(7, 0)
    reported = []
    restored = restore(group, lambda work: work.wait(), 0, 1, store, "job-a", 0, target[0],
                       target[1], {"scheduler": target[2]},
                       lambda h, problem, replica: reported.append((h.step, h.shard, problem,
                                                                   replica)))
    assert restored is not None and restored.step == 3 and restored.from_replicas == 0
    assert reported == [(4, 0, "checksum mismatch: shard 0 of step 4 is damaged", True)]
    assert restored.corrupt and "buddy.n1.w1-s0.1" in restored.corrupt[0]
    same_state(older, target)
    assert restore(group, lambda work: work.wait(), 0, 1, store, "job-a", 4, *target[:2],
                   {"scheduler": target[2]}, lambda h, p, r: None) is None
    # A step held only as a replica is restored like the node's own.
    (store / "w1-s0.0").unlink()
    snapshot_into(replica, *newer, 4, 0, 1)
    restored = restore(group, lambda work: work.wait(), 0, 1, store, "job-a", 0, target[0],
                       target[1], {"scheduler": target[2]}, lambda h, p, r: None)
    assert restored is not None and restored.step == 4 and restored.corrupt == []
    assert restored.from_replicas == 1
    same_state(newer, target)


def test_members_read_the_shards_their_nodes_hold_and_receive_the_rest(tmp_path) -> None:
    """Two members: the first's node holds shard 0 and a buddy's replica of shard 1, the
    second's only shard 1. Shard 0 travels from the first; shard 1 each reads where it is."""
    source = trained(0, 4)
    stores = [tmp_path / "n0", tmp_path / "n1"]
    for store in stores:
        store.mkdir()
    snapshot_into(stores[0] / "w0-s0.0", *source, 4, 0, 2)
    snapshot_into(stores[0] / "buddy.n1.w1-s1.0", *source, 4, 1, 2)
    snapshot_into(stores[1] / "w1-s1.0", *source, 4, 1, 2)
    port = free_port()
    targets = [trained(7, 0), trained(8, 0)]
    restored: list[object] = [None, None]

    def member(rank: int) -> None:
        target = targets[rank]
        restored[rank] = restore(gloo_group(port, rank, 2), lambda work: work.wait(), rank, 2,
                                 stores[rank], "job-a", 0, target[0], target[1],
                                 {"scheduler": target[2]}, lambda h, p, r: None)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(member, rank) for rank in (0, 1)]:
            done.result(timeout=30)
    assert [(r.step, r.from_replicas) for r in restored] == [(4, 1), (4, 0)]
    for target in targets:
        same_state(source, target)


def test_a_group_restores_only_steps_every_column_holds() -> None:
    assert in_every_column([[(4, 1), (3, 1)], [(3, 1), (2, 1)]]) == {(3, 1)}
    assert in_every_column([[(4, 2)], [(4, 1)]]) == set()  # one step, two generations
    assert in_every_column([]) == set()


def test_a_group_rank_restores_its_own_columns_shard_at_a_step_every_column_holds(
        tmp_path, group) -> None:
    """Column 0 of a group of 2, one member: its node holds column 0's steps 3 and 4 and
    column 1's step 4 (another rank's shard: never read here). The group's other rank
    (played by ``agree``) holds column 1's step 3 only: both restore step 3."""
    store = tmp_path / "store"
    store.mkdir()
    older, newer, other = trained(0, 3), trained(0, 4), trained(5, 4)
    snapshot_into(store / "w1-s0.0", *older, 3, 0, 1, column=(0, 2))
    snapshot_into(store / "w1-s0.1", *newer, 4, 0, 1, column=(0, 2))
    snapshot_into(store / "w1-s0-c1.0", *other, 4, 0, 1, column=(1, 2))
    assert [h.step for h in held_in(store, "job-a", (1, 2))] == [4]
    assert held_in(store, "job-a") == []  # no column of a job of one rank per replica
    asked: list[torch.Tensor] = []

    def agree(values: torch.Tensor) -> torch.Tensor:
        asked.append(values.clone())
        if values.dim() == 3:  # the columns' candidates: column 1 holds step 3
            values = values.clone()
            values[1, 0] = torch.tensor([1.0, 3.0, 1.0])
        return values  # the readable flag: column 1 reads its step

    target = trained(7, 0)
    restored = restore(group, lambda work: work.wait(), 0, 1, store, "job-a", 0, target[0],
                       target[1], {"scheduler": target[2]}, lambda h, p, r: None,
                       column=(0, 2), agree=agree)
    assert restored is not None and restored.step == 3
    same_state(older, target)
    assert [tuple(a.shape) for a in asked] == [(2, 64, 3), (1,)]

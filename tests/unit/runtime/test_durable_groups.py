"""The durable tier for replica groups, on a one-rank gloo group in this process: a group
rank's shares written as boxes of the global tensors, a step committed only once every
column's shares are, loaded back exactly (into a sharded model, or whole), and a step that
does not fit the model refused by name with nothing loaded."""

from __future__ import annotations

import pickle
from pathlib import Path

import fsspec
import pytest
import torch
from test_replica_group import model, sharded  # the same model, sharded the same way
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata as Stored

from phalanx.runtime import durable
from phalanx.runtime.durable.layout import global_meta, shard_boxes
from phalanx.runtime.durable.resharding import DurableLayoutError, problems
from phalanx.runtime.flat_state import flat_state
from phalanx.runtime.replica_group import local
from phalanx.runtime.snapshot import write_share
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import HEADER_BYTES

pytestmark = pytest.mark.usefixtures("no_default_group")


def test_a_columns_shares_are_boxes_of_the_global_tensors_its_replicated_ones_column_0s(
        ) -> None:
    # Column 1 of 2 holds rows 2..3 of a 4 x 8 DTensor and a step count held by every rank.
    meta = {"tensors": [((2, 8), "torch.float32"), ((), "torch.float32")],
            "offsets": [0, 64], "total": 68, "global": [((4, 8), (2, 0)), None]}
    assert shard_boxes(meta, 0, 1, column=1) == [(0, ((2, 0), (2, 8), 0))]
    assert [box for _, box in shard_boxes(meta, 0, 1, column=0)] == [
        ((2, 0), (2, 8), 0), ((), (), 0)]
    # Two shares of the column: the rows split, still placed in the global tensor.
    assert shard_boxes(meta, 1, 2, column=1) == [(0, ((3, 0), (1, 8), 8))]
    assert global_meta(meta)["tensors"] == [((4, 8), "torch.float32"), ((), "torch.float32")]


def trained_group() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = sharded(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    for _ in range(2):
        net(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer


def persist(root: Path, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
            shards: list[int], columns: int = 1) -> list[durable.Persisted]:
    """Column 0's ``shards`` of 2 of the state at step 7, in a job of ``columns`` columns."""
    state = flat_state(net, optimizer, {}, 7)
    meta = pickle.dumps(state.meta)
    done = []
    for shard in shards:
        buffer = bytearray(HEADER_BYTES + len(meta) + state.total)
        header = write_share(memoryview(buffer), state, meta, "job-g", 7, 1, shard, 2,
                             column=(0, columns))
        meta_view, data = snapshot_file.verify(memoryview(buffer), header)
        done.append(durable.write_shard(fsspec.filesystem("file"), str(root), header,
                                        bytes(meta_view), data, 2))
    return done


def test_a_group_step_commits_only_with_every_columns_shares(tmp_path: Path) -> None:
    net, optimizer = trained_group()
    done = persist(tmp_path, net, optimizer, [0, 1], columns=2)
    assert [d.committed for d in done] == [None, None]  # column 1's shares are missing
    assert durable.committed_steps(fsspec.filesystem("file"), f"{tmp_path}/job-g") == []


def test_a_group_step_loads_back_sharded_and_whole(tmp_path: Path) -> None:
    net, optimizer = trained_group()
    assert persist(tmp_path, net, optimizer, [1, 0])[-1].committed is not None
    fs = fsspec.filesystem("file")
    [step] = durable.committed_steps(fs, f"{tmp_path}/job-g")
    record = durable.verify(fs, step)
    torch.manual_seed(5)
    other = sharded(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 1)))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.01)  # no state yet
    durable.load(fs, step, record, other, other_optimizer, {})
    for mine, theirs in zip(other.state_dict().values(), net.state_dict().values(),
                            strict=True):
        assert torch.equal(local(mine), local(theirs))
    for index, entry in optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            assert torch.equal(local(other_optimizer.state_dict()["state"][index][name]),
                               local(value)), (index, name)
    whole = model()  # a model held whole loads the global tensors
    whole_optimizer = torch.optim.AdamW(whole.parameters(), lr=0.01)
    durable.load(fs, step, record, whole, whole_optimizer, {})
    for mine, theirs in zip(whole.state_dict().values(), net.state_dict().values(),
                            strict=True):
        assert torch.equal(mine, theirs.full_tensor())


def test_a_step_that_does_not_fit_is_refused_by_name_and_nothing_loaded(
        tmp_path: Path) -> None:
    net, optimizer = trained_group()
    persist(tmp_path, net, optimizer, [0, 1])
    fs = fsspec.filesystem("file")
    [step] = durable.committed_steps(fs, f"{tmp_path}/job-g")
    record = durable.verify(fs, step)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    wider = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    fully_shard(wider, mesh=init_device_mesh("cpu", (1,)))
    before = [local(t).clone() for t in wider.state_dict().values()]
    with pytest.raises(DurableLayoutError, match=r"model tensor 0.weight: the step has "
                                                 r"torch.float32\[8, 4\]"):
        durable.load(fs, step, record, wider, torch.optim.AdamW(wider.parameters()), {})
    assert all(torch.equal(local(t), b) for t, b in zip(wider.state_dict().values(), before,
                                                          strict=True))
    # Sharded over a mesh of other dimensions (a tensor-parallel group's, say).
    other = model()
    fully_shard(other, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    with pytest.raises(DurableLayoutError, match="cannot be resharded"):
        durable.load(fs, step, record, other, torch.optim.AdamW(other.parameters()), {})
    with pytest.raises(DurableLayoutError, match=r"carries \[\]; this rank registers"):
        durable.load(fs, step, record, other, torch.optim.AdamW(other.parameters()),
                     {"ema": torch.optim.AdamW(other.parameters())})


def test_a_tensor_the_step_does_not_hold_whole_is_named() -> None:
    def stored(*chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> Stored:
        return Stored(TensorProperties(dtype=torch.float32), torch.Size((4, 2)),
                      [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])

    wanted = {"model.w": torch.empty(4, 2), "model.b": torch.empty(3)}
    assert problems({"model.w": stored(((0, 0), (2, 2)), ((2, 0), (2, 2))),
                     "model.b": Stored(TensorProperties(), torch.Size((3,)),
                                       [ChunkStorageMetadata(torch.Size((0,)),
                                                             torch.Size((3,)))])},
                    wanted) == []
    assert problems({"model.w": stored(((0, 0), (2, 2)))}, wanted) == [
        "model.w: the step's chunks hold 4 of its 8 elements (incomplete)",
        "model.b: not in the step"]


def test_a_group_steps_files_are_announced_and_reported_by_column_and_shard() -> None:
    record = durable.CommitRecord("job-g", 20, 1, 2, 100, {
        f"__{i}_0.distcp": (10 + i, f"{i:016x}") for i in range(4)}, b"", columns=2)
    announced = durable.committed_records(record, "/ckpt/job-g/step", "node-a", 0.0)
    assert [(r.column, r.shard, r.num_shards, r.columns, r.nbytes) for r in announced] == [
        (0, 0, 2, 2, 10), (0, 1, 2, 2, 11), (1, 0, 2, 2, 12), (1, 1, 2, 2, 13)]
    step = durable.Committed("/ckpt/job-g/step-0000000020-g1-w2-c2", 20, 1, 2, 2)
    damaged = durable.DurableCorrupt("__3_0.distcp: checksum mismatch", 3, "3" * 16)
    [copy] = durable.corrupt_records(step, damaged, "/ckpt", "node-a", 0.0)
    assert (copy.column, copy.shard, copy.corrupt, copy.checksum) == (1, 1, True, "3" * 16)
    whole = durable.corrupt_records(step, durable.DurableCorrupt("no record"), "/ckpt",
                                    "node-a", 0.0)
    assert [(c.column, c.shard) for c in whole] == [(0, 0), (0, 1), (1, 0), (1, 1)]

"""The durable tier: shares written as DCP chunks, committed only when every shard is, a
plain ``torch.distributed.checkpoint`` load with no phalanx code, a flipped byte on disk
refused, retention, and the same on S3 (s3fs against moto's server, started here)."""

from __future__ import annotations

import copy
import math
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from test_snapshot import same_state, trained  # the same model and comparison

from phalanx.runtime import durable
from phalanx.runtime.flat_state import flat_state
from phalanx.runtime.sharded import Sharded, sharded_optimizer
from phalanx.runtime.snapshot import write_share
from phalanx.schemas import snapshot_file
from phalanx.schemas.snapshot_file import HEADER_BYTES
from phalanx.services.ports import free_port


def test_boxes_tile_an_element_range_with_contiguous_chunks() -> None:
    for shape in [(), (7,), (3, 4), (2, 3, 5), (4, 1, 6), (0, 3)]:
        numel = math.prod(shape)
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                seen = []
                for offsets, sizes, first in durable.boxes(shape, start, end):
                    assert len(offsets) == len(sizes) == len(shape)
                    index = torch.arange(numel).reshape(shape)
                    chunk = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes,
                                                                        strict=True))]
                    assert chunk.reshape(-1).tolist() == list(range(first,
                                                                    first + chunk.numel()))
                    seen.extend(chunk.reshape(-1).tolist())
                assert seen == list(range(start, end)), (shape, start, end)


def persist(fs, root: str, source, step: int, shards: int, keep: int = 2,
            order: list[int] | None = None) -> list[durable.Persisted]:
    """Write every shard of ``source``'s state at ``step`` (in ``order``)."""
    state = flat_state(source[0], source[1], {"scheduler": source[2]}, step)
    meta = pickle.dumps(state.meta)
    done = []
    for shard in order or range(shards):
        buffer = bytearray(HEADER_BYTES + len(meta) + state.total)
        header = write_share(memoryview(buffer), state, meta, "job-a", step, 3, shard, shards)
        meta_view, data = snapshot_file.verify(memoryview(buffer), header)
        done.append(durable.write_shard(fs, root, header, bytes(meta_view), data, keep))
    return done


PLAIN_LOAD = """
import sys
import torch
import torch.distributed.checkpoint as dcp

torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(4, 8)).sum().backward()
optimizer.step()  # the optimizer's state exists, to be overwritten
state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
dcp.load(state, checkpoint_id=sys.argv[1])
optimizer.load_state_dict(state["optimizer"])
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, sys.argv[2])
assert not [m for m in sys.modules if m == "phalanx" or m.startswith("phalanx.")]
"""


def test_a_step_commits_with_its_last_shard_and_loads_with_plain_dcp(tmp_path) -> None:
    source = trained(0, 5)
    fs = fsspec.filesystem("file")
    done = persist(fs, str(tmp_path), source, 5, 3, order=[2, 0, 1])
    assert [d.committed is not None for d in done] == [False, False, True]
    [step] = durable.committed_steps(fs, f"{tmp_path}/job-a")
    assert (step.step, step.generation, step.shards) == (5, 3, 3)
    out = tmp_path / "plain.pt"
    subprocess.run([sys.executable, "-c", textwrap.dedent(PLAIN_LOAD), step.directory,
                    str(out)], check=True, cwd=tmp_path, timeout=120)
    loaded = torch.load(out)
    for name, value in source[0].state_dict().items():
        assert torch.equal(loaded["model"][name], value)
    for key, values in source[1].state_dict()["state"].items():
        for name, value in values.items():
            assert torch.equal(loaded["optimizer"]["state"][key][name], value)


def test_the_writer_thread_persists_snapshot_buffer_files_and_reports_the_commit(
        tmp_path) -> None:
    """DurableWriter as the rank uses it: each shard read from its snapshot buffer file,
    written, the buffer let go, and the report of the shard that committed the step."""
    source = trained(0, 5)
    state = flat_state(source[0], source[1], {"scheduler": source[2]}, 5)
    meta = pickle.dumps(state.meta)
    reports: list[durable.Persisted] = []
    writer = durable.DurableWriter(str(tmp_path / "store"), 2, reports.append)
    for shard in range(2):
        path = tmp_path / f"buffer-{shard}"
        path.write_bytes(bytes(HEADER_BYTES + len(meta) + state.total))
        buffer = snapshot_file.open_buffer(path)
        header = write_share(memoryview(buffer), state, meta, "job-a", 5, 3, shard, 2)
        assert writer.submit(path, header)
        assert writer.wait_idle(60) and writer.busy_with is None
        buffer.close()
    writer.close()
    assert [(r.shard, r.committed is not None) for r in reports] == [(0, False), (1, True)]
    record = reports[1].committed
    assert (record.step, record.shards) == (5, 2)
    announced = durable.committed_records(record, reports[1].location, "node-a", 0.0)
    assert [(a.shard, a.location, a.checksum) for a in announced] == [
        (r, reports[1].directory, record.files[f"__{r}_0.distcp"][1]) for r in range(2)]
    [step] = durable.committed_steps(fsspec.filesystem("file"), f"{tmp_path}/store/job-a")
    assert step.job_id == "job-a"


def test_a_durable_step_restores_exactly_and_a_flipped_byte_is_refused(tmp_path) -> None:
    source, target = trained(0, 4), trained(1, 0)
    fs = fsspec.filesystem("file")
    persist(fs, str(tmp_path), source, 4, 2)
    [step] = durable.committed_steps(fs, f"{tmp_path}/job-a")
    record = durable.verify(fs, step)
    durable.load(fs, step, record, target[0], target[1], {"scheduler": target[2]})
    same_state(source, target)
    data = Path(step.directory) / "__1_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(damaged)
    with pytest.raises(durable.DurableCorrupt, match="__1_0.distcp: checksum mismatch"):
        durable.verify(fs, step)


def test_retention_keeps_the_newest_committed_steps_and_drops_abandoned_attempts(
        tmp_path) -> None:
    source = trained(0, 1)
    fs = fsspec.filesystem("file")
    persist(fs, str(tmp_path), source, 10, 2, keep=2, order=[0])  # never committed
    for step in (20, 30, 40):
        persist(fs, str(tmp_path), source, step, 2, keep=2)
    assert [s.step for s in durable.committed_steps(fs, f"{tmp_path}/job-a")] == [40, 30]
    assert sorted(p.name for p in (tmp_path / "job-a").iterdir()) == [
        "step-0000000030-g3-w2", "step-0000000040-g3-w2"]



@pytest.fixture
def s3() -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port, and the storage options that reach it."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        for line in server.stdout:  # its "Running on" line: it listens
            if "Running on" in line:
                break
        else:
            pytest.fail(f"moto's server exited with {server.wait()}")
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "test",
                   "secret": "test", "client_kwargs": {"region_name": "eu-west-1"}}
        fsspec.filesystem("s3", **options).mkdir("ckpt")
        yield options
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_durable_tier_on_s3(s3: dict[str, str], tmp_path) -> None:
    source, target = trained(0, 3), trained(1, 0)
    fs = fsspec.filesystem("s3", **s3)
    done = persist(fs, "ckpt/runs", source, 3, 2)
    assert done[-1].committed is not None
    [step] = durable.committed_steps(fs, "ckpt/runs/job-a")
    durable.load(fs, step, durable.verify(fs, step), target[0], target[1],
                 {"scheduler": target[2]})
    same_state(source, target)
    name = f"{step.directory}/__0_0.distcp"
    damaged = bytearray(fs.cat_file(name))
    damaged[-1] ^= 0x01
    fs.pipe_file(name, bytes(damaged))
    with pytest.raises(durable.DurableCorrupt, match="checksum mismatch"):
        durable.verify(fs, step)


def owners_of(source, shards: int) -> list[tuple[torch.nn.Module, Sharded]]:
    """``source``'s state (model, AdamW) held as a sharded optimizer by ``shards`` members:
    the consolidated state loaded and re-partitioned, each keeping its owner's entries."""
    members = []
    for rank in range(shards):
        model = copy.deepcopy(source[0])
        sharded = Sharded(sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2))
        sharded.load_state_dict(copy.deepcopy(source[1].state_dict()))
        sharded.repartition(rank, shards)
        members.append((model, sharded))
    return members


def test_a_sharded_optimizers_owners_persist_a_step_plain_dcp_and_any_world_size_load(
        tmp_path) -> None:
    source = trained(0, 5)
    members = owners_of(source, 3)
    assert sorted(len(s.owned_state()) for _, s in members) == [1, 1, 2]
    fs = fsspec.filesystem("file")
    done = []
    for shard in (1, 2, 0):
        model, sharded = members[shard]
        state = flat_state(model, sharded, {"scheduler": source[2]}, 5)
        meta = pickle.dumps(state.meta)
        buffer = bytearray(HEADER_BYTES + len(meta) + state.extent(shard, 3)[1])
        header = write_share(memoryview(buffer), state, meta, "job-a", 5, 3, shard, 3)
        meta_view, data = snapshot_file.verify(memoryview(buffer), header)
        done.append(durable.write_shard(fs, str(tmp_path), header, bytes(meta_view), data, 2))
    assert [d.committed is not None for d in done] == [False, False, True]
    [step] = durable.committed_steps(fs, f"{tmp_path}/job-a")
    out = tmp_path / "plain.pt"
    subprocess.run([sys.executable, "-c", textwrap.dedent(PLAIN_LOAD), step.directory,
                    str(out)], check=True, cwd=tmp_path, timeout=120)
    loaded = torch.load(out)
    expected = source[1].state_dict()
    for name, value in source[0].state_dict().items():
        assert torch.equal(loaded["model"][name], value)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == expected["param_groups"][0]["lr"]
    for key, values in expected["state"].items():
        for name, value in values.items():
            assert torch.equal(loaded["optimizer"]["state"][key][name], value)
    # Restored by the runtime into a sharded optimizer of two members.
    record = durable.verify(fs, step)
    target = trained(1, 0)
    restored = Sharded(sharded_optimizer(target[0].parameters(), torch.optim.AdamW, lr=1e-2))
    scheduler = torch.optim.lr_scheduler.StepLR(restored.zero, 2)
    durable.load(fs, step, record, target[0], restored, {"scheduler": scheduler})
    assert scheduler.state_dict() == source[2].state_dict()
    for key, values in expected["state"].items():
        for name, value in values.items():
            assert torch.equal(restored.state_dict()["state"][key][name], value)
    restored.repartition(1, 2)
    assert set(restored.owned_state()) < set(expected["state"])

"""The environment variables processes share are named in ``schemas/`` alone, and
:class:`RankEnvironment` carries them between the agent and the runtime unchanged.

An AST pass over every module outside ``schemas/`` (and outside ``tests/``) finds each
string constant, f-strings' literal parts included, that holds ``PHALANX_``; docstrings
(of modules, classes, functions and attributes) are prose for humans and may name a
variable. Anything else that spells one is a second
copy of a contract that lives in :mod:`phalanx.schemas.environment` or
:mod:`phalanx.schemas.settings`.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from phalanx.schemas.environment import (
    CHAOS_KILL,
    MICRO_BATCH_SIZE,
    NICE_WHEN_READY,
    RANK,
    SNAPSHOT_DIR,
    CheckpointEnvironment,
    RankEnvironment,
)
from phalanx.schemas.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
#: The folders scanned; ``schemas`` is where the names live.
FOLDERS = ("schemas", "bus", "runtime", "services", "bench", "examples")
NAME_PREFIX = "PHALANX" + "_"  # kept apart: this file is no exception to the rule


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of ``tree``'s docstrings: a string that is a statement of its own (a
    module's, class's or function's first, or an attribute's after it), which no code
    reads."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def literals(root: Path) -> list[str]:
    """``file:line`` of every string constant outside ``schemas/`` that names a variable."""
    found = []
    for folder in FOLDERS:
        if folder == "schemas":
            continue
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            lines = sorted({(node.lineno, node.value) for node in ast.walk(tree)
                            if isinstance(node, ast.Constant) and isinstance(node.value, str)
                            and id(node) not in skip and NAME_PREFIX in node.value})
            found += [f"{path.relative_to(root)}:{line}: {value!r}" for line, value in lines]
    return found


def test_no_variable_is_named_outside_schemas() -> None:
    found = literals(ROOT)
    assert not found, ("name these variables in phalanx.schemas.environment or "
                       "phalanx.schemas.settings:\n" + "\n".join(found))


def test_a_literal_added_is_reported(tmp_path: Path) -> None:
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / "runtime" / "added.py"
    module.write_text(f'"""Docstrings may say {NAME_PREFIX}JOB_ID."""\n\n'
                      f'def f(rank: int) -> str:\n'
                      f'    """Nor is {NAME_PREFIX}RANK here a use."""\n'
                      f'    return f"{NAME_PREFIX}RANK={{rank}}"\n\n'
                      f'JOB = "{NAME_PREFIX}JOB_ID"\n')
    assert literals(tmp_path) == [f"runtime/added.py:5: '{NAME_PREFIX}RANK='",
                                  f"runtime/added.py:7: '{NAME_PREFIX}JOB_ID'"]


EVERYTHING = RankEnvironment(
    nats_url="nats://n:4222", job_id="j", node_id="n1", backend="gloo", hang_timeout_s=30.0,
    advertise_host="10.0.0.2",
    checkpoint=CheckpointEnvironment(snapshot_dir="/dev/shm/j", memory_every="auto",
                                     memory_keep=3, memory_overhead=0.05,
                                     memory_max_every=50, durable_every=20, durable_keep=4,
                                     durable_url="s3://b/ckpt", resume_from="old"),
    rank=2, replica_id="r2-1", world_size=4, admission=3, nice_when_ready=-1,
    record_dir="/tmp/rec", deterministic=True, checksum=True, micro_batch_size=8,
    chaos_kill="r1-0:5:allreduce", chaos_hold="r1-0:/tmp/h", chaos_pace="0.1:/tmp/p")


@pytest.mark.parametrize("rank", [
    EVERYTHING, RankEnvironment(),
    RankEnvironment(rank=0, replica_id="r0-0", world_size=1, admission=0),
    RankEnvironment(checkpoint=CheckpointEnvironment(snapshot_dir="/s", memory_every=5)),
])
def test_what_the_agent_writes_the_runtime_reads(rank: RankEnvironment) -> None:
    assert RankEnvironment.from_env(rank.to_env()) == rank


def test_only_the_fields_set_are_written_and_a_job_part_and_a_replica_part_merge() -> None:
    assert RankEnvironment().to_env() == {}
    job = RankEnvironment(nats_url="nats://n:4222", job_id="j", node_id="n1")
    replica = RankEnvironment(rank=1, replica_id="r1-0", nice_when_ready=0)
    assert replica.to_env() == {RANK: "1", "PHALANX_REPLICA_ID": "r1-0", NICE_WHEN_READY: "0"}
    merged = RankEnvironment.from_env({**job.to_env(), **replica.to_env()})
    assert (merged.job_id, merged.slot, merged.replica) == ("j", 1, "r1-0")


def test_unset_and_empty_read_as_defaults() -> None:
    rank = RankEnvironment.from_env({"PHALANX_RANK": "", "PHALANX_JOB_ID": ""})
    assert rank == RankEnvironment() and (rank.slot, rank.replica) == (0, "r0-0")
    assert RankEnvironment.from_env({RANK: "3"}).replica == "r3-0"
    # The checkpoint policy is read only with a snapshot dir, and defaults as the spec's.
    assert RankEnvironment.from_env({"PHALANX_CHECKPOINT_MEMORY_KEEP": "x"}).checkpoint is None
    assert CheckpointEnvironment.from_env({SNAPSHOT_DIR: "/s"}) == CheckpointEnvironment(
        snapshot_dir="/s")


@pytest.mark.parametrize(("var", "value"), [
    (RANK, "x"), (RANK, "-1"), ("PHALANX_WORLD_SIZE", "0"), ("PHALANX_ADMISSION", "1.5"),
    ("PHALANX_HANG_TIMEOUT_S", "soon"), ("PHALANX_HANG_TIMEOUT_S", "inf"),
    (NICE_WHEN_READY, "low"), ("PHALANX_DETERMINISTIC", "yes"),
    ("PHALANX_STATE_CHECKSUM", "true"), (MICRO_BATCH_SIZE, "0"), (MICRO_BATCH_SIZE, "-2"),
    ("PHALANX_CHECKPOINT_MEMORY_EVERY", "often"), ("PHALANX_CHECKPOINT_MEMORY_KEEP", "0"),
    ("PHALANX_CHECKPOINT_MEMORY_OVERHEAD", "2%"), ("PHALANX_CHECKPOINT_DURABLE_KEEP", "x"),
])
def test_a_malformed_value_is_refused_naming_the_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{var}: {value!r} is not"):
        RankEnvironment.from_env({SNAPSHOT_DIR: "/s", var: value})


def test_fault_injection_stays_text_for_the_runtime_to_parse() -> None:
    assert RankEnvironment.from_env({CHAOS_KILL: "anything"}).chaos_kill == "anything"

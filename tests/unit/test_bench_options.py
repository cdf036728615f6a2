"""The options one benchmark hands another: bench/snapshot.py runs bench/tiers.py's
phases, and both prepare their workload through bench/recovery.py. A benchmark that
dies after minutes of measuring on an option another never set (issue 28: snapshot.py's
tiers phase on ``sharded_optimizer``) is caught here in a second."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from phalanx.bench import recovery, snapshot, tiers

SMALL = ["--widths", "4,8,4", "--samples", "128"]


def test_tiers_prepares_its_workload_from_its_own_options(tmp_path: Path) -> None:
    args = tiers.arguments().parse_args([*SMALL, "--data-dir", str(tmp_path)])
    workload = recovery.prepare_workload(args)
    assert workload.name == "w"
    assert "--sharded-optimizer" not in workload.options
    assert workload.order.dataset_size == 128


def test_snapshot_hands_tiers_every_option_its_phases_read(tmp_path: Path) -> None:
    args = snapshot.arguments().parse_args([*SMALL, "--steps", "30", "--data-dir",
                                            str(tmp_path)])
    phases = snapshot.tier_phases(args)
    missing = set(vars(tiers.arguments().parse_args([]))) - set(vars(phases))
    assert not missing, f"tiers' options snapshot.py does not set: {sorted(missing)}"
    assert (phases.steps, phases.samples, phases.data_dir) == (30, 128, tmp_path)
    assert recovery.prepare_workload(phases).order.dataset_size == 128


def test_the_sharded_optimizer_is_an_option_of_recovery_alone(tmp_path: Path) -> None:
    args = tiers.arguments().parse_args([*SMALL, "--data-dir", str(tmp_path)])
    sharded = recovery.prepare_workload(args, sharded_optimizer=True)
    assert "--sharded-optimizer" in sharded.options


def test_hsdp_runs_groups_of_two_for_whole_epochs(tmp_path: Path) -> None:
    args = argparse.Namespace(workload="hsdp", gpt_options="--layers 1 --embd 16 --heads 2 "
                              "--block-size 8 --global-batch 8", data_dir=tmp_path)
    workload = recovery.prepare_workload(args)
    assert (workload.ranks_per_replica, workload.replicas, workload.baseline) == (2, 2, "fsdp2")
    assert workload.order.steps_per_epoch == recovery.HSDP_EPOCH_STEPS
    assert workload.length(3 * recovery.HSDP_EPOCH_STEPS) == ["--epochs", "3"]
    with pytest.raises(ValueError, match="whole epochs"):
        workload.length(recovery.HSDP_EPOCH_STEPS + 1)
    assert workload.worker_options[:2] == ["--workload", "hsdp"]
    assert set(recovery.overhead_arms(workload)) == {"phalanx", "fsdp2"}

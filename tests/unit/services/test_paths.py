"""``phalanx up`` leaves where its cluster is; the commands after it find it without
``--data-dir``, unless told otherwise; ``down`` takes the pointer away."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.bus.errors import BusUnavailable
from phalanx.services.cli import build_parser
from phalanx.services.cli.common import no_cluster_hint, resolve_data_dir
from phalanx.services.paths import (
    default_data_dir,
    forget_cluster,
    remember_cluster,
    remembered_cluster,
    state_dir,
)


@pytest.fixture(autouse=True)
def own_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PHALANX_STATE_DIR", str(tmp_path / "state"))
    for name in ("PHALANX_DATA_DIR", "PHALANX_NATS_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "state"


def data_dir(*argv: str) -> Path:
    return resolve_data_dir(build_parser().parse_args(list(argv)))


def test_the_state_dir_follows_xdg_unless_overridden(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    assert state_dir() == tmp_path / "state" == default_data_dir()
    monkeypatch.delenv("PHALANX_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "phalanx"


def test_commands_after_up_find_its_data_dir_until_down(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster"
    assert data_dir("jobs") == default_data_dir()
    remember_cluster(cluster)
    assert remembered_cluster() == cluster.resolve()
    for argv in (["jobs"], ["job", "x"], ["down"], ["logs", "x"], ["ckpt", "ls", "x"]):
        assert data_dir(*argv) == cluster.resolve(), argv
    # What is named explicitly wins; up itself never follows the pointer.
    assert data_dir("jobs", "--data-dir", str(tmp_path / "other")) == tmp_path / "other"
    assert data_dir("jobs", "--nats", "nats://h:1") == default_data_dir()
    assert data_dir("up") == default_data_dir()
    forget_cluster(tmp_path / "another")  # not the one recorded: kept
    assert remembered_cluster() == cluster.resolve()
    forget_cluster(cluster)
    assert remembered_cluster() is None and data_dir("jobs") == default_data_dir()


def test_the_environment_overrides_the_pointer(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    remember_cluster(tmp_path / "cluster")
    monkeypatch.setenv("PHALANX_NATS_URL", "nats://h:1")
    assert data_dir("jobs") == default_data_dir()
    monkeypatch.delenv("PHALANX_NATS_URL")
    monkeypatch.setenv("PHALANX_DATA_DIR", str(tmp_path / "env"))
    assert data_dir("jobs") == tmp_path / "env"


def test_no_cluster_found_names_the_flags_to_pass(tmp_path: Path) -> None:
    args = build_parser().parse_args(["jobs", "--data-dir", str(tmp_path / "none")])
    hint = no_cluster_hint(args, BusUnavailable("cannot reach NATS"))
    assert f"no local cluster runs from {tmp_path / 'none'}" in hint
    assert "--data-dir DIR" in hint and "--nats URL" in hint
    args = build_parser().parse_args(["jobs", "--nats", "nats://h:1"])
    assert no_cluster_hint(args, BusUnavailable("cannot reach NATS")) == ""


def test_up_detached_runs_the_same_cluster_in_its_child() -> None:
    """The child ``up --detach`` starts gets every option this command was given."""
    from phalanx.services.cli.up import _rebuild_argv

    argv = ["up", "-d", "--agents", "3", "--supervised-agents", "--secure",
            "--heartbeat-interval", "0.2", "--elasticity", "2", "--data-dir", "/tmp/x"]
    given = build_parser().parse_args(argv)
    given.argv = argv
    child = build_parser().parse_args(_rebuild_argv(given))
    assert not child.detach
    assert {**vars(child), "detach": True} == {k: v for k, v in vars(given).items()
                                                if k != "argv"}

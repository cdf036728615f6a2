"""The cluster's replication key: made once, owner-only, read back whole, refused when it
is not one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.agent import replica_tls
from phalanx.services.auth.credentials import rank_environment
from phalanx.services.auth.issuer import AuthDir
from phalanx.services.auth.replication_key import KEY_BYTES, load_key, write_key
from phalanx.services.auth.roles import Role


def test_a_key_is_made_once_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "replication.key"
    write_key(path)
    key = load_key(path)
    assert len(key) == KEY_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    write_key(path)  # kept: agents already running hold it
    assert load_key(path) == key


@pytest.mark.parametrize(("text", "problem"), [
    ("not hex at all", "not hex digits"),
    ("ab" * 16, None),  # 16 bytes: too short
    ("", None),
])
def test_what_is_not_a_key_is_refused_naming_the_file(tmp_path: Path, text: str,
                                                      problem: str | None) -> None:
    path = tmp_path / "replication.key"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem or f"at least {KEY_BYTES} needed") as err:
        load_key(path)
    assert str(path) in str(err.value)


def test_a_missing_key_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_key(tmp_path / "absent.key")


def test_an_auth_directory_points_its_agents_and_never_its_ranks_at_the_key(
        tmp_path: Path) -> None:
    auth = AuthDir.init(tmp_path / "auth", nodes=["n1"])
    agent = auth.env(Role.AGENT, "n1")
    assert load_key(agent["PHALANX_AGENT_REPLICA_KEY_FILE"]) == load_key(
        auth.replication_key_path)
    assert "PHALANX_AGENT_REPLICA_KEY_FILE" not in auth.env(Role.ADMISSION)
    # And at the replication certificate, whose key no rank is pointed at either.
    assert replica_tls.context(agent["PHALANX_AGENT_REPLICA_TLS_DIR"], server=True)
    assert "PHALANX_AGENT_REPLICA_TLS_DIR" not in auth.env(Role.ADMISSION)
    rank = rank_environment(agent, {})
    assert str(auth.replication_key_path) not in rank.values()
    assert str(auth.tls_dir) not in rank.values()

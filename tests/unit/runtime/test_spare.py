"""A warm spare takes the identity its agent writes, or exits when none comes."""

from __future__ import annotations

import io
import json

import pytest

from phalanx.runtime.spare import wait_for_identity
from phalanx.schemas.errors import ConfigError

SPARE_ENV = {"PHALANX_SPARE": "spare-1", "PHALANX_JOB_ID": "j", "RANK": "stale"}


def test_the_identity_replaces_the_spare_marker_in_both_environments() -> None:
    process_env = dict(SPARE_ENV)
    identity = {"PHALANX_REPLICA_ID": "r1-1", "PHALANX_RANK": "1", "RANK": "1"}
    env = wait_for_identity(SPARE_ENV, io.BytesIO(json.dumps(identity).encode() + b"\n"),
                            process_env)
    assert env == process_env == {"PHALANX_JOB_ID": "j", **identity}
    assert SPARE_ENV["PHALANX_SPARE"] == "spare-1"  # the caller's mapping is not changed


def test_no_identity_before_the_input_ends_exits_with_status_0() -> None:
    with pytest.raises(SystemExit) as exited:
        wait_for_identity(SPARE_ENV, io.BytesIO(b""), {})
    assert exited.value.code == 0


@pytest.mark.parametrize(("line", "message"), [
    (b"not json\n", "not JSON"),
    (b'["r1-1"]\n', "object of strings"),
    (b'{"RANK": 1}\n', "object of strings"),
])
def test_a_malformed_identity_is_refused_naming_the_spare(line: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=f"spare spare-1: .*{message}"):
        wait_for_identity(SPARE_ENV, io.BytesIO(line), {})


def test_a_spare_whose_cuda_has_not_started_may_be_told_other_gpus() -> None:
    process_env = {**SPARE_ENV, "CUDA_VISIBLE_DEVICES": "2"}
    identity = {"PHALANX_REPLICA_ID": "r1-1", "CUDA_VISIBLE_DEVICES": "3"}
    env = wait_for_identity(process_env, io.BytesIO(json.dumps(identity).encode() + b"\n"),
                            process_env)
    assert env["CUDA_VISIBLE_DEVICES"] == process_env["CUDA_VISIBLE_DEVICES"] == "3"

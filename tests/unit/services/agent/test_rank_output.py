"""Ranks' log files followed: new lines tee'd with their job and replica, files rotated."""

from __future__ import annotations

import os
from pathlib import Path

from phalanx.services.agent.rank_output import LINE_LIMIT, Followed, RankOutput, lines_of


def append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as log:  # as a rank's stdout is opened
        log.write(data)


def test_lines_are_given_whole_and_an_unfinished_one_waits() -> None:
    followed = Followed()
    assert lines_of(followed, b"step 1\nstep") == [b"step 1"]
    assert lines_of(followed, b" 2 loss 0.5\n\nend") == [b"step 2 loss 0.5", b""]
    assert followed.partial == b"end"
    long = b"x" * (LINE_LIMIT * 2 + 5)
    assert lines_of(followed, long[:LINE_LIMIT]) == [b"end" + b"x" * (LINE_LIMIT - 3)]
    assert lines_of(followed, long[LINE_LIMIT:] + b"\n") == \
        [b"x" * LINE_LIMIT, b"x" * 8]


def test_new_lines_are_teed_with_their_job_and_replica_and_old_ones_are_not(
        tmp_path: Path) -> None:
    teed: list[bytes] = []
    before = tmp_path / "job-a" / "r0-0.log"
    append(before, b"=== phalanx: r0-0 of job-a starting\nwritten before the agent\n")
    output = RankOutput(tmp_path, teed.append, max_bytes=0)
    output.look()
    assert teed == []  # in the file already: not tee'd again by a new agent
    append(before, b"step 1\nhalf")
    group = tmp_path / "job-b" / "r1-0_g1.log"
    append(group, b"=== phalanx: r1-0 of job-b\n")
    output.look()
    assert b"".join(teed) == (b"job-a/r0-0 | step 1\n"
                              b"job-b/r1-0_g1 | === phalanx: r1-0 of job-b\n")
    append(before, b" a line\n")
    output.look()
    assert teed[-1] == b"job-a/r0-0 | half a line\n"


def test_a_file_past_its_limit_is_kept_as_one_and_emptied_and_appends_go_on(
        tmp_path: Path) -> None:
    teed: list[bytes] = []
    log = tmp_path / "job-a" / "r0-0.log"
    output = RankOutput(tmp_path, teed.append, max_bytes=100)
    output.look()  # before the rank started: its file is followed from its top
    log.parent.mkdir(parents=True)
    with log.open("ab") as rank:  # the rank's own descriptor, open throughout
        rank.write(b"a" * 60 + b"\n")
        rank.flush()
        output.look()
        assert log.stat().st_size == 61 and not log.with_name("r0-0.log.1").exists()
        rank.write(b"b" * 60 + b"\n")
        rank.flush()
        output.look()
        assert log.with_name("r0-0.log.1").read_bytes() == b"a" * 60 + b"\n" + b"b" * 60 + b"\n"
        assert log.stat().st_size == 0
        rank.write(b"c\n")  # appended at the new end, not after a hole
        rank.flush()
        output.look()
    assert log.read_bytes() == b"c\n"
    assert b"".join(teed).splitlines() == [b"job-a/r0-0 | " + b"a" * 60,
                                           b"job-a/r0-0 | " + b"b" * 60, b"job-a/r0-0 | c"]


def test_without_a_tee_files_are_still_rotated_and_gone_ones_forgotten(tmp_path: Path) -> None:
    log = tmp_path / "job-a" / "r0-0.log"
    append(log, b"")
    output = RankOutput(tmp_path, None, max_bytes=10)
    output.look()
    append(log, b"0123456789abc\n")
    output.look()
    assert log.stat().st_size == 0 and log.with_name("r0-0.log.1").stat().st_size == 14
    os.remove(log)
    output.look()
    assert output.followed == {}

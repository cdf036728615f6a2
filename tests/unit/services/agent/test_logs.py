"""Replica logs read over the bus. An agent's answer to ``LogRequest``: the job's logs
on its node in slot then incarnation order, and any piece of one from any offset; a log
it does not hold is a 404 naming it. And where ``phalanx logs --tail N`` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.bus.errors import RequestRefused
from phalanx.schemas.messages import LogRequest
from phalanx.services.agent.logs import read_logs, replica_log
from phalanx.services.cli.logs import tail_start


def logs(work_dir: Path, job_id: str, **texts: bytes) -> None:
    for replica, text in texts.items():
        path = replica_log(work_dir, job_id, replica.replace("_", "-"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)


def test_the_listing_is_in_slot_then_incarnation_order(tmp_path: Path) -> None:
    logs(tmp_path, "j", r10_0=b"a", r2_1=b"bb", r2_0=b"", r1_12=b"ccc")
    logs(tmp_path, "other", r0_0=b"not this job's")
    reply = read_logs(tmp_path, "n0", LogRequest(job_id="j"))
    assert reply.node_id == "n0" and not reply.data
    assert [(log.replica_id, log.size) for log in reply.logs] == [
        ("r1-12", 3), ("r2-0", 0), ("r2-1", 2), ("r10-0", 1)]
    assert read_logs(tmp_path, "n0", LogRequest(job_id="none")).logs == []


def test_a_log_is_read_in_pieces_from_any_offset(tmp_path: Path) -> None:
    text = bytes(range(256)) * 40
    logs(tmp_path, "j", r0_0=text)
    got, offset = b"", 0
    while True:
        reply = read_logs(tmp_path, "n0", LogRequest(job_id="j", replica_id="r0-0",
                                                     offset=offset, max_bytes=1000))
        assert reply.size == len(text) and reply.offset == offset
        if not reply.data:
            break
        got, offset = got + reply.data, offset + len(reply.data)
    assert got == text
    # Past its end (a reader ahead of a log that was cut short): nothing, at its end.
    reply = read_logs(tmp_path, "n0", LogRequest(job_id="j", replica_id="r0-0",
                                                 offset=len(text) + 5))
    assert (reply.data, reply.offset) == (b"", len(text))


def test_a_log_not_held_here_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RequestRefused, match="r3-1 of j left no log on n0") as refused:
        read_logs(tmp_path, "n0", LogRequest(job_id="j", replica_id="r3-1"))
    assert refused.value.code == "404"


@pytest.mark.parametrize(("data", "lines", "start"), [
    (b"a\nb\nc\n", 2, 2), (b"a\nb\nc", 2, 2),  # the last line may lack its newline
    # Not enough, or just enough (its first line may have begun before): read further back.
    (b"a\nb\nc\n", 3, None), (b"a\nb\nc\n", 4, None),
    (b"x\na\nb\n", 2, 2), (b"\n\n", 1, 1), (b"a\n", 0, 2), (b"", 1, None),
])
def test_the_tail_starts_after_the_newline_before_the_last_lines(
        data: bytes, lines: int, start: int | None) -> None:
    assert tail_start(data, lines) == start


def test_a_listing_too_long_for_one_reply_keeps_the_newest_incarnations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("phalanx.services.agent.logs.MAX_LISTED_LOGS", 3)
    logs(tmp_path, "j", r0_0=b"", r0_1=b"", r0_2=b"", r1_0=b"", r1_1=b"")
    reply = read_logs(tmp_path, "n0", LogRequest(job_id="j"))
    assert [log.replica_id for log in reply.logs] == ["r0-1", "r0-2", "r1-1"]
    assert reply.unlisted == 2

"""Which open connections the revoker closes, from listings shaped as nats-server's."""

from __future__ import annotations

import json

import pytest

from phalanx.schemas.messages import JobState
from phalanx.services.auth import revocation
from phalanx.services.auth.callout import Refusal
from phalanx.services.auth.revocation import Connection, ConnzError

SERVER = "NA7G2X7E76TIIEFOCVJN22R3CZUTVVTO25XUELV2M2UIDP536M3NU3QU"
STATIC_USER = "UAUUL2LTOPVWDTPTOGHZEND277JIXFYWPQ3SCJ5FWQN6LGKXILITDOLL"


def listing(users: list[str], *, offset: int = 0, total: int | None = None) -> bytes:
    """A server's answer to a connz request (monitor.go's Connz in a ServerAPIResponse)."""
    connections = [{"cid": offset + i + 1, "kind": "Client", "name": "x",
                    **({"authorized_user": user} if user else {})}
                   for i, user in enumerate(users)]
    return json.dumps({"server": {"name": SERVER, "id": SERVER}, "data": {
        "server_id": SERVER, "num_connections": len(users), "offset": offset,
        "total": len(users) if total is None else total, "limit": 1024,
        "connections": connections}}).encode()


def test_a_listing_reads_each_connection_s_job_and_static_identities_have_none() -> None:
    page = revocation.read_page(listing(["rank-job-a", STATIC_USER, "", "rank-", "rank-a.b"]))
    assert [(c.server_id, c.cid, c.job_id) for c in page.connections] == [
        (SERVER, 1, "job-a"), (SERVER, 2, None), (SERVER, 3, None), (SERVER, 4, None),
        (SERVER, 5, None)]
    assert page.next_offset is None


def test_a_server_with_more_connections_than_a_page_is_asked_for_the_next() -> None:
    first = revocation.read_page(listing(["rank-a"] * 3, total=5))
    assert first.next_offset == 3
    last = revocation.read_page(listing(["rank-a"] * 2, offset=3, total=5))
    assert last.next_offset is None
    assert revocation.read_page(listing([], offset=3, total=5)).next_offset is None


@pytest.mark.parametrize(("reply", "said"), [
    (b"not json", "does not read"),
    (json.dumps({"server": {"id": SERVER}, "error": {"code": 400, "description": "bad"}}
                ).encode(), "refused the listing"),
    (json.dumps({"server": {"id": SERVER}}).encode(), "does not read"),
    (json.dumps({"server": {"id": SERVER}, "data": {"connections": [{"cid": "x"}]}}).encode(),
     "does not read"),
])
def test_a_listing_that_does_not_read_says_so(reply: bytes, said: str) -> None:
    with pytest.raises(ConnzError, match=said):
        revocation.read_page(reply)


def test_ended_and_unknown_jobs_connections_are_closed_live_and_unread_ones_kept() -> None:
    def rank(cid: int, job: str) -> Connection:
        return Connection(SERVER, cid, f"rank-{job}")

    connections = [rank(1, "live"), rank(2, "done"), rank(3, "gone"), rank(4, "unread"),
                   Connection(SERVER, 5, STATIC_USER), rank(6, "done")]
    assert revocation.jobs_of(connections) == {"live", "done", "gone", "unread"}
    kicks = revocation.to_close(connections, {"live": JobState.ADMITTED,
                                              "done": JobState.CANCELLED, "gone": None})
    assert [(k.connection.cid, k.job_id, k.refusal, k.message) for k in kicks] == [
        (2, "done", Refusal.ENDED_JOB, "job done is cancelled"),
        (3, "gone", Refusal.UNKNOWN_JOB, "no job gone"),
        (6, "done", Refusal.ENDED_JOB, "job done is cancelled")]


def test_requests_name_the_job_s_ranks_and_kicks_name_the_connection() -> None:
    assert json.loads(revocation.connz_request(offset=7, job_id="job-a")) == {
        "auth": True, "offset": 7, "user": "rank-job-a"}
    assert json.loads(revocation.connz_request()) == {"auth": True, "offset": 0}
    assert revocation.kick_subject(SERVER) == f"$SYS.REQ.SERVER.{SERVER}.KICK"
    assert json.loads(revocation.kick_request(9)) == {"cid": 9}
    assert revocation.kick_error(json.dumps({"server": {"id": SERVER}}).encode()) is None
    assert revocation.kick_error(json.dumps(
        {"error": {"code": 404, "description": "no such client"}}).encode()) == "no such client"
    assert "does not read" in str(revocation.kick_error(b"]"))

"""The rule that moves a connection off a server cut from its cluster's majority:
when its server counts as cut, and where a reconnection goes (:mod:`phalanx.bus.majority`)."""

from __future__ import annotations

from urllib.parse import urlparse

from nats.aio.client import Server

from phalanx.bus.majority import (
    CUT_AFTER_S,
    SHUN_S,
    MajorityWatch,
    answered,
    cut_off,
    next_server,
)


def pool(*reconnects: int) -> list[Server]:
    return [Server(urlparse(f"nats://n{i}:4222"), r) for i, r in enumerate(reconnects)]


def test_a_503_is_no_answer_and_anything_else_from_jetstream_is() -> None:
    assert not answered(b'{"type":"io.nats.jetstream.api.v1.account_info_response",'
                        b'"error":{"code":503,"err_code":10008,"description":'
                        b'"JetStream system temporarily unavailable"}}')
    assert answered(b'{"type":"io.nats.jetstream.api.v1.account_info_response",'
                    b'"memory":0,"streams":3}')
    assert answered(b'{"error":{"code":404,"description":"not enabled"}}')
    assert answered(b"not json")


def test_its_server_is_cut_off_when_a_majority_of_the_pool_answers_through_others() -> None:
    pool = ["n0", "n1", "n2"]
    assert cut_off(["n1", "n2"], pool)
    # One answer alone may be a cut meta leader not yet deposed, the rest electing.
    assert not cut_off(["n2"], pool) and not cut_off([], pool)
    five = ["n0", "n1", "n2", "n3", "n4"]
    assert cut_off(["n1", "n2", "n3"], five) and not cut_off(["n1", "n2"], five)
    assert not cut_off(["elsewhere", "n1"], pool)  # only the pool's servers count


def test_the_others_are_asked_once_no_probe_was_answered_for_cut_after_s() -> None:
    watch = MajorityWatch(0.0)
    watch.connected("n0", 0.0)
    assert watch.in_majority  # judged from evidence only
    assert not watch.probed(0.0, True, 0.1)
    assert not watch.probed(0.5, False, 1.0)  # one miss: not yet
    assert watch.probed(1.0, False, CUT_AFTER_S + 0.1)  # since the answer sent at 0
    # No majority answers elsewhere (an election): it stays, counted in.
    assert not watch.compared(["n1"], ["n0", "n1", "n2"], 2.0)
    assert watch.in_majority and watch.shunned == {}
    # A majority does: it moves, the servers that did not answer shunned.
    assert watch.compared(["n2", "n1"], ["n0", "n1", "n2"], 2.0)
    assert not watch.in_majority and watch.shunned == {"n0": 2.0 + SHUN_S}
    watch.connected("n1", 2.1)  # moved: judged afresh
    assert watch.in_majority
    assert not watch.probed(2.1, False, 2.1 + CUT_AFTER_S - 0.1)
    assert watch.probed(2.5, False, 2.1 + CUT_AFTER_S)


def test_a_server_that_answers_as_the_others_are_asked_is_not_cut_off() -> None:
    """Seen under load: a majority's server, slow while the majority elected a meta
    leader, counted the new leader's answer through a peer and the cut-off old leader's
    through its own server as a majority, and moved."""
    watch = MajorityWatch(0.0)
    watch.connected("n0", 0.0)
    assert watch.probed(1.0, False, CUT_AFTER_S + 0.1)
    assert not watch.compared(["n1", "n2"], ["n0", "n1", "n2"], 2.0, answered_here=True)
    assert watch.in_majority and watch.shunned == {}
    assert not watch.probed(2.5, False, 2.0 + CUT_AFTER_S - 0.1)  # judged from its answer


def test_a_reconnection_passes_shunned_servers_and_the_one_it_left_over() -> None:
    servers = pool(0, 0, 0)
    chosen, wait = next_server(servers, "n0:4222", {"n1:4222": 30.0}, 1.0, 0.25)
    assert chosen.uri.netloc == "n2:4222" and wait == 0.0
    # Every server shunned: any will do, rather than none.
    shunned = {f"n{i}:4222": 30.0 for i in range(3)}
    assert next_server(servers, "n0:4222", shunned, 1.0, 0.25)[0].uri.netloc == "n1:4222"


def test_a_reconnection_tries_each_server_once_at_once_then_waits() -> None:
    # n0 died (its connection left); n1 failed once since: n2 next, at once.
    chosen, wait = next_server(pool(0, 1, 0), "n0:4222", {}, 0.0, 0.25)
    assert (chosen.uri.netloc, wait) == ("n2:4222", 0.0)
    # Then n0, the one left, which has not failed yet; then, all failed, with a pause.
    assert next_server(pool(0, 1, 1), "n0:4222", {}, 0.0, 0.25)[0].uri.netloc == "n0:4222"
    chosen, wait = next_server(pool(1, 1, 2), "n0:4222", {}, 0.0, 0.25)
    assert (chosen.uri.netloc, wait) == ("n1:4222", 0.25)
    # A lone server is the one to go back to.
    assert next_server(pool(3), "n0:4222", {}, 0.0, 0.25) == (pool(3)[0], 0.25)

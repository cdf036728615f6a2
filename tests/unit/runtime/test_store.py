"""The store of a job's members only (:mod:`phalanx.runtime.store`): a generation
rendezvouses and trains over it as over torch's; a connection of another job, or to
another job's store, is refused before it can read or write anything."""

from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch
import torch.distributed as dist
from test_rendezvous import generation

from phalanx.runtime.group import (
    Waits,
    all_arrived,
    count_in,
    host_store,
    rendezvous,
    store_client,
)
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.store import StoreClient, StoreRefused, StoreServer
from phalanx.schemas import environment

TIMEOUT = datetime.timedelta(seconds=30)
SECRET = environment.derive_store_secret(b"k" * 32, "job-a")


def test_a_generation_rendezvouses_and_trains_on_a_members_only_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.STORE_SECRET, SECRET)
    store = host_store(TIMEOUT, environment.store_secret({environment.STORE_SECRET: SECRET}))
    assert isinstance(store, StoreServer)
    gen = generation(1, store, world_size=2)  # type: ignore[arg-type]
    sums: list[list[float]] = [[], []]

    def member(rank: int) -> None:
        waits = Waits(Inbox(f"r{rank}-0"), lambda: None)
        group = rendezvous(waits, {}, (f"r{rank}-0", store), gen, rank, TIMEOUT,
                           lambda: None)
        tensor = torch.ones(2) * (rank + 1)
        waits.work(group.allreduce([tensor]), lambda: False)
        sums[rank] = tensor.tolist()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sums == [[3.0, 3.0], [3.0, 3.0]]
    assert store.refused == 0


def test_another_jobs_rank_is_refused_and_a_store_of_another_job_is_not_trusted() -> None:
    server = StoreServer(bytes.fromhex(SECRET))
    member = StoreClient("127.0.0.1", server.port, bytes.fromhex(SECRET), TIMEOUT)
    member.set("gloo/rank0", "10.0.0.1:4242")
    other = bytes.fromhex(environment.derive_store_secret(b"k" * 32, "job-b"))
    with pytest.raises(StoreRefused, match="not a member of this job") as refused:
        StoreClient("127.0.0.1", server.port, other, TIMEOUT)
    assert isinstance(refused.value, PermissionError) and server.refused == 1
    # A store of job b does not pass for job a's either: the proof goes both ways.
    with pytest.raises(StoreRefused):
        store_client("127.0.0.1", StoreServer(other).port, TIMEOUT, bytes.fromhex(SECRET))
    # A client that sends no proof (torch's own, say) gets nothing: the server closes.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        raw.recv(64)  # the challenge
        raw.sendall(b"\0" * 64)
        answer = raw.recv(4096)
        assert b"not a member" in answer and raw.recv(4096) == b""
    assert member.get("gloo/rank0") == b"10.0.0.1:4242"  # members' keys untouched


def test_a_wait_that_times_out_is_a_store_error_and_the_connection_stays_usable() -> None:
    server = StoreServer(bytes.fromhex(SECRET))
    first, last = (dist.PrefixStore("j-g1/", StoreClient(
        "127.0.0.1", server.port, bytes.fromhex(SECRET), TIMEOUT)) for _ in range(2))
    assert not count_in(first, 2)
    assert not all_arrived(first, datetime.timedelta(milliseconds=50))
    assert count_in(last, 2)
    assert all_arrived(first, TIMEOUT)
    assert first.add("arrived", 0) == 2
    assert first.compare_set("k", "", "v") == b"v" and first.compare_set("k", "x", "y") == b"v"
    assert first.check(["k"]) and not first.check(["absent"])


def client(server: StoreServer) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, bytes.fromhex(SECRET), TIMEOUT)


def test_a_wait_is_answered_by_the_set_of_its_last_key_and_by_nothing_else() -> None:
    server = StoreServer(bytes.fromhex(SECRET))
    waiter, other, setter = client(server), client(server), client(server)
    answered: list[str] = []

    def wait(store: StoreClient, keys: list[str], name: str) -> None:
        store.wait(keys, TIMEOUT)
        answered.append(name)

    both = threading.Thread(target=wait, args=(waiter, ["a", "b"], "a and b"))
    only_c = threading.Thread(target=wait, args=(other, ["c"], "c"))
    both.start()
    only_c.start()
    setter.set("a", "1")
    setter.add("b", 1)  # the last of the first wait's keys
    both.join(30)
    assert answered == ["a and b"]
    assert only_c.is_alive()  # not woken by keys it does not wait for
    assert setter.compare_set("c", "", "3") == b"3"
    only_c.join(30)
    assert answered == ["a and b", "c"]
    server.close()


def test_every_connection_is_served_by_one_thread() -> None:
    server = StoreServer(bytes.fromhex(SECRET))
    before = threading.active_count()
    members = [client(server) for _ in range(200)]
    assert threading.active_count() == before
    for member in members:
        member.add("arrived", 1)
    assert members[0].get("arrived") == b"200"
    for member in members:
        member.close()
    server.close()
    assert threading.active_count() == before - 1  # the server's own, stopped


def test_a_malformed_request_is_answered_with_what_is_wrong() -> None:
    server = StoreServer(bytes.fromhex(SECRET))
    member = client(server)
    with pytest.raises(dist.DistError, match="unknown store operation 'drop'"):
        member._call("drop", "k")
    with pytest.raises(dist.DistError, match="malformed store request"):
        member._call("add", "k", "not a number")
    with pytest.raises(dist.DistError, match="malformed store request"):
        member._call("set")
    member.set("k", "v")  # the connection stays usable
    assert member.get("k") == b"v"
    server.close()

"""A generation's rendezvous (:func:`phalanx.runtime.group.rendezvous`) on real TCP stores
and gloo: given up when a member that arrived never connects, and the next generation
built on the same store without waiting for the one given up; members waiting for the
last one in waits that time out, one after the other, on one connection."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from phalanx.runtime.group import Aborted, Waits, all_arrived, count_in, host_store, rendezvous
from phalanx.runtime.inbox import Inbox
from phalanx.schemas.messages import Generation, GenerationReason, Member

T = TypeVar("T")
TIMEOUT = datetime.timedelta(seconds=120)  # far longer than the test: it must not be waited


class CountingWaits(Waits):
    """Counts the blocking calls a rendezvous makes."""

    calls = 0

    def call(self, call: Callable[[], T], give_up: Callable[[], str | None]) -> T:
        self.calls += 1
        return super().call(call, give_up)


def generation(number: int, store: dist.TCPStore, world_size: int) -> Generation:
    members = [Member(replica_id=f"r{rank}-0", rank=rank, node_id="n",
                      endpoint=f"127.0.0.1:{store.port}") for rank in range(world_size)]
    return Generation(job_id="j", generation=number, world_size=world_size,
                      rendezvous=f"j-g{number}", resume_step=0,
                      reason=GenerationReason.FAULT, members=members)


def test_a_generation_given_up_in_gloos_connect_does_not_hold_up_the_next() -> None:
    """Rank 1 arrives, then dies before gloo connects: rank 0's connect waits for it, on
    a helper thread, until gloo's timeout. The generation is superseded and given up;
    the next one, on the same rank 0's store, is built while that connect still waits.
    (A store client runs one call at a time: with the connection shared, the next
    generation waited for the first one's timeout, 30 s in a chaos run.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=TIMEOUT, use_libuv=True)
    waits = CountingWaits(Inbox("r0-0"), lambda: None)
    stores: dict[str, dist.Store] = {}
    first = generation(1, store, world_size=2)
    peer = dist.PrefixStore(f"{first.rendezvous}/", dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=TIMEOUT))
    assert not count_in(peer, 2)  # rank 1 arrived, and will never connect

    def superseded() -> str | None:
        # The calls: the store's connection, the arrival (the last: no wait), then gloo's
        # connect, given up at once.
        return "generation 1 was superseded" if waits.calls == 3 else None

    try:
        rendezvous(waits, stores, ("r0-0", store), first, 0, TIMEOUT, superseded)
    except Aborted as exc:
        assert "generation 1 was superseded" in str(exc)
    else:
        raise AssertionError("a rendezvous with a member that never connects was built")
    waiting = [t for t in threading.enumerate() if t.name == "phalanx-rendezvous"]
    assert waiting, "gloo's connect is not waiting for rank 1"
    group = rendezvous(waits, stores, ("r0-0", store), generation(2, store, world_size=1), 0,
                       TIMEOUT, lambda: None)
    assert all(t.is_alive() for t in waiting), "the given-up connect already ended"
    tensor = torch.ones(3)
    waits.work(group.allreduce([tensor]), lambda: False)
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def test_a_wait_for_the_last_member_that_times_out_leaves_the_connection_usable() -> None:
    """A member waits for the last one in waits of the store's timeout, one after the
    other: a wait that timed out is cancelled, and the next one, on the same connection,
    sees the last member come."""
    store = host_store(TIMEOUT)
    first, last = (dist.PrefixStore("j-g1/", dist.TCPStore(
        "127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)) for _ in range(2))
    assert not count_in(first, 2)
    assert not all_arrived(first, datetime.timedelta(milliseconds=50))
    assert count_in(last, 2)
    assert all_arrived(first, TIMEOUT)
    assert first.add("arrived", 0) == 2  # the connection answers as before

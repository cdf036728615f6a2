"""Real gloo ranks as threads of the test's process, on one store: what the runtime's
unit and property tests run their collectives on.

A rank's group is dropped only once every rank is through: a group that went as soon
as its own part ended closed its connections under a peer still sending to it (gloo
"connection closed by peer", seen under load)."""

from __future__ import annotations

import concurrent.futures
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def on_two_ranks(body: Callable[[int, dist.ProcessGroup], Any], *,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=10),
                 join_s: float = 30.0) -> list[Any]:
    """``body(rank, group)`` on ranks 0 and 1 at once; their results, in rank order.

    What a rank raised is raised here, the one raised first when both did: a rank that
    failed leaves its peer to time out in the next collective, and the peer's timeout
    would hide the cause.
    """
    store = dist.HashStore()
    results: list[Any] = [None, None]
    failed_at: dict[int, float] = {}
    groups: list[dist.ProcessGroup] = []

    def rank(r: int) -> None:
        try:
            groups.append(dist.ProcessGroupGloo(store, r, 2, timeout))
            results[r] = body(r, groups[-1])
        except BaseException as exc:  # re-raised by the test's thread
            failed_at[r] = time.monotonic()
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    groups.clear()
    for r in sorted(failed_at, key=failed_at.__getitem__):
        raise results[r]
    return results


def in_group(world: int, work: Callable[[int, dist.ProcessGroup], Any], *,
             timeout: datetime.timedelta = datetime.timedelta(seconds=120)) -> list[Any]:
    """``work(rank, group)`` on ``world`` threads, members of one fresh gloo group; their
    results in rank order (the first exception raised is raised here). The timeout is
    generous: only a hang waits it out, and gloo's connect on a loaded machine has taken
    over 20 s."""
    store = dist.HashStore()
    groups: list[dist.ProcessGroup] = []

    def run(rank: int) -> Any:
        groups.append(dist.ProcessGroupGloo(store, rank, world, timeout))
        return work(rank, groups[-1])

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        done = list(pool.map(run, range(world)))
    groups.clear()
    return done

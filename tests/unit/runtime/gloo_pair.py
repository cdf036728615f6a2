"""Two real gloo ranks as threads of the test's process, on one store: what the runtime's
unit tests run their collectives on."""

from __future__ import annotations

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

    def rank(r: int) -> None:
        try:
            results[r] = body(r, dist.ProcessGroupGloo(store, r, 2, timeout))
        except BaseException as exc:  # re-raised by the test's thread
            failed_at[r] = time.monotonic()
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    for r in sorted(failed_at, key=failed_at.__getitem__):
        raise results[r]
    return results

"""A deposed term's write of a fenced key, let through late, is refused by revision.

Elasticity stores each job's generation record through :class:`FencedKeys`: a term
compare-and-swaps on the revision it last wrote or read. A successor's first write moves
the revision on, so the old term's next write (sent before it stopped, held back by a
cut, delivered at the heal) is refused, and the successor's record stays.
"""

from __future__ import annotations

import pytest

from phalanx.bus.client import Bus
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.messages import StreamCursor
from phalanx.services.jobstate import FencedKeys
from phalanx.services.lease import LeadershipLost


def cursor(seq: int) -> StreamCursor:
    return StreamCursor(seq=seq, updated_at=0.0)


async def test_a_deposed_terms_write_after_its_successors_is_refused(bus: Bus,
                                                                     uid: str) -> None:
    bucket = await TypedKV.open(bus.js, subjects.CURSORS_BUCKET, StreamCursor)
    key = f"fenced-{uid}"
    old = FencedKeys(bucket, "test")
    await old.put(key, cursor(1))  # absent: created
    await old.put(key, cursor(2))  # at the revision it wrote
    new = FencedKeys(bucket, "test")
    await new.put(key, cursor(3))  # its first write: at the revision it read just before
    with pytest.raises(LeadershipLost, match="written by another instance"):
        await old.put(key, cursor(2))
    entry = await bucket.get(key)
    assert entry is not None and entry.value.seq == 3
    await new.put(key, cursor(4))  # the successor goes on at its own revision
    new.forget(key)  # e.g. the job ended: read afresh at the next write
    await new.put(key, cursor(5))

"""``TypedKV.follow`` on a real nats-server: exact current values, then changes; after a
server restart a resync pass brings what changed meanwhile and nothing goes missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.js.errors as jse
import pytest

from phalanx.bus.client import Bus
from phalanx.bus.config import BusConfig
from phalanx.bus.kv import Change, TypedKV
from phalanx.schemas.messages import Lease
from phalanx.services.natsd import NatsServer
from phalanx.services.ports import free_port


def lease(holder: str, epoch: int) -> Lease:
    return Lease(holder=holder, epoch=epoch, expires_at=1.0)


async def until(changes, predicate, timeout_s: float = 15.0) -> list[Change | None]:
    seen: list[Change | None] = []

    async def scan() -> None:
        async for change in changes:
            seen.append(change)
            if predicate(change):
                return

    await asyncio.wait_for(scan(), timeout_s)
    return seen


async def test_follow_gives_current_values_then_changes_and_resyncs_after_a_restart(
        tmp_path: Path) -> None:
    port = free_port()
    server = NatsServer(tmp_path / "js", port=port).start()
    bus = await Bus.connect(BusConfig.load(env={}, servers=[server.url]))
    try:
        kv = await TypedKV.open(bus.js, "follow_test", Lease)
        await kv.put("a", lease("a", 1))
        await kv.put("b", lease("b", 1))
        changes = aiter(kv.follow(bus.resync_event()))
        first = await until(changes, lambda c: c is None)
        assert [(c.key, c.value.epoch) for c in first[:-1]] == [("a", 1), ("b", 1)]
        await kv.put("a", lease("a", 2))
        [changed] = await until(changes, lambda c: c is not None)
        assert (changed.key, changed.value.epoch) == ("a", 2)
        await kv.delete("b")
        [deleted] = await until(changes, lambda c: c is not None)
        assert (deleted.key, deleted.value) == ("b", None)

        # While the server is down another writer changes "a"; after the restart the
        # resync pass brings it, and the values already seen are not yielded again.
        server.process.kill()
        server.process.wait()
        server = NatsServer(tmp_path / "js", port=port).start()
        other = await Bus.connect(BusConfig.load(env={}, servers=[server.url]))
        await (await TypedKV.open(other.js, "follow_test", Lease)).put("a", lease("a", 3))
        await other.close()
        after = await until(changes, lambda c: c is not None and c.value is not None
                            and c.value.epoch == 3, timeout_s=30)
        assert [c for c in after if c is not None and c.key == "a"][-1].value.epoch == 3
        assert all(c is None or c.key == "a" for c in after)  # "b" stays deleted, unrepeated
        await changes.aclose()
    finally:
        await bus.close()
        server.stop()


async def test_follow_raises_when_its_watch_cannot_be_made(tmp_path: Path) -> None:
    """A watch that fails (here: its bucket deleted, so no consumer can be made) ends
    ``follow`` with that error, at once: the watch runs in a task of its own, whose end
    wakes ``follow`` (it must not wait for changes from a watch that is gone)."""
    with NatsServer(tmp_path / "js", port=0) as server:
        bus = await Bus.connect(BusConfig.load(env={}, servers=[server.url]))
        try:
            kv = await TypedKV.open(bus.js, "follow_gone", Lease)
            await kv.put("a", lease("a", 1))
            resync = asyncio.Event()
            changes = aiter(kv.follow(resync))
            assert [c.key for c in await until(changes, lambda c: c is None) if c] == ["a"]
            await bus.js.delete_key_value("follow_gone")
            resync.set()

            async def drain() -> None:
                async for _ in changes:
                    pass

            following = asyncio.ensure_future(drain())
            done, _ = await asyncio.wait([following], timeout=15)  # never cancels it
            assert done, "follow went on waiting on a watch that had failed"
            with pytest.raises(jse.NotFoundError):
                following.result()
        finally:
            await bus.close()

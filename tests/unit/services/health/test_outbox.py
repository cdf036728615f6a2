"""The health leader's outbox: actions in order and never behind writes; each write after
the actions decided before it, the newest per key, in line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.services.health.outbox import Outbox


@contextlib.asynccontextmanager
async def running(outbox: Outbox) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(outbox.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_action_goes_out_while_a_write_is_stuck() -> None:
    outbox, stuck, log = Outbox(), asyncio.Event(), []

    async def write() -> None:
        await stuck.wait()  # a KV write that does not come back (an outage, a slow server)
        log.append("snapshot")

    outbox.write(("job", "j"), write)
    fault_out = asyncio.Event()

    async def fault() -> None:
        log.append("fault")
        fault_out.set()

    async with running(outbox):
        await asyncio.sleep(0)
        outbox.act(fault)
        await fault_out.wait()
        assert log == ["fault"]
        stuck.set()
        await asyncio.wait_for(outbox.idle(), 10)
    assert log == ["fault", "snapshot"]


async def test_a_write_waits_for_the_actions_decided_before_it() -> None:
    outbox, publish, log = Outbox(), asyncio.Event(), []

    async def fault() -> None:
        await publish.wait()
        log.append("fault")

    async def snapshot() -> None:
        log.append("snapshot")

    outbox.act(fault)
    outbox.write(("job", "j"), snapshot)
    async with running(outbox):
        for _ in range(20):
            await asyncio.sleep(0)
        assert log == []  # the snapshot reflects the exit whose fault is not out yet
        publish.set()
        await asyncio.wait_for(outbox.idle(), 10)
    assert log == ["fault", "snapshot"]


async def test_a_state_read_when_settled_reflects_no_action_still_to_go_out() -> None:
    """A write that reads its state at its turn (a large job's) reads it only once every
    action decided so far is out, those decided after it was queued included."""
    outbox, publish, log = Outbox(), asyncio.Event(), []
    state = {"events": 0}

    async def fault() -> None:
        await publish.wait()
        log.append(f"fault {state['events']}")

    async def snapshot() -> None:
        log.append(await outbox.settled(lambda: f"snapshot {state['events']}"))

    outbox.write(("job", "j"), snapshot)
    async with running(outbox):
        await asyncio.sleep(0)
        state["events"] = 1  # an event after the write was queued, and its fault
        outbox.act(fault)
        for _ in range(20):
            await asyncio.sleep(0)
        assert log == []  # the state now reflects an event whose fault is not out
        publish.set()
        await asyncio.wait_for(outbox.idle(), 10)
    assert log == ["fault 1", "snapshot 1"]


async def test_a_waiting_write_is_replaced_in_its_place_in_line() -> None:
    outbox, log = Outbox(), []

    def writing(name: str):
        async def work() -> None:
            log.append(name)
        return work

    outbox.write(("job", "a"), writing("a1"))
    outbox.write(("cursor", 1), writing("cursor 1"))
    outbox.write(("job", "a"), writing("a2"))  # newer: replaces a1, still before the cursor
    async with running(outbox):
        await asyncio.wait_for(outbox.idle(), 10)
    assert log == ["a2", "cursor 1"]


@pytest.mark.parametrize("failing", ["act", "write"])
async def test_an_error_in_any_work_ends_the_run(failing: str) -> None:
    outbox = Outbox()

    async def fails() -> None:
        raise RuntimeError("the leadership is lost")

    outbox.act(fails) if failing == "act" else outbox.write("k", fails)
    with pytest.raises(ExceptionGroup) as error:
        await asyncio.wait_for(outbox.run(), 10)
    assert error.group_contains(RuntimeError, match="the leadership is lost")


operations = st.lists(st.one_of(
    st.tuples(st.just("act"), st.integers(0, 3)),
    st.tuples(st.just("write"), st.sampled_from(["a", "b", "c", "cursor"]), st.integers(0, 3)),
    st.tuples(st.just("yield"), st.integers(1, 4)),
), max_size=40)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_the_rules_hold_for_any_interleaving(script: list[tuple]) -> None:
    """Whatever is queued while what came before is being carried out (each work taking a
    few turns of the loop): actions run once each, in order; a write runs only after the
    actions queued before it; per key the newest write runs and a replaced one never; and
    every write queued before a cursor write has it or a newer write of its key started
    first (the cursor says everything before it is stored). ``cursor`` writes get a key
    each, as the health service gives them."""

    async def scenario() -> None:
        outbox = Outbox()
        started: list[tuple[str, int]] = []  # (kind, id) as each work starts
        queued: list[tuple[str, int, object, int]] = []  # (kind, id, key, actions before)
        actions = 0

        def work(kind: str, ident: int, turns: int):
            async def run() -> None:
                started.append((kind, ident))
                for _ in range(turns):
                    await asyncio.sleep(0)
            return run

        async with running(outbox):
            for ident, op in enumerate(script):
                if op[0] == "act":
                    outbox.act(work("act", ident, op[1]))
                    queued.append(("act", ident, None, actions))
                    actions += 1
                elif op[0] == "write":
                    key = ("cursor", ident) if op[1] == "cursor" else op[1]
                    outbox.write(key, work("write", ident, op[2]))
                    queued.append(("write", ident, key, actions))
                else:
                    for _ in range(op[1]):
                        await asyncio.sleep(0)
            await asyncio.wait_for(outbox.idle(), 10)

        position = {entry: i for i, entry in enumerate(started)}
        assert len(position) == len(started), "a work ran twice"
        acts = [ident for kind, ident, _, _ in queued if kind == "act"]
        assert [ident for kind, ident in started if kind == "act"] == acts
        writes = [(ident, key, before) for kind, ident, key, before in queued if kind == "write"]
        newest = {key: ident for ident, key, _ in writes}
        for ident, key, before in writes:
            at = position.get(("write", ident))
            if ident == newest[key]:
                assert at is not None, f"the newest write of {key} never ran"
            if at is None:
                continue
            assert all(position[("act", a)] < at for a in acts[:before]), \
                f"write {ident} ran before an action decided before it"
        for i, (ident, key, _) in enumerate(writes):
            at = position.get(("write", ident))
            if at is None or key[0] != "cursor":
                continue
            for earlier, other, _ in writes[:i]:
                if other == key:
                    continue
                later_of_key = [w for w, k, _ in writes if k == other and w >= earlier]
                assert any(position.get(("write", w), len(started)) < at
                           for w in later_of_key), \
                    f"write {ident} ran before {other}'s write {earlier} queued before it"

    asyncio.run(scenario())

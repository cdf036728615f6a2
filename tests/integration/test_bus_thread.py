"""The runtime's bus thread holds every send it starts until the send ends."""

from __future__ import annotations

import asyncio
import gc
import threading

from phalanx.bus.config import BusConfig
from phalanx.runtime.bus_thread import BusThread
from phalanx.schemas.messages import NodeHeartbeat


def test_a_send_in_flight_is_held_until_it_ends(bus_config: BusConfig, uid: str) -> None:
    thread = BusThread(bus_config, f"test-{uid}").start()

    async def in_flight() -> set[asyncio.Task[None]]:
        return set(thread._sending)  # read on the bus thread, where it changes

    try:
        arrived = threading.Event()
        thread.subscribe(f"phalanx.test.{uid}.plain", NodeHeartbeat,
                         lambda message, delivery: arrived.set())
        # No stream stores this subject: the event is retried until the thread closes.
        thread.publish_event(f"phalanx.test.{uid}.unstored",
                             NodeHeartbeat(node_id="n1", seq=1, sent_at=0.0), event_id=uid)
        thread.publish(f"phalanx.test.{uid}.plain", NodeHeartbeat(node_id="n1", seq=2,
                                                                  sent_at=0.0))
        assert arrived.wait(10)
        gc.collect()  # a send nothing held would be collected here, mid-flight
        (held,) = thread.run(in_flight(), 5)  # the plain publish ended and was let go
        assert not held.done()
    finally:
        thread.close()
    assert held.cancelled()  # closing ends what is still in flight: nothing left pending

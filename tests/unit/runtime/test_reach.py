"""Which peers' nodes answer (:mod:`phalanx.runtime.reach`), and the wait that asks when a
collective makes no progress (:meth:`phalanx.runtime.group.Waits.work`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from phalanx.runtime.group import Unreachable, Waits
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.reach import silent


@pytest.fixture
def listening() -> Iterator[str]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def deaf() -> Iterator[str]:
    """An endpoint whose connects are never answered: a listener whose accept queue is
    full drops further SYNs, as a cut link does."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        endpoint = ("127.0.0.1", server.getsockname()[1])
        filled = []
        try:
            for _ in range(8):  # until a connect is left unanswered
                client = socket.socket()
                client.settimeout(0.2)
                filled.append(client)
                try:
                    client.connect(endpoint)
                except TimeoutError:
                    break
            else:
                pytest.skip("this kernel answers every connect to a full accept queue")
            yield f"{endpoint[0]}:{endpoint[1]}"
        finally:
            for client in filled:
                client.close()


def test_a_node_that_accepts_or_refuses_answers(listening: str) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening
        assert silent([listening, refused], timeout_s=1.0) == set()


def test_a_node_that_answers_nothing_is_silent_within_the_deadline(listening: str,
                                                                   deaf: str) -> None:
    started = time.monotonic()
    assert silent([listening, deaf, deaf], timeout_s=0.3) == {deaf}
    assert time.monotonic() - started < 1.0


class Pending:
    """A work item that completes when :meth:`complete` is called."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[Any]:
        return self.future

    def complete(self) -> None:
        self.future.set_result([])

    def wait(self) -> bool:
        return True


def test_a_wait_without_progress_names_the_members_it_cannot_reach() -> None:
    asked: list[float] = []

    def unreachable() -> list[str]:
        asked.append(time.monotonic())
        return ["r2-0", "r3-0"]

    waits = Waits(Inbox("r0-0"), lambda: None, unreachable, unreachable_after_s=0.3)
    work = Pending()
    started = time.monotonic()
    with pytest.raises(Unreachable) as raised:
        waits.work(work, lambda: False)  # type: ignore[arg-type]
    assert raised.value.replicas == ("r2-0", "r3-0")
    assert "r2-0, r3-0" in str(raised.value)
    # unreachable_after_s after the first wake-up that found it waiting (<= 0.5 s), at
    # the wake-up after (every 0.5 s).
    assert len(asked) == 1 and 0.3 <= asked[0] - started <= 0.5 + 0.3 + 0.5 + 0.2
    assert work in waits.abandoned  # left to gloo's timeout, its buffers never reused


def test_a_slow_collective_whose_peers_all_answer_goes_on_waiting() -> None:
    asked: list[float] = []
    waits = Waits(Inbox("r0-0"), lambda: None, lambda: asked.append(0.0) or [],
                  unreachable_after_s=0.2)
    work = Pending()
    threading.Timer(2.2, work.complete).start()
    waits.work(work, lambda: False)  # type: ignore[arg-type]
    assert len(asked) >= 2  # asked again each unreachable_after_s


def test_a_collective_that_completes_asks_nothing() -> None:
    asked: list[float] = []
    waits = Waits(Inbox("r0-0"), lambda: None, lambda: asked.append(0.0) or ["r1-0"],
                  unreachable_after_s=0.0)
    work = Pending()
    work.complete()
    waits.work(work, lambda: False)  # type: ignore[arg-type]
    assert asked == []

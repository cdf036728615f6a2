"""The abortable process group: waits on gloo and on the store that a fault cuts short.

Measured on torch 2.13: a rank SIGKILLed in a gloo ring all-reduce errors
only its two neighbours; the others block until the gloo timeout, and
``ProcessGroupGloo.abort()`` does not unblock them (and makes the process
``std::terminate`` at exit). So the training thread never blocks in gloo or
in a store call. :meth:`Waits.work` waits on an event that the work's
completion sets (a future callback, or a waiter thread for send/recv work,
which has no future and whose second ``wait()`` never returns) or the
:class:`~.inbox.Inbox` sets (a fault of a member, a newer generation),
whichever comes first; :meth:`Waits.call` runs a blocking call (connecting
to a store, a store ``add``, gloo's connect) on a helper thread the same way.
Either raises :class:`Aborted` when the caller's condition says the
generation is given up.

What is given up is *kept*, never destroyed: a group or work item still
blocked on a dead peer is left to its own timeout (:attr:`Waits.abandoned`),
and its buffers are never reused. While it waits, the rank reports progress
(``heartbeat``): waiting for peers is not a hang.

:func:`rendezvous` builds a generation's gloo group on its rank 0's store,
under the generation's own prefix, with every blocking part abortable.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from phalanx.runtime.inbox import Inbox
from phalanx.schemas.messages import Generation

T = TypeVar("T")


class Aborted(Exception):
    """The generation a collective ran in was abandoned (a member failed)."""


class Waits:
    """The training thread's abortable waits.

    Args:
        inbox: what wakes a wait (its event is set by the bus thread and by completions).
        heartbeat: called while a wait goes on (rate-limited by the caller).
    """

    def __init__(self, inbox: Inbox, heartbeat: Callable[[], None]) -> None:
        self.inbox = inbox
        self.heartbeat = heartbeat
        #: Process groups and work items given up on, left to gloo's own timeout.
        self.abandoned: list[Any] = []

    def work(self, work: dist.Work, must_abort: Callable[[], bool]) -> None:
        """Wait for ``work``; raise :class:`Aborted` the moment ``must_abort()`` says so, or
        when the work fails (a peer's connection closed: its fault is on its way)."""
        done = threading.Event()
        failure: list[BaseException] = []
        wake = self.inbox.wake

        def finished(_: Any = None) -> None:
            done.set()
            wake.set()

        waited_by_thread = False
        try:
            work.get_future().add_done_callback(finished)
        except RuntimeError:
            waited_by_thread = True
            # gloo's send/recv work has no future and never says it completed: a thread
            # waits on it, and is left to gloo's timeout if the generation is abandoned.
            def waiter() -> None:
                try:
                    work.wait()
                except RuntimeError as exc:
                    failure.append(exc)
                finished()

            threading.Thread(target=waiter, name="phalanx-wait", daemon=True).start()
        while not done.is_set():
            if must_abort():
                self.abandoned.append(work)
                raise Aborted("a member failed")
            self.inbox.sleep(0.5)
            if not done.is_set():
                self.heartbeat()
        try:
            if failure:
                raise failure[0]
            if not waited_by_thread:  # a second wait on gloo's send/recv work never returns
                work.wait()
        except RuntimeError as exc:
            raise Aborted(str(exc)) from None

    def call(self, call: Callable[[], T], give_up: Callable[[], str | None]) -> T:
        """``call()`` on a helper thread; :class:`Aborted` if it fails, or with the reason
        ``give_up()`` returns (checked every 50 ms and on every wake-up) while it runs."""
        done = threading.Event()
        outcome: list[Any] = []
        wake = self.inbox.wake

        def run() -> None:
            try:
                outcome.append(call())
            except Exception as exc:  # a dead peer's store or socket: not this rank's bug
                outcome.append(exc)
            done.set()
            wake.set()

        threading.Thread(target=run, name="phalanx-rendezvous", daemon=True).start()
        while not done.is_set():
            reason = give_up()
            if reason is not None:
                raise Aborted(reason)
            self.heartbeat()  # a store or gloo connect that waits on a peer is not a hang
            self.inbox.sleep(0.05)
        if isinstance(outcome[0], Exception):
            raise Aborted(str(outcome[0]))
        return outcome[0]


def rendezvous(waits: Waits, stores: dict[str, dist.Store], own: tuple[str, dist.Store],
               generation: Generation, rank: int, timeout: datetime.timedelta,
               give_up: Callable[[], str | None]) -> dist.ProcessGroup:
    """A gloo group over ``generation``'s namespace in its rank 0's store.

    Args:
        stores: connections to other replicas' stores by endpoint (filled as needed).
        own: this replica's id and the store it hosts (used when it is rank 0).
        give_up: the reason to give the generation up (superseded, job over), or None.

    Raises:
        Aborted: a store or peer is unreachable, or ``give_up`` gave a reason.
    """
    def abortable(call: Callable[[], T]) -> T:
        try:
            return waits.call(call, give_up)
        except Aborted as exc:
            raise Aborted(f"rendezvous of generation {generation.generation}: {exc}") from None

    endpoint = generation.members[0].endpoint
    store = stores.get(endpoint)
    if store is None:
        if generation.members[0].replica_id == own[0]:
            store = own[1]
        else:
            host, _, port = endpoint.rpartition(":")
            store = abortable(lambda: dist.TCPStore(host, int(port), is_master=False,
                                                    timeout=timeout))
        stores[endpoint] = store
    prefixed = dist.PrefixStore(f"{generation.rendezvous}/", store)
    # Everyone arrives before gloo connects, so a rank that is gone is noticed here.
    abortable(lambda: prefixed.add("arrived", 1))
    while int(abortable(lambda: prefixed.add("arrived", 0))) < generation.world_size:
        waits.heartbeat()  # waiting for a slow member is not a hang (rate-limited)
        waits.inbox.sleep(0.002)
    return abortable(lambda: dist.ProcessGroupGloo(prefixed, rank, generation.world_size,
                                                   timeout))

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

What is given up on gloo is *kept*, never destroyed: a group or work item
still blocked on a dead peer is left to its own timeout (:attr:`Waits.abandoned`),
and its buffers are never reused. While it waits, the rank reports progress
(``heartbeat``): waiting for peers is not a hang.

**A peer it cannot reach.** A link cut between nodes fails no process: the
collective waits for gloo's timeout, and since its ranks report progress while
they wait, nobody else notices. So a work item that has made no progress for
``unreachable_after_s`` (and again each ``unreachable_after_s`` after) asks which
peers' nodes answer a connect (:mod:`.reach`); if some do not, the wait raises
:class:`Unreachable` naming them, which the member reports to elasticity. A
collective that is merely slow (a peer still computing, a straggler) finds every
node answering and goes on waiting. The clock starts only once a wait has slept
without its work completing: a collective that completes costs nothing more.

**On NCCL** the rest differs. An NCCL collective waiting for a dead peer is a
kernel spinning on the GPU: it holds the device's stream, so the group cannot be
left to a timeout; it is *aborted* (``ProcessGroupNCCL.abort()``, which is
``ncclCommAbort``: the kernels end and the device is usable by the next
generation), and dropped. Its work's future says nothing about completion (torch
completes it when the collective is enqueued), so :meth:`Waits.work` polls the
work's CUDA event instead (``is_completed()``, every :data:`POLL_S`), still
woken at once by the inbox. Communicators are built non-blocking
(``config.blocking = 0``), so a communicator whose peers never come can be
aborted while it initialises too; :mod:`.placement` keeps torch's watchdog from
ending the process when a collective fails because we aborted it.

:func:`rendezvous` builds a generation's group on its rank 0's store, under the
generation's own prefix, with every blocking part abortable: a gloo group (the
CPU, or ranks that share a GPU), or an NCCL one. A :class:`DeviceGroup` stands in
front of a group whose ranks train on a GPU, taking every tensor the session
hands it: what the backend cannot take where it is (a CPU tensor for NCCL, a
CUDA tensor for gloo's send and receive) is staged onto the device it can take,
and copied back once the work completed. A CPU rank's gloo group is used as it
is. NCCL is imported only when an NCCL group is built: a CPU build of torch never
touches it.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from phalanx.runtime import gloo_loop
from phalanx.runtime.inbox import Inbox
from phalanx.runtime.placement import Backend, nccl_environment
from phalanx.runtime.store import StoreClient, StoreServer
from phalanx.schemas.environment import store_secret
from phalanx.schemas.messages import Generation

T = TypeVar("T")
#: How often a wait asks the device whether an NCCL collective completed.
POLL_S = 0.0005
#: torch's variable naming the interfaces gloo listens on; where set it wins over the
#: replica's advertised address.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
#: gloo's threads per group, as torch's own constructor gives it.
GLOO_THREADS = 2
#: How often a long wait reports progress (the reporter sends at most one per 0.1 s).
HEARTBEAT_S = 0.5
#: The key a generation's members count themselves in under, in its namespace.
ARRIVED = "arrived"
#: The key the last member to count itself in sets; the others wait on it.
ALL_ARRIVED = "all-arrived"


class Aborted(Exception):
    """The generation a collective ran in was abandoned (a member failed)."""


class Unreachable(Aborted):
    """A collective made no progress and the nodes of ``replicas`` (members of its
    generation) answered no connect: a link between this node and theirs is cut."""

    def __init__(self, replicas: Sequence[str], after_s: float) -> None:
        self.replicas = tuple(replicas)
        super().__init__(f"no progress for {after_s:g} s and no answer from the node(s) of "
                         f"{', '.join(self.replicas)}: unreachable")


class Waits:
    """The training thread's abortable waits.

    Args:
        inbox: what wakes a wait (its event is set by the bus thread and by completions).
        heartbeat: called while a wait goes on (rate-limited by the caller).
        unreachable: the members whose node answers no connect (:mod:`.reach`), asked
            when a work item made no progress for ``unreachable_after_s``; None: never.
    """

    def __init__(self, inbox: Inbox, heartbeat: Callable[[], None],
                 unreachable: Callable[[], Sequence[str]] | None = None,
                 unreachable_after_s: float = math.inf) -> None:
        self.inbox = inbox
        self.heartbeat = heartbeat
        self.unreachable = unreachable
        self.unreachable_after_s = unreachable_after_s
        #: Process groups and work items given up on, left to gloo's own timeout.
        self.abandoned: list[Any] = []
        #: The threads aborting given-up NCCL groups (:meth:`DeviceGroup.abort`).
        self.aborting: list[threading.Thread] = []

    def work(self, work: dist.Work | DeviceWork, must_abort: Callable[[], bool]) -> None:
        """Wait for ``work``; raise :class:`Aborted` the moment ``must_abort()`` says so, or
        when the work fails (a peer's connection closed: its fault is on its way)."""
        if isinstance(work, DeviceWork) and work.polled:
            self._polled(work, must_abort)
            return
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
        since: float | None = None  # when it was first seen waiting
        while not done.is_set():
            if must_abort():
                self.abandoned.append(work)
                raise Aborted("a member failed")
            self.inbox.sleep(0.5)
            if not done.is_set():
                self.heartbeat()
                try:
                    since = self._stalled(since)
                except Unreachable:
                    self.abandoned.append(work)
                    raise
        try:
            if failure:
                raise failure[0]
            if not waited_by_thread:  # a second wait on gloo's send/recv work never returns
                work.wait()
        except RuntimeError as exc:
            raise Aborted(str(exc)) from None

    def _polled(self, work: DeviceWork, must_abort: Callable[[], bool]) -> None:
        """An NCCL work item: its completion is asked of the device; an abort leaves it to
        the communicator's abort (:meth:`abandon`), so nothing is kept."""
        beat = time.monotonic()
        since: float | None = None
        while not work.is_completed():
            if must_abort():
                raise Aborted("a member failed")
            self.inbox.sleep(POLL_S)
            if time.monotonic() - beat >= HEARTBEAT_S:
                self.heartbeat()
                beat = time.monotonic()
                since = self._stalled(since)
        try:
            work.wait()
        except RuntimeError as exc:  # the collective failed or timed out
            raise Aborted(str(exc)) from None

    def _stalled(self, since: float | None) -> float:
        """A wait seen without progress since ``since`` (None: just now): when to count
        from next. Past ``unreachable_after_s``, the members' nodes are probed.

        Raises:
            Unreachable: some answered no connect (the probe takes up to
                :data:`.reach.PROBE_S`).
        """
        now = time.monotonic()
        if since is None or self.unreachable is None:
            return now
        if now - since < self.unreachable_after_s:
            return since
        silent = self.unreachable()
        if silent:
            raise Unreachable(silent, round(now - since, 1))
        return time.monotonic()

    def abandon(self, group: Any) -> None:
        """Give ``group`` up: an NCCL group is aborted (its kernels end, the device is free
        for the next generation) and released, on a thread of its own (:attr:`aborting`);
        a gloo group is kept (its threads may still block on a dead peer, until gloo's
        timeout), its loop made edge-triggered so that it cannot spin on a connection it
        will never read again (:mod:`.gloo_loop`)."""
        if isinstance(group, DeviceGroup) and group.backend_kind is Backend.NCCL:
            self.aborting = [t for t in self.aborting if t.is_alive()]
            self.aborting.append(group.abort())
        else:
            self.abandoned.append(group)
            gloo_loop.quiet_group(group.backend if isinstance(group, DeviceGroup) else group)

    def aborted(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the NCCL aborts under way; whether all ended
        (their communicators' device memory and threads are then released)."""
        deadline = time.monotonic() + timeout
        for thread in self.aborting:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.aborting = [t for t in self.aborting if t.is_alive()]
        return not self.aborting

    def call(self, call: Callable[[], T], give_up: Callable[[], str | None]) -> T:
        """``call()`` on a helper thread; :class:`Aborted` if it fails, or with the reason
        ``give_up()`` returns (checked every 50 ms and on every wake-up) while it runs."""
        done = threading.Event()
        outcome: list[T | Exception] = []
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
        result = outcome[0]
        if isinstance(result, Exception):
            raise Aborted(str(result))
        return result


class DeviceWork:
    """A work item of a :class:`DeviceGroup`: torch's work, the staged results to copy
    back once it completed, and whether its completion must be asked of the device."""

    def __init__(self, work: dist.Work, back: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 polled: bool) -> None:
        self.work, self.back, self.polled = work, back, polled

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """gloo's future (RuntimeError for its send/receive, which have none)."""
        return self.work.get_future()

    def wait(self) -> None:
        """Once completed: make the results visible to this thread's stream (NCCL) and
        copy staged results back where the caller wanted them."""
        self.work.wait()
        for wanted, staged in self.back:
            wanted.copy_(staged)


class DeviceGroup:
    """A generation's process group for ranks that train on ``device`` (a GPU).

    The session's collectives (all-reduce, broadcast, send, receive) come here with
    tensors of the model's device and of the CPU (the small vectors that agree on steps,
    snapshots and state headers). A tensor the backend cannot take where it is, is
    staged: NCCL takes CUDA tensors only, so a CPU tensor goes over on ``device`` and
    comes back after the work; gloo's all-reduce and broadcast take CUDA tensors, its
    send and receive only CPU ones (they read and write the raw pointer), so a CUDA
    tensor there goes through host memory.

    Args:
        backend: the torch backend (``ProcessGroupGloo`` or ``ProcessGroupNCCL``).
        backend_kind: which of the two it is.
        device: the model's device.
    """

    def __init__(self, backend: Any, backend_kind: Backend, device: torch.device) -> None:
        self.backend, self.backend_kind, self.device = backend, backend_kind, device

    def _target(self, tensor: torch.Tensor, point_to_point: bool) -> torch.device | None:
        """Where ``tensor`` must be staged for this backend; None: it can go as it is."""
        if self.backend_kind is Backend.NCCL:
            return None if tensor.device.type == "cuda" else self.device
        if point_to_point and tensor.device.type != "cpu":
            return torch.device("cpu")
        return None

    def _run(self, start: Callable[[list[torch.Tensor]], dist.Work],
             tensors: list[torch.Tensor], point_to_point: bool, written: bool) -> DeviceWork:
        staged, back = [], []
        for tensor in tensors:
            target = self._target(tensor, point_to_point)
            if target is None:
                staged.append(tensor)
                continue
            copy = tensor.to(target)  # a copy on the device the backend takes
            staged.append(copy)
            if written:
                back.append((tensor, copy))
        return DeviceWork(start(staged), back, polled=self.backend_kind is Backend.NCCL)

    def allreduce(self, tensors: list[torch.Tensor]) -> DeviceWork:
        return self._run(self.backend.allreduce, tensors, False, True)

    def broadcast(self, tensor: torch.Tensor, root: int) -> DeviceWork:
        return self._run(lambda staged: self.backend.broadcast(staged[0], root), [tensor],
                         False, self.backend.rank() != root)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> DeviceWork:
        return self._run(lambda staged: self.backend.send(staged, dst, tag), tensors, True,
                         False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> DeviceWork:
        return self._run(lambda staged: self.backend.recv(staged, src, tag), tensors, True,
                         True)

    def abort(self) -> threading.Thread:
        """NCCL: abort the communicator (``ncclCommAbort``: its kernels end) and let go of
        the group (its destructor joins torch's watchdog), both on a thread of their own,
        which is returned. Measured on an H200 (NCCL 2.28), the abort takes about 1 s
        whatever the group did; the next generation's communicator need not wait for it."""
        held = [self.backend]
        self.backend = None

        def abort_and_release() -> None:
            held[0].abort()
            held.clear()

        thread = threading.Thread(target=abort_and_release, name="phalanx-abort", daemon=True)
        thread.start()
        return thread


#: A generation's group as the session calls it: torch's (gloo, for a CPU rank) or a
#: :class:`DeviceGroup` in front of one; and what its collectives return.
Group = dist.ProcessGroup | DeviceGroup
GroupWork = dist.Work | DeviceWork


def connect(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
            backend: Backend, device: torch.device,
            host: str | None = None) -> dist.ProcessGroup | DeviceGroup:
    """Build the group of one generation: gloo as it is for a CPU rank, else a
    :class:`DeviceGroup` in front of gloo or NCCL. Blocks until gloo has connected; an
    NCCL group's communicator is started by :func:`nccl_ready` (its constructor does not
    block).

    gloo listens on ``host``, the address this replica's store is advertised at, so its
    peers reach both at the same place; None, or ``GLOO_SOCKET_IFNAME`` set: gloo's own
    choice, the address the machine's host name resolves to (its loopback, where the name
    resolves to 127.0.1.1 as Debian's /etc/hosts has it: unreachable from other nodes).
    """
    if backend is Backend.NCCL:
        from torch.distributed import ProcessGroupNCCL  # not in a CPU build of torch

        nccl_environment(timeout)
        options = ProcessGroupNCCL.Options()
        options.config.blocking = 0  # an initialisation that waits for the dead is aborted
        options._timeout = timeout
        return DeviceGroup(ProcessGroupNCCL(store, rank, world_size, options), backend,
                           device)
    gloo = gloo_loop.built(lambda: gloo_group(store, rank, world_size, timeout, host))
    # torch's stub derives ProcessGroupGloo from Backend and gives it none of the
    # collectives (allreduce, broadcast, send, recv) it has and ProcessGroup declares.
    return gloo if device.type == "cpu" else DeviceGroup(  # type: ignore[return-value]
        gloo, backend, device)


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
               host: str | None) -> dist.ProcessGroupGloo:
    """A gloo group whose transport listens on ``host`` (:func:`connect`)."""
    if host is None or os.environ.get(GLOO_SOCKET_IFNAME):
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stub
    options._timeout = timeout
    options._threads = GLOO_THREADS
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def nccl_ready(group: DeviceGroup) -> None:
    """Start ``group``'s communicator on its device and wait until it carries a
    collective (peers exchange its id through the store; a non-blocking communicator
    returns while it initialises, and a one-element all-reduce waits for it). Run on a
    helper thread: the training thread aborts the group if it gives the generation up
    meanwhile."""
    group.backend.eager_connect_single_device(group.device)
    probe = torch.ones(1, device=group.device)
    group.backend.allreduce([probe]).wait()
    torch.cuda.current_stream(group.device).synchronize()


#: The store a replica hosts: torch's, or one that answers its job's members alone.
Hosted = dist.TCPStore | StoreServer


def host_store(timeout: datetime.timedelta, secret: bytes | None = None) -> Hosted:
    """The store a replica hosts for the generations it is rank 0 of, on every interface,
    on a port of the system's choice (``.port``): with the job's ``secret``
    (:func:`~phalanx.schemas.environment.store_secret`), one that answers only
    connections that prove it (:mod:`.store`); without, torch's libuv ``TCPStore``, which
    answers anyone."""
    if secret is not None:
        return StoreServer(secret)
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                         timeout=timeout, use_libuv=True)


def store_client(host: str, port: int, timeout: datetime.timedelta,
                 secret: bytes | None = None) -> dist.Store:
    """A connection to a replica's store (:func:`host_store`), proving ``secret`` where the
    job has one.

    Raises:
        StoreRefused: the store is not this job's (it refused the proof, or gave none).
    """
    if secret is not None:
        return StoreClient(host, port, secret, timeout)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def count_in(store: dist.Store, world_size: int) -> bool:
    """Count a member in under :data:`ARRIVED`; the one that completes the count sets
    :data:`ALL_ARRIVED`, which the others wait on. Whether every member has arrived."""
    if store.add(ARRIVED, 1) < world_size:
        return False
    store.set(ALL_ARRIVED, "1")
    return True


def all_arrived(store: dist.Store, within: datetime.timedelta) -> bool:
    """Wait up to ``within`` for :data:`ALL_ARRIVED`; whether it came. The store answers
    the wait when the key is set (no polling); a wait that times out is cancelled, so
    the connection stays usable for the next."""
    try:
        store.wait([ALL_ARRIVED], within)
    except dist.DistStoreError:  # this wait's timeout (a lost connection is a DistNetworkError)
        return False
    return True


def arrive(waits: Waits, stores: dict[str, dist.Store], own: tuple[str, Hosted],
           generation: Generation, timeout: datetime.timedelta,
           give_up: Callable[[], str | None], column: int = 0) -> dist.PrefixStore:
    """The first part of :func:`rendezvous`: connect to the store of ``generation``'s rank
    0 (or reuse the connection in ``stores``), count this member in and wait until every
    member has. Returns the generation's namespace in that store. Two requests per member
    (an ``add``, then a ``wait`` the store answers when the last one counts in: one more
    ``set`` for that one), however long the others take, where polling the count sent
    one every 2 ms each; the waits are ``timeout`` long, one after the other, so a member
    that never comes holds the others until the generation is given up, as before.

    Raises:
        Aborted: the store is unreachable, or ``give_up`` gave a reason (the connection
            is then dropped from ``stores``).
    """
    abortable = _abortable(waits, stores, generation, give_up)
    endpoint = generation.members[0].endpoint
    store = stores.get(endpoint)
    if store is None:
        if generation.members[0].replica_id == own[0] and column == 0:
            # A connection of its own, not the hosting object's, so it can be dropped.
            store_host, port = "127.0.0.1", own[1].port
        else:
            store_host, _, text = endpoint.rpartition(":")
            port = int(text)
        secret = store_secret(os.environ)
        store = abortable(lambda: store_client(store_host, port, timeout, secret))
        stores[endpoint] = store
    prefixed = dist.PrefixStore(
        f"{generation.rendezvous}/" if column == 0 else f"{generation.rendezvous}/g{column}/",
        store)
    # Everyone arrives before gloo connects, so a rank that is gone is noticed here.
    if not abortable(lambda: count_in(prefixed, generation.world_size)):
        while not abortable(lambda: all_arrived(prefixed, timeout)):
            pass  # the next wait (each call reports progress: waiting is not a hang)
    return prefixed


def _abortable(waits: Waits, stores: dict[str, dist.Store], generation: Generation,
               give_up: Callable[[], str | None]) -> Callable[[Callable[[], T]], T]:
    """``waits.call`` for a rendezvous's blocking parts, dropping its store's connection
    when one is given up."""
    endpoint = generation.members[0].endpoint

    def abortable(call: Callable[[], T]) -> T:
        try:
            return waits.call(call, give_up)
        except Aborted as exc:
            # The call given up may still wait inside the connection (gloo's connect for a
            # peer that died), and a store client runs one call at a time: the next
            # generation's calls on it would wait for that one's timeout (30 s seen).
            stores.pop(endpoint, None)
            raise Aborted(f"rendezvous of generation {generation.generation}: {exc}") from None

    return abortable


def rendezvous(waits: Waits, stores: dict[str, dist.Store], own: tuple[str, Hosted],
               generation: Generation, rank: int, timeout: datetime.timedelta,
               give_up: Callable[[], str | None], backend: Backend = Backend.GLOO,
               device: torch.device | None = None, column: int = 0,
               host: str | None = None,
               arrived: Callable[[], None] | None = None) -> dist.ProcessGroup | DeviceGroup:
    """A group over ``generation``'s namespace in its rank 0's store: every member
    counts in (:func:`arrive`), then the group connects.

    Args:
        stores: connections to the replicas' stores by endpoint (filled as needed; one
            a given-up rendezvous used is dropped).
        own: this replica's id and the store it hosts (reached on 127.0.0.1 when it is
            rank 0).
        give_up: the reason to give the generation up (superseded, job over), or None.
        backend / device: which group (:func:`connect`), for a model on ``device``
            (None: the CPU).
        column: with replica groups, which of the generation's groups: the one of every
            group's rank ``column`` (:mod:`.replica_group`), under a namespace of its own
            in the store of rank 0's group rank 0.
        host: where this replica's gloo listens (:func:`connect`).
        arrived: called once every member has counted in, before the group connects
            (fault injection: :mod:`.chaos`'s ``rendezvous`` phase).

    Raises:
        Aborted: a store or peer is unreachable, or ``give_up`` gave a reason (an NCCL
            communicator started meanwhile is aborted first).
    """
    prefixed = arrive(waits, stores, own, generation, timeout, give_up, column)
    if arrived is not None:
        arrived()
    abortable = _abortable(waits, stores, generation, give_up)
    device = device if device is not None else torch.device("cpu")
    if backend is Backend.GLOO:
        return abortable(lambda: connect(prefixed, rank, generation.world_size, timeout,
                                         backend, device, host))
    group = connect(prefixed, rank, generation.world_size, timeout, backend, device, host)
    assert isinstance(group, DeviceGroup)
    try:
        abortable(lambda: nccl_ready(group))
    except Aborted:
        waits.abandon(group)  # aborts a communicator that waits for peers that never come
        raise
    return group

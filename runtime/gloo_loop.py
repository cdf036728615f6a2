"""The event loops of abandoned gloo groups, made edge-triggered so that none spins.

Each ``ProcessGroupGloo`` has a transport device with one event-loop thread
(``gloo_tcp_loop``) on an epoll of its own, watching the group's connections
level-triggered. A group abandoned after a fault is kept, never destroyed
(:mod:`.group`, :mod:`.teardown`), and its loop runs on. Measured on torch 2.13
(e2e, a rank SIGKILLed mid all-reduce): in a survivor, a connection of the
abandoned group had a message from the dead peer half read when the all-reduce
failed and released the buffer it was being read into. gloo leaves such a
message "for the next loop iteration", for a buffer that never comes back; the
socket stays readable (the rest of the message, then the peer's EOF), so
``epoll_wait`` returns at once, forever: the loop thread burnt a whole core
until the rank exited (100 s and more of CPU in a long job).

When a group is abandoned, :func:`quiet` makes every connection of its loop
edge-triggered (``EPOLLET`` added through ``EPOLL_CTL_MOD``, gloo's own handler
pointer kept). A connection then wakes the loop once per arrival, not for as
long as it is readable: gloo still reads whatever it can (a peer's EOF still
closes the pair, a late message still completes), and a message it can never
take wakes it once. Nothing else changes: the registrations stay (gloo's own
``EPOLL_CTL_DEL`` when a pair closes still succeeds), only the group's own
epoll is touched (an fd number reused elsewhere is not registered there:
``ENOENT``, nothing done), and nothing is done where the epoll cannot be read
(no ``/proc``) or the platform's ``epoll_event`` layout is not known.

Edge-triggering is for abandoned groups only: a live group's loop relies on
being woken again while a message waits for its buffer to be posted. A group's
epolls are the ones its constructor opened (:func:`built`): gloo creates its
loop there, and keeps it for the life of the group. Where two groups were
built at once (a rendezvous given up while gloo was still connecting, then
the next one), which epoll is whose is not known, and neither is ever quieted.
To be sure an epoll is gloo's and not, say, an asyncio loop's opened meanwhile
by another thread, it must also watch a pipe (gloo's wake-up pipe; asyncio
wakes through a socket pair, libuv through an eventfd).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import platform
import socket
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

log = logging.getLogger("phalanx.runtime.gloo_loop")

T = TypeVar("T")

EPOLL_CTL_MOD = 3
EPOLLET = 1 << 31
TCP_LISTEN = 10


class _PackedEvent(ctypes.Structure):  # x86-64: struct epoll_event is packed (12 bytes)
    _pack_ = 1
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


class _AlignedEvent(ctypes.Structure):  # aarch64 and the others: 16 bytes, data aligned
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


_EVENT: type[ctypes.Structure] | None = {"x86_64": _PackedEvent, "aarch64": _AlignedEvent}.get(
    platform.machine())
_libc: ctypes.CDLL | None = None


def _epoll_ctl() -> Callable[..., int] | None:
    global _libc
    if _EVENT is None:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.epoll_ctl


def epolls() -> set[int]:
    """The epoll descriptors this process has open (empty without ``/proc``)."""
    found: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventpoll]":
                found.add(int(name))
        except OSError:
            continue
    return found


_lock = threading.Lock()
_tokens = itertools.count()
_building: dict[int, bool] = {}  # a construction under way -> whether another overlapped it
#: A gloo group -> the epolls of its loop (weakly: a group that is let go takes them along).
_loops: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def opened_epolls(make: Callable[[], T]) -> tuple[T, frozenset[int]]:
    """``make()``, and the epolls open after it that were not before; none when another
    call ran at the same time (whose is which cannot be told)."""
    with _lock:
        token = next(_tokens)
        overlapped = bool(_building)
        for other in _building:
            _building[other] = True
        _building[token] = overlapped
    try:
        before = epolls()
        made = make()
        after = epolls()
    finally:
        with _lock:
            overlapped = _building.pop(token)
    return made, frozenset() if overlapped else frozenset(after - before)


def built(make: Callable[[], T]) -> T:
    """``make()``: a gloo process group, whose loop's epolls :func:`quiet_group` will
    find."""
    group, loops = opened_epolls(make)
    if loops:
        _loops[group] = loops
    return group


def loops_of(group: Any) -> frozenset[int]:
    """The epolls of ``group``'s loop, if it was made by :func:`built` and they are known."""
    try:
        return _loops.get(group, frozenset())
    except TypeError:  # not weakly referenceable: not one of ours
        return frozenset()


def quiet_group(group: Any) -> int:
    """:func:`quiet` the loop of ``group``, an abandoned gloo group (made by :func:`built`;
    any other: nothing done)."""
    loops = loops_of(group)
    return quiet(loops) if loops else 0


def watched(epoll: int) -> Iterator[tuple[int, int, int]]:
    """``(fd, events, data)`` of each registration of ``epoll`` (its ``/proc`` fdinfo)."""
    try:
        with open(f"/proc/self/fdinfo/{epoll}") as info:
            lines = info.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if not fields or fields[0] != "tfd:":
            continue
        values = dict(zip(fields[0::2], fields[1::2], strict=False))
        try:
            yield int(values["tfd:"]), int(values["events:"], 16), int(values["data:"], 16)
        except (KeyError, ValueError):
            continue


def _kind(fd: int) -> str:
    """"pipe", "connection" (a TCP socket that is not listening) or "other"."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return "other"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if not stat.S_ISSOCK(mode):
        return "other"
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:  # not TCP (TCP_INFO unsupported), or gone meanwhile
        return "other"
    return "other" if state == TCP_LISTEN else "connection"


def quiet(loops: frozenset[int]) -> int:
    """Make the connections watched by ``loops`` (an abandoned group's gloo epolls)
    edge-triggered; how many were changed."""
    ctl = _epoll_ctl()
    if ctl is None or _EVENT is None:
        return 0
    changed = 0
    for epoll in loops:
        entries = list(watched(epoll))
        kinds = {fd: _kind(fd) for fd, _, _ in entries}
        if "pipe" not in kinds.values():  # not gloo's loop (its wake-up pipe): leave it
            continue
        for fd, events, data in entries:
            if kinds[fd] != "connection" or events & EPOLLET:
                continue
            event = _EVENT(events=events | EPOLLET, data=data)
            if ctl(epoll, EPOLL_CTL_MOD, fd, ctypes.byref(event)) == 0:
                changed += 1
            else:  # closed by gloo meanwhile: nothing to quiet
                log.debug("epoll %d fd %d: %s", epoll, fd, os.strerror(ctypes.get_errno()))
    return changed

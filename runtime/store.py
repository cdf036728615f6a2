"""The rendezvous store of a job's members only: torch's store protocol behind a proof.

Each replica hosts a store, and a generation rendezvouses on its rank 0's
(:func:`phalanx.runtime.group.arrive`): the member count, then gloo's exchange of
addresses. torch's ``TCPStore`` answers anyone who reaches its port, on every
interface: a process of another job could count itself in, read the keys
(``list_keys`` lists them all, so a secret key prefix hides nothing) or overwrite
gloo's addresses. A proxy in front of it would still leave its own port open on the
loopback, to every process of the node. So where the job has a secret
(:data:`~phalanx.schemas.environment.STORE_SECRET`, which its agents derive from the
cluster's key and give its ranks alone), a replica hosts this store instead:

* :class:`StoreServer` runs in the replica, on a port of the system's choice, and asks
  each connection to prove the job's secret before it answers anything: it sends a
  random challenge, the client answers ``HMAC(secret, challenge)`` with a challenge of
  its own, which the server answers in turn (so a member never talks to a store of
  another job either). A connection that fails is told so and closed; one silent for
  :data:`HANDSHAKE_TIMEOUT_S` is closed.
* :class:`StoreClient` is a ``torch.distributed.Store`` (gloo and ``PrefixStore`` use it
  as any store): ``set``, ``get``, ``add``, ``wait``, ``check``, ``compare_set``,
  ``delete_key``, ``num_keys``, one request at a time per connection. A refused proof
  raises :class:`StoreRefused` (a ``PermissionError``); a wait that times out raises
  ``DistStoreError``, a lost connection ``DistNetworkError``, as ``TCPStore`` does.

Limits: the secret is the job's, not the generation's (a replica of the job that is no
member of the generation can connect; it is of the same job); the channel is
authenticated at its start, not encrypted (what crosses it is where gloo listens, and a
count); a process that can read a rank's environment has the secret, which is why ranks
of other jobs run as other users (:mod:`phalanx.services.agent.identity`). gloo's own
connections between members are not authenticated.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch.distributed as dist

from phalanx.schemas.errors import PhalanxError

#: How long a new connection has to prove the secret.
HANDSHAKE_TIMEOUT_S = 5.0
#: Connections waiting to be accepted (the system caps it: ``net.core.somaxconn``).
BACKLOG = 65535
#: The most bytes of one frame (a request or an answer).
MAX_FRAME = 64 << 20
_NONCE = 32
_LENGTH = struct.Struct("!I")
_OK, _TIMEOUT, _ERROR, _REFUSED = 0, 1, 2, 3
_CLIENT, _SERVER = b"phalanx store client v1", b"phalanx store server v1"


class StoreRefused(PhalanxError, PermissionError):
    """The store (or the client) could not prove the job's secret: not this job's."""


def _proof(secret: bytes, side: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, side + nonce, hashlib.sha256).digest()


def _frame(body: object) -> bytes:
    data = msgspec.msgpack.encode(body)
    return _LENGTH.pack(len(data)) + data


def _send(sock: socket.socket, body: object) -> None:
    sock.sendall(_frame(body))


def _receive(sock: socket.socket) -> Any:
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise ConnectionError(f"a store frame of {length} bytes (at most {MAX_FRAME})")
    return msgspec.msgpack.decode(_exactly(sock, length))


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the store connection ended")
        data += chunk
    return bytes(data)


class StoreServer:
    """The store a replica hosts, answering only connections that prove ``secret``.

    One thread serves every connection (an event loop of its own, started here): a
    generation of 16,384 members holds as many connections, and its count-in sends
    two requests each. Each connection is a :class:`_Connection` reading frames as
    they come; a ``wait`` or ``get`` for keys not there yet is answered when the last
    of them is set, by the request that sets it (:class:`_Table`): no thread per
    connection, and no waiter woken by keys it does not wait for.

    Args:
        secret: the job's (:data:`~phalanx.schemas.environment.STORE_SECRET`).
        host: the address it listens on (every interface by default, as ``TCPStore``).
    """

    def __init__(self, secret: bytes, host: str = "0.0.0.0") -> None:
        self.secret = secret
        self.table = _Table()
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self.refused = 0  # connections that failed the proof
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,),
                                        name="phalanx-store", daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        loop = self._loop
        # Every member of a generation connects at once; past the backlog (asyncio's is
        # 100) a connection's last handshake packet is dropped and the member waits for
        # its retransmission: seconds.
        server = loop.run_until_complete(loop.create_server(
            lambda: _Connection(self), sock=self._listener, backlog=BACKLOG))
        started.set()
        loop.run_forever()
        server.close()
        loop.close()

    def close(self) -> None:
        """Stop: the listener closed, nothing answered after."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()


class _Wait:
    """A ``wait`` or ``get`` of one connection, for keys not all set yet."""

    def __init__(self, missing: set[str], answer: Callable[[bool], None]) -> None:
        self.missing = missing
        self.answer = answer  # called once, with whether it timed out
        self.timer: asyncio.TimerHandle | None = None


class _Table:
    """The keys of a :class:`StoreServer` and the waits on keys not set yet. Used from
    the server's loop alone."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._waits: dict[str, list[_Wait]] = {}  # key -> the waits that still miss it

    def answer(self, request: list[Any],
               later: Callable[[list[Any]], None]) -> list[Any] | _Wait:
        """The answer to ``request``, or the wait it is, which ``later`` answers.

        Raises:
            TypeError, IndexError, KeyError, ValueError: a malformed request.
        """
        op, args = request[0], request[1:]
        data = self.data
        if op == "set":
            self._set(args[0], args[1])
            return [_OK, None]
        if op == "add":
            value = int(data.get(args[0], b"0")) + int(args[1])
            self._set(args[0], str(value).encode())
            return [_OK, value]
        if op == "compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._set(key, desired)
                return [_OK, desired]
            return [_OK, expected if current is None else current]
        if op in ("get", "wait"):
            keys = [args[0]] if op == "get" else list(args[0])
            seconds = float(args[-1])

            def arrived() -> list[Any]:
                return [_OK, data[args[0]] if op == "get" else None]

            missing = {k for k in keys if k not in data}
            if not missing:
                return arrived()
            wait = _Wait(missing, lambda timed_out: later(
                [_TIMEOUT, f"wait for {keys} timed out after {seconds:g} s"] if timed_out
                else arrived()))
            for key in missing:
                self._waits.setdefault(key, []).append(wait)
            wait.timer = asyncio.get_running_loop().call_later(seconds, self._expire, wait)
            return wait
        if op == "check":
            return [_OK, all(k in data for k in args[0])]
        if op == "delete_key":
            return [_OK, data.pop(args[0], None) is not None]
        if op == "num_keys":
            return [_OK, len(data)]
        return [_ERROR, f"unknown store operation {op!r}"]

    def _set(self, key: str, value: bytes) -> None:
        self.data[key] = value
        for wait in self._waits.pop(key, ()):
            wait.missing.discard(key)
            if not wait.missing:
                self.drop(wait)
                wait.answer(False)

    def _expire(self, wait: _Wait) -> None:
        self.drop(wait)
        wait.answer(True)

    def drop(self, wait: _Wait) -> None:
        """Forget ``wait`` (answered, timed out, or its connection gone)."""
        if wait.timer is not None:
            wait.timer.cancel()
        for key in wait.missing:
            waits = self._waits.get(key, [])
            if wait in waits:
                waits.remove(wait)
            if not waits:
                self._waits.pop(key, None)


class _Connection(asyncio.Protocol):
    """One member's connection: the proof first, then one request at a time, each
    answered in order (a request that waits holds the ones behind it, as its client
    sends none until it is answered)."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.proven = False
        self.waiting: _Wait | None = None
        self.transport: asyncio.Transport | None = None
        self.challenge = b""
        self.silent: asyncio.TimerHandle | None = None  # closes a connection left unproven

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.challenge = os.urandom(_NONCE)
        transport.write(self.challenge)
        self.silent = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S,
                                                            transport.close)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._serve()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.silent is not None:
            self.silent.cancel()
        if self.waiting is not None:
            self.server.table.drop(self.waiting)
            self.waiting = None

    def _serve(self) -> None:
        transport, buffer = self.transport, self.buffer
        assert transport is not None
        while self.waiting is None and not transport.is_closing():
            if not self.proven:
                if len(buffer) < 32 + _NONCE:
                    return
                proof, theirs = bytes(buffer[:32]), bytes(buffer[32:32 + _NONCE])
                del buffer[:32 + _NONCE]
                if self.silent is not None:
                    self.silent.cancel()
                if not hmac.compare_digest(proof, _proof(self.server.secret, _CLIENT,
                                                         self.challenge)):
                    self.server.refused += 1
                    transport.write(_frame([_REFUSED, "not a member of this job: the "
                                            "store's secret was not proven"]))
                    transport.close()
                    return
                transport.write(_frame([_OK, _proof(self.server.secret, _SERVER, theirs)]))
                self.proven = True
                continue
            if len(buffer) < _LENGTH.size:
                return
            (length,) = _LENGTH.unpack_from(buffer)
            if length > MAX_FRAME:
                transport.close()
                return
            if len(buffer) < _LENGTH.size + length:
                return
            body = bytes(buffer[_LENGTH.size:_LENGTH.size + length])
            del buffer[:_LENGTH.size + length]
            try:
                request = msgspec.msgpack.decode(body)
                answer = self.server.table.answer(request, self._answer_later)
            except msgspec.DecodeError:
                transport.close()  # not speaking the protocol
                return
            except (TypeError, IndexError, KeyError, ValueError) as exc:
                answer = [_ERROR, f"malformed store request {request!r:.200}: {exc!r}"]
            if isinstance(answer, _Wait):
                self.waiting = answer
                return
            transport.write(_frame(answer))

    def _answer_later(self, answer: list[Any]) -> None:
        self.waiting = None
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(_frame(answer))
            self._serve()


#: Every client not closed: torch holds a Python store by its C++ half alone (a
#: ``PrefixStore`` over it, a group given up that still waits in it), and the C++ half of a
#: collected one has no methods left ("pure virtual function"). A client lives until
#: :meth:`StoreClient.close`, as torch's own ``TCPStore`` lives as long as anything holds it.
_open: set[StoreClient] = set()


class StoreClient(dist.Store):
    """A connection to a :class:`StoreServer`, proving ``secret``; a torch store, kept
    until :meth:`close` (see :data:`_open`).

    Raises (constructing):
        StoreRefused: the server refused the proof, or could not prove the secret back.
        DistNetworkError: nothing answered at ``host``:``port`` within ``timeout``.
    """

    def __init__(self, host: str, port: int, secret: bytes,
                 timeout: datetime.timedelta) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                self._sock = socket.create_connection(
                    (host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:  # not listening yet, as TCPStore's client retries
                if time.monotonic() >= deadline:
                    raise dist.DistNetworkError(
                        f"no store at {host}:{port} within {timeout}: {exc}") from None
                time.sleep(0.05)
        try:
            # The connect's own deadline, not the server's bound on a silent client: a
            # store that thousands of members connect to at once answers each in turn.
            self._sock.settimeout(max(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic()))
            challenge = _exactly(self._sock, _NONCE)
            mine = os.urandom(_NONCE)
            self._sock.sendall(_proof(secret, _CLIENT, challenge) + mine)
            status, value = _receive(self._sock)
            if status != _OK:
                raise StoreRefused(f"the store at {host}:{port} refused this connection: "
                                   f"{value}")
            if not hmac.compare_digest(value, _proof(secret, _SERVER, mine)):
                raise StoreRefused(f"the store at {host}:{port} is not this job's: it "
                                   "could not prove the job's secret")
            self._sock.settimeout(None)
            _open.add(self)
        except (OSError, ConnectionError, ValueError, msgspec.DecodeError) as exc:
            self._sock.close()
            if isinstance(exc, StoreRefused):
                raise
            raise StoreRefused(f"the store at {host}:{port} ended the connection before "
                               f"the proof was done ({exc}): not this job's") from None

    def _call(self, *request: Any) -> Any:
        with self._lock:
            try:
                _send(self._sock, list(request))
                status, value = _receive(self._sock)
            except (OSError, ConnectionError, ValueError, msgspec.DecodeError) as exc:
                raise dist.DistNetworkError(f"the store connection failed: {exc}") from None
        if status == _TIMEOUT:
            raise dist.DistStoreError(value)
        if status != _OK:
            raise dist.DistError(value)
        return value

    def _seconds(self, timeout: datetime.timedelta | None = None) -> float:
        return (timeout or self._timeout).total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        value: bytes = self._call("get", key, self._seconds())
        return value

    def add(self, key: str, value: int) -> int:
        result: int = self._call("add", key, value)
        return result

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        def raw(v: bytes | str) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        result: bytes = self._call("compare_set", key, raw(expected), raw(desired))
        return result

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", list(keys), self._seconds(timeout))

    def check(self, keys: list[str]) -> bool:
        result: bool = self._call("check", list(keys))
        return result

    def delete_key(self, key: str) -> bool:
        result: bool = self._call("delete_key", key)
        return result

    def num_keys(self) -> int:
        result: int = self._call("num_keys")
        return result

    def close(self) -> None:
        """Close the connection (what still holds the store then gets errors from it)."""
        _open.discard(self)
        with contextlib.suppress(OSError):
            self._sock.close()

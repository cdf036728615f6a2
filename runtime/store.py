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

import contextlib
import datetime
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Any

import msgspec
import torch.distributed as dist

from phalanx.schemas.errors import PhalanxError

#: How long a new connection has to prove the secret.
HANDSHAKE_TIMEOUT_S = 5.0
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


def _send(sock: socket.socket, body: object) -> None:
    data = msgspec.msgpack.encode(body)
    sock.sendall(_LENGTH.pack(len(data)) + data)


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

    Args:
        secret: the job's (:data:`~phalanx.schemas.environment.STORE_SECRET`).
        host: the address it listens on (every interface by default, as ``TCPStore``).
    """

    def __init__(self, secret: bytes, host: str = "0.0.0.0") -> None:
        self.secret = secret
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self.refused = 0  # connections that failed the proof
        threading.Thread(target=self._accept, name="phalanx-store", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(connection,), name="phalanx-store-conn",
                             daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.settimeout(HANDSHAKE_TIMEOUT_S)
                if not self._handshake(connection):
                    return
                connection.settimeout(None)
                while True:
                    request = _receive(connection)
                    _send(connection, self._answer(request))
            except (OSError, ConnectionError, ValueError, msgspec.DecodeError):
                return  # gone, timed out, or not speaking the protocol

    def _handshake(self, connection: socket.socket) -> bool:
        challenge = os.urandom(_NONCE)
        connection.sendall(challenge)
        proof, theirs = _exactly(connection, 32), _exactly(connection, _NONCE)
        if not hmac.compare_digest(proof, _proof(self.secret, _CLIENT, challenge)):
            self.refused += 1
            _send(connection, [_REFUSED, "not a member of this job: the store's secret "
                               "was not proven"])
            return False
        _send(connection, [_OK, _proof(self.secret, _SERVER, theirs)])
        return True

    def _answer(self, request: list[Any]) -> list[Any]:
        op, args = request[0], request[1:]
        data, changed = self._data, self._changed
        with changed:
            if op == "set":
                data[args[0]] = args[1]
                changed.notify_all()
                return [_OK, None]
            if op == "add":
                value = int(data.get(args[0], b"0")) + int(args[1])
                data[args[0]] = str(value).encode()
                changed.notify_all()
                return [_OK, value]
            if op == "compare_set":
                key, expected, desired = args
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = desired
                    changed.notify_all()
                    return [_OK, desired]
                return [_OK, expected if current is None else current]
            if op in ("get", "wait"):
                keys = [args[0]] if op == "get" else args[0]
                if not changed.wait_for(lambda: all(k in data for k in keys), args[-1]):
                    return [_TIMEOUT, f"wait for {keys} timed out after {args[-1]:g} s"]
                return [_OK, data[args[0]] if op == "get" else None]
            if op == "check":
                return [_OK, all(k in data for k in args[0])]
            if op == "delete_key":
                return [_OK, data.pop(args[0], None) is not None]
            if op == "num_keys":
                return [_OK, len(data)]
        return [_ERROR, f"unknown store operation {op!r}"]


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
            self._sock.settimeout(HANDSHAKE_TIMEOUT_S)
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

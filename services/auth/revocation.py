"""Revocation: which open rank connections the servers must close, because their job ended.

The auth callout (:mod:`.callout`) refuses an ended job's ranks a *new* connection;
one admitted before the job ended stays open until its user JWT expires, which is
when its token does. The revoker closes it sooner. It asks every server of the
cluster, from a user of the servers' system account, for its connections
(``$SYS.REQ.SERVER.PING.CONNZ`` with ``auth``: each server answers with its own),
reads which job's ranks each one is — the callout names an admitted connection's user
``rank-<job>`` (:func:`~.roles.identity`), which the server reports as the
connection's ``authorized_user`` — and has each connection whose job the callout would
refuse now (:func:`~.callout.job_refusal`: ended, or no record) closed by the server
that holds it (``$SYS.REQ.SERVER.<id>.KICK`` with its ``cid``). The rank's client then
reconnects, and the callout refuses it, naming why.

Every other connection is left alone: the static identities' users are their public
keys (``U…``), never ``rank-…``. Pure: the replies and the jobs' states are arguments;
:mod:`~phalanx.services.callout.revoker` asks and kicks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from phalanx.schemas.errors import SubjectError
from phalanx.schemas.messages import JobState
from phalanx.services.auth.callout import Refusal, job_refusal
from phalanx.services.auth.roles import Role, identity

#: The system account subject every server answers a connection listing on.
CONNZ_ALL = "$SYS.REQ.SERVER.PING.CONNZ"
#: What a connection's user is named once the callout admitted it as a job's ranks.
RANK_USER_PREFIX = f"{Role.RANK.value}-"


def connz_server(server_id: str) -> str:
    """The subject on which the server ``server_id`` alone lists its connections."""
    return f"$SYS.REQ.SERVER.{server_id}.CONNZ"


def kick_subject(server_id: str) -> str:
    """The subject on which the server ``server_id`` closes one of its connections."""
    return f"$SYS.REQ.SERVER.{server_id}.KICK"


def connz_request(*, offset: int = 0, job_id: str | None = None) -> bytes:
    """A connection listing request: open client connections with their users, from
    ``offset`` on; only ``job_id``'s ranks when given."""
    options: dict[str, Any] = {"auth": True, "offset": offset}  # open ones (the default)
    if job_id is not None:
        options["user"] = identity(Role.RANK, job_id)
    return json.dumps(options).encode()


def kick_request(cid: int) -> bytes:
    return json.dumps({"cid": cid}).encode()


def kick_error(reply: bytes) -> str | None:
    """What a server's answer to :func:`kick_request` says went wrong, or None."""
    try:
        error = json.loads(reply).get("error")
    except (ValueError, AttributeError):
        return f"an answer that does not read: {reply[:200]!r}"
    if not error:
        return None
    return str(error.get("description", error) if isinstance(error, dict) else error)


class ConnzError(ValueError):
    """A server's answer to a listing request that does not read, or is an error."""


@dataclasses.dataclass(frozen=True)
class Connection:
    """One client connection as a server reports it."""

    server_id: str
    cid: int
    user: str
    """Its ``authorized_user``: ``rank-<job>`` for a job's ranks."""

    @property
    def job_id(self) -> str | None:
        """The job whose ranks this connection is, or None (a static identity)."""
        job_id = self.user.removeprefix(RANK_USER_PREFIX)
        try:  # the name the callout gives a job's ranks, and no other
            return job_id if identity(Role.RANK, job_id) == self.user else None
        except SubjectError:
            return None


@dataclasses.dataclass(frozen=True)
class Page:
    """One server's answer: some of its connections, and how many it has in all."""

    server_id: str
    connections: list[Connection]
    offset: int
    total: int

    @property
    def next_offset(self) -> int | None:
        """Where the server's next page starts, or None after its last."""
        end = self.offset + len(self.connections)
        return end if self.connections and end < self.total else None


def read_page(reply: bytes) -> Page:
    """A server's answer to :func:`connz_request`.

    Raises:
        ConnzError: not JSON, an error answer (``error``), or a field missing.
    """
    try:
        body = json.loads(reply)
        error = body.get("error")
    except (ValueError, AttributeError):
        raise ConnzError(f"a connection listing that does not read: {reply[:200]!r}") from None
    if error:
        raise ConnzError(f"the server refused the listing: {error}")
    try:
        data = body["data"]
        server_id = str(body["server"]["id"])
        connections = [Connection(server_id, int(c["cid"]), str(c.get("authorized_user", "")))
                       for c in data.get("connections") or []]
        return Page(server_id, connections, int(data.get("offset", 0)),
                    int(data.get("total", len(connections))))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConnzError(f"a connection listing that does not read: {exc!r}") from None


@dataclasses.dataclass(frozen=True)
class Kick:
    """Close one connection: its job's ranks may no longer be on the bus."""

    connection: Connection
    job_id: str
    refusal: Refusal
    message: str


def jobs_of(connections: Iterable[Connection]) -> set[str]:
    """The jobs whose ranks hold any of ``connections`` (their states are needed)."""
    return {c.job_id for c in connections if c.job_id is not None}


def to_close(connections: Iterable[Connection],
             states: Mapping[str, JobState | None]) -> list[Kick]:
    """The connections of jobs the callout would refuse now, given each job's state
    (None: no record). A job missing from ``states`` (its record could not be read)
    keeps its connections until a later look."""
    kicks = []
    for connection in connections:
        job_id = connection.job_id
        if job_id is None or job_id not in states:
            continue
        refused = job_refusal(job_id, states[job_id])
        if refused is not None:
            kicks.append(Kick(connection, job_id, *refused))
    return kicks

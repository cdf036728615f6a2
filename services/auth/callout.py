"""The auth callout's rule: which connection gets in as which job's ranks, and with what.

With ``authorization.auth_callout`` in its config (nats-server 2.10+), the server
hands every connection not listed in ``auth_users`` to a callout service: it
publishes an *authorization request* on ``$SYS.REQ.USER.AUTH``, a JWT it signs with
its own server key (``N…``) whose subject is the configured issuer's account key,
audience ``nats-authorization-request``, and whose ``nats`` claims name the server
(``server_id.id``), a user key it made for this connection (``user_nkey``) and what
the client sent in its CONNECT (``connect_opts``, the token as ``auth_token``). The
callout answers with an *authorization response*, a JWT signed by the issuer's
account key (``A…``) whose subject is that user key and audience that server: either
``nats.jwt``, a user JWT (issuer the same account key, subject the user key, audience
the account the client lands in — ``$G``, the only one of a config without
accounts — with its permissions and expiry), or ``nats.error``, which refuses the
connection. The server checks every one of those names, so a response cannot be
replayed for another connection or another server.

The rule here: the token must be a rank token (:mod:`.rank_token`) made with the
cluster's key and unexpired, and its job must be known and not ended (the caller
reads the job's record). Then the connection is the job's ranks, ``rank-<job>``,
with exactly :func:`~phalanx.services.auth.roles.permissions` of the rank role for
that job — the permissions bare metal writes into ``nats.conf`` for the same
identity, so a subject is spelled in one place — until the token expires (or
``connection_ttl_s`` passes, when given, whichever is first). At that expiry the
server closes the connection: a connection of a job that ended meanwhile ends then,
at the latest, and any reconnection (after a server restart, a network fault) is
asked about again and refused. Every refusal has a :class:`Refusal` and a one-line
message, which the response carries to the server's log.

An open connection of a job that ended is closed by the revoker
(:mod:`.revocation`, which refuses by :func:`job_refusal`, the rule here), through the
servers' system account; where none runs, it lasts until its token expires. A
``connection_ttl_s`` shorter than the token would cap it too, but nats-py (the ranks'
client) treats the server's "User Authentication Expired" as final and does not
reconnect: a rank would lose the bus for good at the cap. So phalanx leaves it unset
and bounds a connection by the token (``PHALANX_AGENT_RANK_TOKEN_TTL_S``).

:func:`examine` reads the request and the token (the caller then looks the job up);
:func:`decide` returns the response. Pure: the clock and the job's state are
arguments.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from phalanx.schemas.messages import JobState
from phalanx.services.auth import nats_jwt, rank_token, roles
from phalanx.services.auth.roles import Role

#: The subject the server sends authorization requests on.
SUBJECT = "$SYS.REQ.USER.AUTH"
#: The audience of every authorization request.
REQUEST_AUDIENCE = "nats-authorization-request"
#: The account connections land in where the server config defines none.
GLOBAL_ACCOUNT = "$G"
#: How far the request's own expiry may lie in the past before it is refused: the
#: server sets it to its auth timeout (seconds), and pods' clocks differ a little.
CLOCK_SKEW_S = 60.0


class Refusal(enum.StrEnum):
    """Why a connection was refused."""

    BAD_REQUEST = "bad_request"
    """The request is not an authorization request for this issuer, properly signed."""
    NO_TOKEN = "no_token"
    """The client sent no token (nor is it one of the static identities)."""
    BAD_TOKEN = "bad_token"
    """The token is malformed or not made with the cluster's rank token key."""
    EXPIRED_TOKEN = "expired_token"
    UNKNOWN_JOB = "unknown_job"
    """No record of the token's job."""
    ENDED_JOB = "ended_job"
    """The token's job finished, failed or was cancelled."""
    UNAVAILABLE = "unavailable"
    """The job's record could not be read (the caller sets it)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What the server asked: the connection's fresh user key, on which server."""

    server_id: str
    user_nkey: str
    client: str
    """Who connected, for logs: ``<host> (<name>)``."""


@dataclasses.dataclass(frozen=True)
class Examined:
    """A request read, and its token checked: the job to look up, or why not."""

    request: Request | None
    """None: the request itself did not read (then no response can address it)."""
    token: rank_token.RankToken | None = None
    refusal: Refusal | None = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Decision:
    """The answer to one request."""

    response: bytes
    """What to reply: a response JWT, or nothing where the request did not read (the
    server refuses the connection at an empty reply)."""
    job_id: str | None
    """The job whose ranks the connection is, or None when refused."""
    expires_at: int | None = None
    refusal: Refusal | None = None
    message: str = ""


def examine(request_jwt: bytes | str, *, issuer: str, key: bytes, now: float) -> Examined:
    """Read an authorization request for ``issuer`` (the callout's account key) and
    verify the rank token in it with ``key``."""
    try:
        text = request_jwt.decode() if isinstance(request_jwt, bytes) else request_jwt
        request, token = _read_request(text, issuer, now)
    except (nats_jwt.JWTError, UnicodeDecodeError) as exc:
        return Examined(None, refusal=Refusal.BAD_REQUEST, message=str(exc))
    if not token:
        return Examined(request, refusal=Refusal.NO_TOKEN,
                        message="no token: a rank connects with its job's rank token")
    try:
        return Examined(request, token=rank_token.verify(key, token, now=now))
    except rank_token.TokenError as exc:
        return Examined(request, refusal=Refusal.EXPIRED_TOKEN if exc.expired
                        else Refusal.BAD_TOKEN, message=str(exc))


def _read_request(text: str, issuer: str, now: float) -> tuple[Request, str | None]:
    claims = nats_jwt.decode(text, issuer_kind=nats_jwt.SERVER)
    nats = claims.get("nats")
    if not isinstance(nats, dict) or nats.get("type") != "authorization_request":
        raise nats_jwt.JWTError("not an authorization request")
    if claims.get("sub") != issuer:
        raise nats_jwt.JWTError(f"the request is for issuer {claims.get('sub')!r}, not "
                                f"this callout's {issuer}")
    if claims.get("aud") != REQUEST_AUDIENCE:
        raise nats_jwt.JWTError(f"the request's audience is {claims.get('aud')!r}")
    expires = claims.get("exp")
    if isinstance(expires, int) and expires and expires + CLOCK_SKEW_S < now:
        raise nats_jwt.JWTError(f"the request expired at {expires}")
    user = nats.get("user_nkey")
    if not nats_jwt.is_public_key(user, nats_jwt.USER):
        raise nats_jwt.JWTError(f"the request's user_nkey {user!r} is not a user key")
    server = nats.get("server_id")
    server_id = server.get("id") if isinstance(server, dict) else None
    if not nats_jwt.is_public_key(server_id, nats_jwt.SERVER):
        raise nats_jwt.JWTError(f"the request's server_id.id {server_id!r} is not a server key")
    options = nats.get("connect_opts")
    token = options.get("auth_token") if isinstance(options, dict) else None
    info = nats.get("client_info")
    info = info if isinstance(info, dict) else {}
    client = f"{info.get('host', '?')} ({info.get('name', '')})"
    return Request(str(server_id), str(user), client), \
        token if isinstance(token, str) else None


def decide(examined: Examined, job_state: JobState | None, *, issuer_seed: bytes, now: float,
           connection_ttl_s: float | None = None, account: str = GLOBAL_ACCOUNT) -> Decision:
    """The response to an examined request, given its token's job's state (None: no
    record of the job; ignored when the token was refused already).

    Args:
        examined: from :func:`examine`.
        job_state: the state of ``examined.token.job_id``.
        issuer_seed: the seed of the callout's account key, which signs responses and
            user JWTs.
        now: Unix seconds.
        connection_ttl_s: the longest an admitted connection lives before the server
            closes it; None: until the token expires.
        account: the account connections land in.
    """
    request = examined.request
    if request is None:
        return Decision(b"", None, refusal=examined.refusal, message=examined.message)
    refusal, message = examined.refusal, examined.message
    token = examined.token
    if refusal is None and token is not None:
        refusal, message = job_refusal(token.job_id, job_state) or (None, "")
    if refusal is not None or token is None:
        refused = refusal or Refusal.BAD_TOKEN
        return Decision(_response(request, issuer_seed, now, error=f"{refused}: {message}"),
                        None, refusal=refused, message=message)
    expires_at = token.expires_at if connection_ttl_s is None \
        else min(token.expires_at, int(now + connection_ttl_s))
    user = user_claims(request.user_nkey, token.job_id, expires_at=expires_at, account=account)
    user_jwt = nats_jwt.encode(user, issuer_seed, issued_at=int(now))
    return Decision(_response(request, issuer_seed, now, user_jwt=user_jwt), token.job_id,
                    expires_at=expires_at)


def job_refusal(job_id: str, state: JobState | None) -> tuple[Refusal, str] | None:
    """Why ``job_id``'s ranks may not be on the bus, given its record's state (None: no
    record), or None while the job is live. The callout refuses a connection for it, and
    the revoker (:mod:`.revocation`) closes one already open."""
    if state is None:
        return Refusal.UNKNOWN_JOB, f"no job {job_id}"
    if state.terminal:
        return Refusal.ENDED_JOB, f"job {job_id} is {state.value}"
    return None


def user_claims(user_nkey: str, job_id: str, *, expires_at: int,
                account: str = GLOBAL_ACCOUNT) -> dict[str, Any]:
    """The claims of the user JWT that makes ``user_nkey``'s connection ``job_id``'s ranks
    in ``account`` until ``expires_at``."""
    granted = roles.permissions(Role.RANK, job_id)
    assert not granted.responds  # a rank answers no requests: no "resp" to write
    return {"sub": user_nkey, "aud": account, "exp": expires_at,
            "name": roles.identity(Role.RANK, job_id),
            "nats": {"pub": {"allow": sorted(granted.publish)},
                     "sub": {"allow": sorted(granted.subscribe)},
                     # nats-io/jwt's "no limit" on subscriptions, data and payload
                     "subs": -1, "data": -1, "payload": -1,
                     "type": "user", "version": 2}}


def _response(request: Request, issuer_seed: bytes, now: float, *, user_jwt: str = "",
              error: str = "") -> bytes:
    nats: dict[str, Any] = {"jwt": user_jwt} if user_jwt else {"error": error}
    nats.update(type="authorization_response", version=2)
    claims = {"sub": request.user_nkey, "aud": request.server_id, "nats": nats}
    return nats_jwt.encode(claims, issuer_seed, issued_at=int(now)).encode()

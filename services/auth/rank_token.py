"""Rank tokens: what an agent gives a job's ranks so the auth callout admits them as the job.

On Kubernetes the NATS server's config is the chart's and does not change as jobs
come and go, so a job's ranks cannot have an NKEY user of their own in it. Instead an
agent *mints* a token for the job when it starts a rank, and the rank connects with
it (``PHALANX_NATS_TOKEN``); the server asks the auth callout
(:mod:`~phalanx.services.auth.callout`), which verifies the token and places the
connection under exactly the permissions of the job's rank role.

A token is ``phx1.<job>.<expires>.<nonce>.<mac>``: the job id (a subject token, so
it holds no dot), when it expires (Unix seconds), 16 random bytes (hex) that make
every token unique, and an HMAC-SHA256, base64url, of everything before it under
the cluster's *rank token key* — 32 or more random bytes that the agents (which
mint) and the callout (which verifies) share, and nothing else holds (a file of the
auth directory, ``keys/rank-token.key``, mounted from a Secret; read like the
replication key, :func:`~phalanx.services.auth.replication_key.load_key`).

Trust: whoever holds the key can mint a token for *any* job. That is the trust
agents already have: on bare metal they read every job's seed from the auth
directory's ``ranks/`` (docs/security.md, "Agents are trusted with the identities of
the jobs they may run"). A rank holds only its own job's token, which names that job
alone; it never holds the key. A token leaks nothing but its own job's rank role,
and only while the job is live (the callout refuses an ended job) and the token
unexpired. Pure: the clock and the nonce are arguments.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac

from phalanx.schemas import subjects
from phalanx.services.auth.errors import AuthError

VERSION = "phx1"
#: The shortest key accepted, as for the replication key.
KEY_BYTES = 32
#: Bytes of randomness in each token.
NONCE_BYTES = 16


class TokenError(AuthError, ValueError):
    """A rank token that is malformed, forged (its MAC is not the key's) or expired."""

    def __init__(self, message: str, *, expired: bool = False) -> None:
        super().__init__(message)
        self.expired = expired


@dataclasses.dataclass(frozen=True)
class RankToken:
    """What a verified token says."""

    job_id: str
    expires_at: int
    """Unix seconds after which the token admits no one."""


def _mac(key: bytes, body: str) -> str:
    digest = hmac.new(key, body.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def mint(key: bytes, job_id: str, *, now: float, ttl_s: float, nonce: bytes) -> str:
    """A token admitting ``job_id``'s ranks until ``now + ttl_s``.

    Raises:
        ValueError: the key is shorter than :data:`KEY_BYTES`, ``ttl_s`` is not
            positive, the nonce is not :data:`NONCE_BYTES` long, or ``job_id`` is not a
            valid subject token.
    """
    if len(key) < KEY_BYTES:
        raise ValueError(f"a rank token key has at least {KEY_BYTES} bytes, got {len(key)}")
    if not ttl_s > 0:
        raise ValueError(f"a rank token's ttl_s must be > 0, got {ttl_s}")
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a rank token's nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
    body = f"{VERSION}.{subjects.token(job_id, 'job id')}.{int(now + ttl_s)}.{nonce.hex()}"
    return f"{body}.{_mac(key, body)}"


def verify(key: bytes, token: str, *, now: float) -> RankToken:
    """What ``token`` says, if ``key`` made it and it has not expired at ``now``.

    Raises:
        TokenError: malformed, not made with ``key``, or expired (``expired`` set).
    """
    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 5 or parts[0] != VERSION:
        raise TokenError(f"not a rank token (expected {VERSION}.<job>.<expires>.<nonce>.<mac>)")
    _, job_id, expires, nonce, mac = parts
    if not hmac.compare_digest(_mac(key, ".".join(parts[:4])), mac):
        raise TokenError("the rank token's MAC is not the cluster's rank token key's")
    try:  # made with the key, so well formed unless the key minted nonsense
        expires_at = int(expires)
        subjects.token(job_id, "job id")
        bytes.fromhex(nonce)
    except (ValueError, binascii.Error):
        raise TokenError("a malformed rank token") from None
    if now >= expires_at:
        raise TokenError(f"the rank token of job {job_id} expired at {expires_at} (now "
                         f"{int(now)})", expired=True)
    return RankToken(job_id, expires_at)

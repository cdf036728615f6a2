"""NATS JWTs: claims signed with an ed25519 nkey, as nats-server writes and reads them.

A NATS JWT is three base64url parts without padding, joined by dots: the header
``{"typ":"JWT","alg":"ed25519-nkey"}``, the claims (a JSON object), and the
ed25519 signature, by the key the claims name as ``iss``, of the first two parts
as they stand (``<header>.<claims>``). The issuer is an nkey public key: 56
base32 characters encoding a prefix byte (``N`` a server, ``A`` an account, ``U``
a user), the 32-byte ed25519 key and a CRC-16 of both. ``jti`` is the base32
(no padding) SHA-512/256 digest of the standard claims (``aud``, ``exp``, ``iat``,
``iss``, ``name``, ``nbf``, ``sub``, in that order, empty ones left out) written
before ``jti`` is set — what nats-io/jwt v2 computes, so a JWT made here is one the
server would have made itself.

:func:`decode` trusts nothing: a token that is not three parts, a header of another
type or algorithm, claims that are not an object, an issuer that is not a valid key
of the expected kind (or not *the* expected key), and a signature that does not
verify are each refused with :class:`JWTError` saying which. It does not judge
times: the caller holds the clock. Pure: no I/O, no clock.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

from phalanx.services.auth.errors import AuthError

#: The header of every JWT written here (and the one nats-server writes).
HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
#: The standard claims in the order nats-io/jwt's ``ClaimsData`` declares them: the
#: ``jti`` digest is over exactly these.
_STANDARD = ("aud", "exp", "jti", "iat", "iss", "name", "nbf", "sub")
#: The longest token read (nats-io/jwt's ``MaxTokenSize``).
MAX_TOKEN_BYTES = 1024 * 1024

#: Prefix bytes of the nkey kinds used here.
SERVER = nkeys.PREFIX_BYTE_SERVER
ACCOUNT = nkeys.PREFIX_BYTE_ACCOUNT
USER = nkeys.PREFIX_BYTE_USER
_KINDS = {SERVER: "server", ACCOUNT: "account", USER: "user"}
_ARTICLES = {SERVER: "a server", ACCOUNT: "an account", USER: "a user"}


class JWTError(AuthError, ValueError):
    """A JWT (or an nkey in one) that is malformed, mis-signed or from the wrong issuer."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise JWTError(f"the {what} is not base64url") from None


def public_key_bytes(public_key: str, kind: int) -> bytes:
    """The raw ed25519 key of the nkey ``public_key``, which must be of ``kind`` (a prefix
    byte: :data:`SERVER`, :data:`ACCOUNT`, :data:`USER`).

    Raises:
        JWTError: not a public nkey of that kind (bad base32, length, prefix or CRC).
    """
    name = _KINDS.get(kind, str(kind))
    if not isinstance(public_key, str) or len(public_key) != 56:
        raise JWTError(f"{public_key!r} is not a public {name} nkey")
    try:
        raw = base64.b32decode(public_key)
    except (binascii.Error, ValueError):
        raise JWTError(f"{public_key!r} is not a public {name} nkey") from None
    body, crc = raw[:-2], int.from_bytes(raw[-2:], "little")
    if nkeys.crc16(bytearray(body)) != crc:
        raise JWTError(f"{public_key!r} fails its checksum")
    if body[0] != kind:
        raise JWTError(f"{public_key!r} is not a {name} key")
    return bytes(body[1:])


def is_public_key(public_key: object, kind: int) -> bool:
    """Whether ``public_key`` is a valid public nkey of ``kind``."""
    try:
        public_key_bytes(public_key, kind)  # type: ignore[arg-type]
    except JWTError:
        return False
    return True


def public_key_of(seed: bytes, kind: int | None = None) -> str:
    """The public key of the nkey ``seed`` (which must be of ``kind``, when given).

    Raises:
        JWTError: ``seed`` is not an nkey seed (of that kind).
    """
    try:
        prefix, _ = nkeys.decode_seed(bytearray(seed.strip()))
        public = str(nkeys.from_seed(bytearray(seed.strip())).public_key.decode())
    except (nkeys.NkeysError, ValueError, TypeError):
        raise JWTError("not an nkey seed") from None
    if kind is not None and prefix != kind:
        raise JWTError(f"not the seed of {_ARTICLES.get(kind, str(kind))} key")
    return public


def jti(claims: Mapping[str, Any]) -> str:
    """The ``jti`` nats-io/jwt gives ``claims``: a digest of its standard claims."""
    standard = {k: claims[k] for k in _STANDARD if k != "jti" and claims.get(k)}
    digest = hashlib.new("sha512_256", json.dumps(standard, separators=(",", ":"))
                         .encode()).digest()
    return base64.b32encode(digest).rstrip(b"=").decode()


def encode(claims: Mapping[str, Any], seed: bytes, *, issued_at: int) -> str:
    """``claims`` as a JWT signed with ``seed``, which it names as ``iss``, issued at
    ``issued_at`` (Unix seconds), with its ``jti``.

    Raises:
        JWTError: ``seed`` is not an nkey seed, or ``claims`` has no ``sub``.
    """
    if not claims.get("sub"):
        raise JWTError("a JWT needs a subject (sub)")
    try:
        signer = nkeys.from_seed(bytearray(seed))
    except (nkeys.NkeysError, ValueError, TypeError):
        raise JWTError("not an nkey seed") from None
    body: dict[str, Any] = {k: v for k, v in claims.items() if k != "jti"}
    body.update(iss=signer.public_key.decode(), iat=issued_at)
    body = {"jti": jti(body), **body}
    signed = f"{_b64(_json(HEADER))}.{_b64(_json(body))}"
    return f"{signed}.{_b64(bytes(signer.sign(signed.encode())))}"


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def decode(token: str, *, issuer_kind: int, issuer: str | None = None) -> dict[str, Any]:
    """The claims of ``token``, once its header, its issuer and its signature check out.

    Args:
        token: the JWT.
        issuer_kind: what kind of key must have signed it (:data:`SERVER` for the
            server's authorization requests, :data:`ACCOUNT` for what an account issues).
        issuer: the one key that must have signed it; None: any key of ``issuer_kind``.

    Raises:
        JWTError: anything wrong with it, said in the message.
    """
    if not isinstance(token, str) or len(token) > MAX_TOKEN_BYTES:
        raise JWTError("not a JWT (not text, or larger than 1 MiB)")
    parts = token.split(".")
    if len(parts) != 3:
        raise JWTError(f"not a JWT: {len(parts)} dot-separated parts, 3 expected")
    header = _object(_unb64(parts[0], "header"), "header")
    if str(header.get("typ", "")).upper() != "JWT" or \
            str(header.get("alg", "")).lower() != HEADER["alg"]:
        raise JWTError(f"unsupported JWT header {header} (typ JWT, alg ed25519-nkey expected)")
    claims = _object(_unb64(parts[1], "claims"), "claims")
    signer = claims.get("iss")
    if not isinstance(signer, str):
        raise JWTError("the JWT names no issuer (iss)")
    raw_key = public_key_bytes(signer, issuer_kind)
    if issuer is not None and signer != issuer:
        raise JWTError(f"the JWT's issuer {signer} is not the expected {issuer}")
    try:
        nacl.signing.VerifyKey(raw_key).verify(
            f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2], "signature"))
    except (nacl.exceptions.BadSignatureError, ValueError):
        raise JWTError(f"the JWT's signature is not its issuer's ({signer})") from None
    return claims


def _object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise JWTError(f"the JWT's {what} is not JSON") from None
    if not isinstance(value, dict):
        raise JWTError(f"the JWT's {what} is not a JSON object")
    return value

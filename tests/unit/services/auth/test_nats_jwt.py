"""NATS JWTs: written as nats-io/jwt writes them, and read only when signed by their issuer."""

from __future__ import annotations

import base64
import json
import os

import nkeys
import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.services.auth import nats_jwt
from phalanx.services.auth.nats_jwt import ACCOUNT, SERVER, USER, JWTError


def seed(kind: int) -> bytes:
    return bytes(nkeys.encode_seed(os.urandom(32), kind))


ISSUER = seed(ACCOUNT)


def parts(token: str) -> list[dict]:
    return [json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)))
            for p in token.split(".")[:2]]


def test_a_jwt_round_trips_with_its_header_issuer_and_jti() -> None:
    user = nats_jwt.public_key_of(seed(USER))
    token = nats_jwt.encode({"sub": user, "aud": "$G", "exp": 200, "nats": {"type": "user"}},
                            ISSUER, issued_at=100)
    header, claims = parts(token)
    assert header == {"typ": "JWT", "alg": "ed25519-nkey"}
    assert claims == nats_jwt.decode(token, issuer_kind=ACCOUNT,
                                     issuer=nats_jwt.public_key_of(ISSUER))
    assert claims["iss"] == nats_jwt.public_key_of(ISSUER) and claims["iat"] == 100
    assert claims["jti"] == nats_jwt.jti(claims)


def test_the_jti_is_nats_io_jwt_s_digest_of_the_standard_claims() -> None:
    """The digest nats-io/jwt v2 computes (ClaimsData.hash): SHA-512/256 of the standard
    claims' JSON in its field order, empty ones left out, base32 without padding."""
    claims = {"sub": "UX", "iss": "AX", "iat": 5, "nats": {"ignored": True}, "aud": "$G"}
    import hashlib
    expected = base64.b32encode(hashlib.new(
        "sha512_256", b'{"aud":"$G","iat":5,"iss":"AX","sub":"UX"}').digest()).rstrip(b"=")
    assert nats_jwt.jti(claims) == expected.decode()


def test_a_tampered_claim_or_signature_is_refused() -> None:
    token = nats_jwt.encode({"sub": "x"}, ISSUER, issued_at=1)
    head, body, sig = token.split(".")
    forged = base64.urlsafe_b64encode(json.dumps({**parts(token)[1], "sub": "y"}).encode())
    with pytest.raises(JWTError, match="signature"):
        nats_jwt.decode(f"{head}.{forged.rstrip(b'=').decode()}.{sig}", issuer_kind=ACCOUNT)
    flipped = sig[:-2] + ("A" if sig[-2] != "A" else "B") + sig[-1]
    with pytest.raises(JWTError, match="signature"):
        nats_jwt.decode(f"{head}.{body}.{flipped}", issuer_kind=ACCOUNT)


def test_another_issuer_or_another_kind_of_key_is_refused() -> None:
    other = seed(ACCOUNT)
    token = nats_jwt.encode({"sub": "x"}, other, issued_at=1)
    with pytest.raises(JWTError, match="not the expected"):
        nats_jwt.decode(token, issuer_kind=ACCOUNT, issuer=nats_jwt.public_key_of(ISSUER))
    with pytest.raises(JWTError, match="not a server key"):
        nats_jwt.decode(token, issuer_kind=SERVER)
    # Re-signed by someone else but still naming the issuer: the signature fails.
    claims = parts(token)[1]
    mine = nats_jwt.encode(claims, ISSUER, issued_at=1).split(".")
    header, body = token.split(".")[:2]
    with pytest.raises(JWTError, match="signature"):
        nats_jwt.decode(f"{header}.{body}.{mine[2]}", issuer_kind=ACCOUNT)


@pytest.mark.parametrize(("token", "match"), [
    ("", "3 expected"),
    ("a.b", "3 expected"),
    ("!!.e30.AA", "not base64url|not JSON"),
    (".".join(["eyJ0eXAiOiJKV1QiLCJhbGciOiJIUzI1NiJ9", "e30", "AA"]), "unsupported JWT header"),
    (".".join(["eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ", "WzFd", "AA"]),
     "not a JSON object"),
    (".".join(["eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ", "e30", "AA"]), "no issuer"),
    (".".join(["eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ",
               "eyJpc3MiOiJOT1RBS0VZIn0", "AA"]), "not a public server nkey"),
])
def test_malformed_tokens_say_what_is_wrong(token: str, match: str) -> None:
    with pytest.raises(JWTError, match=match):
        nats_jwt.decode(token, issuer_kind=SERVER)


def test_keys_of_the_wrong_kind_or_checksum_are_refused() -> None:
    account = nats_jwt.public_key_of(ISSUER)
    assert nats_jwt.is_public_key(account, ACCOUNT)
    assert not nats_jwt.is_public_key(account, USER)
    assert not nats_jwt.is_public_key(account[:-1] + ("A" if account[-1] != "A" else "B"),
                                      ACCOUNT)
    assert not nats_jwt.is_public_key(None, ACCOUNT)
    with pytest.raises(JWTError, match="an account key"):
        nats_jwt.public_key_of(seed(USER), ACCOUNT)
    with pytest.raises(JWTError, match="not an nkey seed"):
        nats_jwt.public_key_of(b"SAnot-a-seed")


@given(st.dictionaries(st.sampled_from(["aud", "name", "exp", "nbf", "x"]),
                       st.one_of(st.text(max_size=20), st.integers(0, 2**40)), max_size=5),
       st.text(min_size=1, max_size=30))
def test_any_claims_round_trip(extra: dict, subject: str) -> None:
    token = nats_jwt.encode({**extra, "sub": subject}, ISSUER, issued_at=7)
    claims = nats_jwt.decode(token, issuer_kind=ACCOUNT)
    assert {k: claims[k] for k in extra} == extra and claims["sub"] == subject
    assert claims["jti"] == nats_jwt.jti(claims)

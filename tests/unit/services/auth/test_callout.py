"""The auth callout's rule, on requests shaped as nats-server sends them."""

from __future__ import annotations

import os

import nkeys
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from phalanx.schemas.messages import JobState
from phalanx.services.auth import callout, nats_jwt, rank_token, roles
from phalanx.services.auth.callout import Refusal
from phalanx.services.auth.nats_jwt import ACCOUNT, SERVER, USER
from phalanx.services.auth.roles import Role

KEY = bytes(range(32))
NOW = 1_700_000_000.0
TTL_S = 600.0


def seed(kind: int) -> bytes:
    return bytes(nkeys.encode_seed(os.urandom(32), kind))


ISSUER_SEED = seed(ACCOUNT)
ISSUER = nats_jwt.public_key_of(ISSUER_SEED)
SERVER_SEED = seed(SERVER)
SERVER_ID = nats_jwt.public_key_of(SERVER_SEED)
USER_NKEY = nats_jwt.public_key_of(seed(USER))


def request(token: str | None = None, *, subject: str = ISSUER, user: str = USER_NKEY,
            audience: str = callout.REQUEST_AUDIENCE, signer: bytes = SERVER_SEED,
            expires: float = NOW + 2, kind: str = "authorization_request") -> bytes:
    """An authorization request as nats-server 2.10+ writes it (auth_callout.go)."""
    options = {"protocol": 1, "lang": "python3", "name": "rank-0",
               **({"auth_token": token} if token is not None else {})}
    claims = {"sub": subject, "aud": audience, "exp": int(expires), "nats": {
        "server_id": {"name": "nats-0", "host": "0.0.0.0",
                      "id": nats_jwt.public_key_of(signer)},
        "user_nkey": user, "client_info": {"host": "10.0.0.7", "id": 5, "kind": "Client"},
        "connect_opts": options, "type": kind, "version": 2}}
    return nats_jwt.encode(claims, signer, issued_at=int(NOW)).encode()


def token(job: str = "job-a", *, ttl_s: float = 3600.0, key: bytes = KEY) -> str:
    return rank_token.mint(key, job, now=NOW - 10, ttl_s=ttl_s, nonce=os.urandom(16))


def decide(raw: bytes, state: JobState | None = JobState.ADMITTED,
           now: float = NOW) -> callout.Decision:
    examined = callout.examine(raw, issuer=ISSUER, key=KEY, now=now)
    return callout.decide(examined, state, issuer_seed=ISSUER_SEED, now=now,
                          connection_ttl_s=TTL_S)


def response(decision: callout.Decision) -> dict:
    claims = nats_jwt.decode(decision.response.decode(), issuer_kind=ACCOUNT, issuer=ISSUER)
    assert claims["sub"] == USER_NKEY and claims["aud"] == SERVER_ID
    assert claims["nats"]["type"] == "authorization_response"
    return claims["nats"]


def test_a_live_job_s_token_gets_exactly_the_rank_role_of_its_job() -> None:
    decision = decide(request(token("job-a")))
    assert (decision.job_id, decision.refusal) == ("job-a", None)
    user = nats_jwt.decode(response(decision)["jwt"], issuer_kind=ACCOUNT, issuer=ISSUER)
    granted = roles.permissions(Role.RANK, "job-a")
    assert user["sub"] == USER_NKEY and user["aud"] == callout.GLOBAL_ACCOUNT
    assert user["name"] == "rank-job-a"
    assert user["nats"]["pub"] == {"allow": sorted(granted.publish)}
    assert user["nats"]["sub"] == {"allow": sorted(granted.subscribe)}
    assert "resp" not in user["nats"] and user["nats"]["type"] == "user"
    # The connection lasts the connection lifetime (capped here), then the server ends it.
    assert user["exp"] == decision.expires_at == int(NOW + TTL_S)


def test_a_connection_never_outlives_its_token() -> None:
    decision = decide(request(token(ttl_s=70)))
    assert decision.expires_at == int(NOW - 10 + 70)
    # Uncapped (phalanx's default: its ranks' client does not reconnect at an expiry),
    # the token's expiry is the connection's.
    examined = callout.examine(request(token(ttl_s=7200)), issuer=ISSUER, key=KEY, now=NOW)
    uncapped = callout.decide(examined, JobState.ADMITTED, issuer_seed=ISSUER_SEED, now=NOW)
    assert uncapped.expires_at == int(NOW - 10 + 7200)


@pytest.mark.parametrize(("state", "refusal", "said"), [
    (None, Refusal.UNKNOWN_JOB, "no job job-a"),
    (JobState.FINISHED, Refusal.ENDED_JOB, "job job-a is finished"),
    (JobState.CANCELLED, Refusal.ENDED_JOB, "job job-a is cancelled"),
    (JobState.FAILED, Refusal.ENDED_JOB, "job job-a is failed"),
])
def test_a_job_that_ended_or_never_was_gets_no_connection(
        state: JobState | None, refusal: Refusal, said: str) -> None:
    decision = decide(request(token()), state)
    assert (decision.job_id, decision.refusal) == (None, refusal)
    assert response(decision) == {"error": f"{refusal}: {said}",
                                  "type": "authorization_response", "version": 2}


def test_a_pending_job_keeps_its_ranks() -> None:
    """Revoked at its end, as bare metal revokes a job's identity."""
    assert decide(request(token()), JobState.PENDING).job_id == "job-a"


@pytest.mark.parametrize(("raw_token", "refusal", "said"), [
    (None, Refusal.NO_TOKEN, "no token"),
    ("s3cret", Refusal.BAD_TOKEN, "not a rank token"),
    (rank_token.mint(bytes(32), "job-a", now=NOW, ttl_s=60, nonce=bytes(16)),
     Refusal.BAD_TOKEN, "MAC"),
    (rank_token.mint(KEY, "job-a", now=NOW - 120, ttl_s=60, nonce=bytes(16)),
     Refusal.EXPIRED_TOKEN, "expired"),
])
def test_a_forged_expired_or_missing_token_is_refused(
        raw_token: str | None, refusal: Refusal, said: str) -> None:
    decision = decide(request(raw_token), JobState.ADMITTED)
    assert (decision.job_id, decision.refusal) == (None, refusal)
    assert said in decision.message and said in response(decision)["error"]


@pytest.mark.parametrize(("raw", "said"), [
    (b"", "3 expected"),
    (b"\xff\xfe", "codec can't decode"),
    (request(token(), subject=nats_jwt.public_key_of(seed(ACCOUNT))), "not this callout's"),
    (request(token(), audience="elsewhere"), "audience"),
    (request(token(), user="not-a-key"), "user_nkey"),
    (request(token(), signer=seed(ACCOUNT)), "not a server key"),
    (request(token(), kind="authorization_response"), "not an authorization request"),
    (request(token(), expires=NOW - callout.CLOCK_SKEW_S - 5), "expired"),
])
def test_a_request_that_does_not_read_gets_an_empty_reply(raw: bytes, said: str) -> None:
    decision = decide(raw)
    assert decision.response == b"" and decision.job_id is None
    assert decision.refusal is Refusal.BAD_REQUEST and said in decision.message


def test_a_request_signed_by_someone_else_is_refused() -> None:
    head, body, _ = request(token()).decode().split(".")
    other = nats_jwt.encode({"sub": "x"}, seed(SERVER), issued_at=1).split(".")[2]
    decision = decide(f"{head}.{body}.{other}".encode())
    assert decision.refusal is Refusal.BAD_REQUEST and "signature" in decision.message


JOBS = st.from_regex(r"job-[a-c]", fullmatch=True)


@given(job=JOBS, state=st.one_of(st.none(), st.sampled_from(JobState)),
       age=st.floats(0, 7200), ttl=st.integers(60, 3600), forged=st.booleans())
@example(job="job-a", state=JobState.ADMITTED, age=3599.0, ttl=3600, forged=False)
def test_admitted_exactly_when_genuine_unexpired_and_live(
        job: str, state: JobState | None, age: float, ttl: int, forged: bool) -> None:
    minted = rank_token.mint(bytes(32) if forged else KEY, job, now=NOW, ttl_s=ttl,
                             nonce=bytes(16))
    now = NOW + age
    decision = decide(request(minted, expires=now + 2), state, now=now)
    live = state is not None and not state.terminal
    assert (decision.job_id is not None) == (not forged and age < ttl and live)
    if decision.job_id is not None:
        assert decision.job_id == job
        assert decision.expires_at is not None
        assert now < decision.expires_at + 1 and decision.expires_at <= min(NOW + ttl,
                                                                           now + TTL_S)
        user = nats_jwt.decode(response(decision)["jwt"], issuer_kind=ACCOUNT, issuer=ISSUER)
        assert set(user["nats"]["pub"]["allow"]) == roles.permissions(Role.RANK, job).publish
    else:
        assert decision.refusal is not None and "error" in response(decision)

"""Rank tokens: made by whoever holds the key, for one job, until they expire."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.services.auth import rank_token
from phalanx.services.auth.rank_token import RankToken, TokenError

KEY = bytes(range(32))
NONCE = bytes(16)


def test_a_token_names_its_job_until_it_expires() -> None:
    token = rank_token.mint(KEY, "train-42", now=1000.0, ttl_s=60, nonce=NONCE)
    assert rank_token.verify(KEY, token, now=1059.9) == RankToken("train-42", 1060)
    with pytest.raises(TokenError, match="expired at 1060") as refused:
        rank_token.verify(KEY, token, now=1060.0)
    assert refused.value.expired


def test_another_key_or_an_edited_token_is_refused() -> None:
    token = rank_token.mint(KEY, "job-a", now=0, ttl_s=60, nonce=NONCE)
    with pytest.raises(TokenError, match="MAC") as refused:
        rank_token.verify(bytes(32), token, now=1)
    assert not refused.value.expired
    for edited in (token.replace("job-a", "job-b"), token.replace(".60.", ".99999.")):
        with pytest.raises(TokenError, match="MAC"):
            rank_token.verify(KEY, edited, now=1)


@pytest.mark.parametrize("token", ["", "x", "phx1.a.b.c", "phx2.j.1.00.mac", "phx1.j.1.00.m.x",
                                   None])
def test_what_is_not_a_token_is_refused(token: object) -> None:
    with pytest.raises(TokenError, match="not a rank token"):
        rank_token.verify(KEY, token, now=0)  # type: ignore[arg-type]


def test_minting_refuses_a_short_key_a_bad_job_or_no_lifetime() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        rank_token.mint(b"short", "j", now=0, ttl_s=1, nonce=NONCE)
    with pytest.raises(ValueError, match="subject token"):
        rank_token.mint(KEY, "a.b", now=0, ttl_s=1, nonce=NONCE)
    with pytest.raises(ValueError, match="ttl_s"):
        rank_token.mint(KEY, "j", now=0, ttl_s=0, nonce=NONCE)


def test_every_token_is_new() -> None:
    tokens = {rank_token.mint(KEY, "j", now=0, ttl_s=1, nonce=os.urandom(16)) for _ in range(50)}
    assert len(tokens) == 50


@given(st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True), st.integers(0, 2**33),
       st.integers(1, 10**7), st.binary(min_size=16, max_size=16))
def test_a_token_verifies_exactly_while_it_lasts(job: str, now: int, ttl: int,
                                                  nonce: bytes) -> None:
    token = rank_token.mint(KEY, job, now=now, ttl_s=ttl, nonce=nonce)
    assert rank_token.verify(KEY, token, now=now + ttl - 1).job_id == job
    with pytest.raises(TokenError):
        rank_token.verify(KEY, token, now=now + ttl)

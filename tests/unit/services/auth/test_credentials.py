"""What a rank's environment holds: its own identity, never its agent's credentials."""

from __future__ import annotations

from pathlib import Path

from phalanx.bus.config import CREDENTIAL_VARS
from phalanx.services.auth.credentials import (
    rank_env,
    rank_environment,
    shared_rank_env,
    token_rank_env,
)

AGENT = {"PHALANX_NATS_URL": "tls://bus:4222", "PHALANX_NATS_CA": "/etc/ca.pem",
         "PHALANX_NATS_USER": "phalanx", "PHALANX_NATS_PASSWORD": "agent-secret",
         "PHALANX_NATS_TOKEN": "t", "PHALANX_NATS_NKEY": "/keys/agent-n1.nk",
         "PHALANX_NATS_CREDS": "/keys/agent.creds", "PHALANX_NATS_INBOX_PREFIX": "_INBOX.agent-n1",
         "PHALANX_AGENT_RANK_KEYS_DIR": "/auth/ranks", "PHALANX_AGENT_RANK_NKEY": "/keys/ranks.nk",
         "PHALANX_AGENT_RANK_TOKEN_KEY_FILE": "/etc/phalanx-identity/rank-token.key",
         "PHALANX_JOB_ID": "j1", "RANK": "0", "PATH": "/usr/bin"}


def test_a_rank_keeps_no_credential_and_no_agent_setting_of_its_agent() -> None:
    env = rank_environment(AGENT, {})
    assert not set(env) & CREDENTIAL_VARS
    assert not [name for name in env if name.startswith("PHALANX_AGENT_")]
    # Where the bus is and what the rank is stay.
    assert {k: env[k] for k in ("PHALANX_NATS_URL", "PHALANX_NATS_CA", "PHALANX_JOB_ID",
                                "RANK", "PATH")} == {k: AGENT[k] for k in (
        "PHALANX_NATS_URL", "PHALANX_NATS_CA", "PHALANX_JOB_ID", "RANK", "PATH")}


def test_a_rank_connects_as_its_job_or_as_the_ranks_shared_identity(tmp_path: Path) -> None:
    (tmp_path / "j1.nk").write_text("SU...")
    own = rank_environment(AGENT, rank_env(tmp_path, "j1", ca_file="/etc/ca.pem"))
    assert set(own) & CREDENTIAL_VARS == {"PHALANX_NATS_NKEY", "PHALANX_NATS_INBOX_PREFIX"}
    assert own["PHALANX_NATS_NKEY"] == str(tmp_path / "j1.nk")
    assert own["PHALANX_NATS_INBOX_PREFIX"] == "_INBOX.rank-j1"
    shared = rank_environment(AGENT, shared_rank_env(Path("/keys/ranks.nk"), "/etc/ca.pem"))
    assert {k: shared[k] for k in set(shared) & CREDENTIAL_VARS} == {
        "PHALANX_NATS_NKEY": "/keys/ranks.nk", "PHALANX_NATS_INBOX_PREFIX": "_INBOX.ranks"}
    assert shared["PHALANX_NATS_CA"] == "/etc/ca.pem"


def test_a_rank_started_with_a_token_holds_its_job_s_token_alone() -> None:
    """Where an auth callout admits ranks: the job's token and inbox, the agent's CA; no
    seed, no agent credential, and not the key that minted the token."""
    env = rank_environment(AGENT, token_rank_env("phx1.j1.9.00.mac", "j1", "/etc/ca.pem"))
    assert {k: env[k] for k in set(env) & CREDENTIAL_VARS} == {
        "PHALANX_NATS_TOKEN": "phx1.j1.9.00.mac", "PHALANX_NATS_INBOX_PREFIX": "_INBOX.rank-j1"}
    assert env["PHALANX_NATS_CA"] == "/etc/ca.pem"
    assert not [v for v in env.values() if "rank-token.key" in v or "agent-n1" in v]

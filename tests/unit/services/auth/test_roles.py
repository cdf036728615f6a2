"""Each role's permissions, checked as subject matching the way nats-server does it."""

from __future__ import annotations

import pytest

from phalanx.schemas import subjects as s
from phalanx.services.auth.roles import (
    ANY,
    STATIC_ROLES,
    Role,
    identity,
    permissions,
)
from phalanx.services.elasticity import service as elasticity_service
from phalanx.services.health import service as health_service


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def everyone() -> list[tuple[Role, str | None]]:
    return [*((r, None) for r in STATIC_ROLES), (Role.AGENT, "node-a"), (Role.AGENT, "node-b"),
            (Role.RANK, "job-a"), (Role.RANK, "job-b")]


def who_may_publish(subject: str) -> set[str]:
    return {identity(role, scope) for role, scope in everyone()
            if any(matches(p, subject) for p in permissions(role, scope).publish)}


def who_may_subscribe(subject: str) -> set[str]:
    return {identity(role, scope) for role, scope in everyone()
            if any(matches(p, subject) for p in permissions(role, scope).subscribe)}


def test_the_matcher_follows_nats_wildcards() -> None:
    assert matches("a.*.c", "a.b.c") and not matches("a.*.c", "a.b.d")
    assert matches("a.>", "a.b.c") and not matches("a.>", "a")
    assert not matches("a.b", "a.b.c")


@pytest.mark.parametrize(("subject", "allowed"), [
    (s.admission_submit(), {"cli"}),
    (s.admission_cancel(), {"cli"}),
    (s.admission_requeue(), {"elasticity"}),
    (s.admission_explain(), {"cli", "viewer"}),
    (s.admission_scale(), {"cli"}),
    (s.job_fault("job-a"), {"health"}),
    (s.job_scaling("job-a"), {"admission"}),
    (s.job_state("job-a"), {"admission", "health"}),
    (s.job_generation("job-a"), {"elasticity"}),
    (s.agent_launch("node-a"), {"elasticity"}),
    (s.agent_chaos("node-a"), {"cli"}),
    (s.node_heartbeat("node-a"), {"agent-node-a"}),
    (s.health_rank("job-a", 3), {"rank-job-a"}),
    (s.replica_ready("job-a"), {"rank-job-a"}),
    (s.generation_applied("job-b"), {"rank-job-b"}),
    (s.generation_given_up("job-a"), {"rank-job-a"}),
    (s.rank_exited("job-a"), {"agent-node-a", "agent-node-b"}),
    (s.kv_key(s.JOBS_BUCKET, "job-a"), {"admission", "health"}),
    (s.kv_key(s.NODES_BUCKET, "node-a"), {"agent-node-a", "health", "cli"}),
    (s.kv_key(s.GENERATIONS_BUCKET, "job-a"), {"elasticity"}),
    (s.kv_key(s.CHECKPOINTS_BUCKET, "job-a"), {"checkpoint"}),
    (s.kv_key(s.LEASES_BUCKET, "health"), {"health"}),
    (s.kv_key(s.CURSORS_BUCKET, "elasticity"), {"elasticity"}),
])
def test_who_may_publish(subject: str, allowed: set[str]) -> None:
    assert who_may_publish(subject) == allowed


@pytest.mark.parametrize(("subject", "allowed"), [
    (s.admission_submit(), {"admission", "cli", "viewer"}),
    (s.agent_launch("node-a"), {"agent-node-a", "cli", "viewer"}),
    (s.job_generation("job-a"), {"rank-job-a", "cli", "viewer"}),
    (s.job_fault("job-b"), {"rank-job-b", "cli", "viewer"}),
    (f"{s.inbox('cli')}.abc", {"cli"}),
    ("_INBOX.abc", set()),
])
def test_who_may_subscribe(subject: str, allowed: set[str]) -> None:
    assert who_may_subscribe(subject) == allowed


def test_the_operator_and_the_viewer_read_the_checkpoint_catalog() -> None:
    get = s.js_api("DIRECT.GET", s.kv_stream(s.CHECKPOINTS_BUCKET),
                   s.kv_key(s.CHECKPOINTS_BUCKET, "job-a"))
    assert who_may_publish(get) == {"checkpoint", "cli", "viewer"}


def test_the_viewer_changes_nothing() -> None:
    granted = permissions(Role.VIEWER)
    assert not granted.responds
    for subject in granted.publish:
        assert subject.startswith(("$JS.API.STREAM.INFO", "$JS.API.STREAM.MSG.GET",
                                   "$JS.API.DIRECT.GET", "$JS.API.CONSUMER.", "$JS.FC.",
                                   "$SRV.")) \
            or subject in (s.js_account_info(), s.admission_explain(), s.any_id(s.agent_status),
                           s.any_id(s.agent_logs)), subject


def test_only_services_and_agents_answer_requests() -> None:
    answer = {identity(r, sc) for r, sc in everyone() if permissions(r, sc).responds}
    assert answer == {"admission", "health", "elasticity", "checkpoint", "agent-node-a",
                      "agent-node-b"}


def test_a_service_may_write_only_its_own_lease_and_cursor() -> None:
    # The permission names the key the service uses: they must not drift apart.
    assert Role.HEALTH.value == health_service.LEASE_KEY
    assert Role.ELASTICITY.value == elasticity_service.LEASE_KEY


def test_a_scoped_role_needs_its_scope_and_a_static_one_takes_none() -> None:
    with pytest.raises(ValueError):
        identity(Role.AGENT)
    with pytest.raises(ValueError):
        identity(Role.CLI, "x")
    with pytest.raises(ValueError):
        identity(Role.RANK, "job.>")  # an id can never widen a permission


@pytest.mark.parametrize(("role", "scopes", "forbidden"), [
    (Role.RANK, ("job-a", "job-b"),
     (s.job_state("job-a"), s.job_fault("job-a"), s.job_generation("job-a"),
      s.admission_submit(), s.agent_launch("node-a"), s.node_heartbeat("node-a"),
      s.kv_key(s.JOBS_BUCKET, "job-a"))),
    (Role.AGENT, ("node-a", "node-b"),
     (s.job_state("job-a"), s.job_fault("job-a"), s.job_generation("job-a"),
      s.admission_submit(), s.agent_launch("node-a"), s.kv_key(s.JOBS_BUCKET, "job-a"),
      s.kv_key(s.LEASES_BUCKET, "health"))),
])
def test_a_shared_identity_may_do_what_any_scopes_may_and_nothing_more(
        role: Role, scopes: tuple[str, str], forbidden: tuple[str, ...]) -> None:
    shared = permissions(role, ANY)
    for scope in scopes:
        own = permissions(role, scope)
        for subject in (*own.publish, *own.subscribe):
            if subject.startswith(s.inbox(identity(role, scope))):
                continue  # each has its own inbox
            granted = shared.publish if subject in own.publish else shared.subscribe
            assert any(matches(p, subject) for p in granted), subject
    # ... and nothing a service or the operator does.
    for subject in forbidden:
        assert not any(matches(p, subject) for p in shared.publish), subject
    assert shared.responds == permissions(role, scopes[0]).responds
    assert shared.subscribe >= {f"{s.inbox(identity(role, ANY))}.>"}
    assert identity(role, ANY) == f"{role.value}s"
    assert not any(matches(p, f"{s.inbox('cli')}.x") for p in shared.subscribe)


def test_only_the_callout_hears_the_servers_authorization_requests() -> None:
    """The requests carry the clients' tokens: no other identity may subscribe to them,
    and the callout publishes nothing but its answers (allow_responses) and its $SRV."""
    callout = permissions(Role.CALLOUT)
    assert s.auth_callout() in callout.subscribe and callout.responds
    assert not who_may_subscribe(s.auth_callout())
    assert not [p for p in callout.publish if p.startswith((s.PREFIX, "$KV"))]
    assert Role.CALLOUT not in STATIC_ROLES
    assert identity(Role.CALLOUT) == "callout"

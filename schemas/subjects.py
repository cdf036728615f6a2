"""Subject builders: the only place subject strings are spelled.

Subjects are lowercase words under ``phalanx.``, broad to narrow, with
identifiers (node, job, rank) as single tokens. A token may not be empty or
contain a dot, a wildcard (``*``/``>``), whitespace or ``$``, so an identifier
can never widen a subscription or reach the server's own ``$`` subjects.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from phalanx.schemas.errors import SubjectError

PREFIX = "phalanx"
_TOKEN = re.compile(r"[A-Za-z0-9_\-]+")


def token(value: str | int, what: str) -> str:
    """Validate one identifier for use as a subject token.

    Raises:
        SubjectError: ``value`` is empty or contains a forbidden character.
    """
    text = str(value)
    if not _TOKEN.fullmatch(text):
        raise SubjectError(
            f"{what} {text!r} cannot be a subject token: use letters, digits, '-' and '_' only"
        )
    return text


def node_heartbeat(node_id: str) -> str:
    return f"{PREFIX}.node.{token(node_id, 'node id')}.heartbeat"


def node_heartbeats() -> str:
    """Wildcard over every node's heartbeat."""
    return f"{PREFIX}.node.*.heartbeat"


def agent_status(node_id: str) -> str:
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.status"


def agent_launch(node_id: str) -> str:
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.launch"


def agent_stop(node_id: str) -> str:
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.stop"


def admission_submit() -> str:
    return admission("submit")


def admission_cancel() -> str:
    return admission("cancel")


def admission_requeue() -> str:
    return admission("requeue")


def admission_explain() -> str:
    return admission("explain")


def admission_scale() -> str:
    return admission("scale")


def admission(verb: str) -> str:
    """Admission's public endpoint for ``verb`` (``submit``, ``cancel``, ...)."""
    return f"{PREFIX}.admission.{token(verb, 'verb')}"


def admission_leader(verb: str) -> str:
    """Where the current admission leader takes forwarded requests (``submit``, ...)."""
    return f"{PREFIX}.admission.leader.{token(verb, 'verb')}"


def job_state(job_id: str) -> str:
    return _job(job_id, "state")


def job_states() -> str:
    """Wildcard over every job's state changes."""
    return f"{PREFIX}.job.*.state"


def _job(job_id: str, kind: str) -> str:
    return f"{PREFIX}.job.{token(job_id, 'job id')}.{kind}"


def job_generation(job_id: str) -> str:
    return _job(job_id, "generation")


def replica_ready(job_id: str) -> str:
    return _job(job_id, "ready")


def generation_applied(job_id: str) -> str:
    return _job(job_id, "applied")


def generation_given_up(job_id: str) -> str:
    return _job(job_id, "given_up")


def job_fault(job_id: str) -> str:
    return _job(job_id, "fault")


def rank_started(job_id: str) -> str:
    return _job(job_id, "started")


def rank_exited(job_id: str) -> str:
    return _job(job_id, "exited")


def job_scaling(job_id: str) -> str:
    """Where admission announces the job's scaling events (grow, shrink, pin, ...)."""
    return _job(job_id, "scaling")


def jobs_all() -> str:
    """Wildcard over every subject of every job (a stream's consumer filter)."""
    return f"{PREFIX}.job.>"


def job_events(kind: str) -> str:
    """Wildcard over one kind of job event (``started``, ``exited``, ``fault``, ``ready`` …)."""
    return f"{PREFIX}.job.*.{token(kind, 'event kind')}"


def agent_chaos(node_id: str) -> str:
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.chaos"


def agent_logs(node_id: str) -> str:
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.logs"


def node_condition(node_id: str) -> str:
    return f"{PREFIX}.node.{token(node_id, 'node id')}.condition"


def node_conditions() -> str:
    """Wildcard over every node's condition changes."""
    return f"{PREFIX}.node.*.condition"


def node_chaos(node_id: str) -> str:
    """An agent announces a fault injected on its node (a ``NodeConditionChanged`` of
    condition ``chaos``); apart from conditions, so an agent may say only this."""
    return f"{PREFIX}.node.{token(node_id, 'node id')}.chaos"


def node_chaos_all() -> str:
    """Wildcard over every node's chaos announcements."""
    return f"{PREFIX}.node.*.chaos"


def health_ranks() -> str:
    """Wildcard over every rank's progress."""
    return f"{PREFIX}.health.rank.*.*"


def health_job_ranks(job_id: str) -> str:
    """Wildcard over the progress of every rank of one job."""
    return f"{PREFIX}.health.rank.{token(job_id, 'job id')}.*"


def health_rank(job_id: str, rank: int) -> str:
    return f"{PREFIX}.health.rank.{token(job_id, 'job id')}.{token(rank, 'rank')}"


def ckpt_snapshot(job_id: str) -> str:
    return f"{PREFIX}.ckpt.{token(job_id, 'job id')}.snapshot"


def ckpt_resume() -> str:
    """The checkpoint service's answer to "where can this job resume?" (request/reply)."""
    return f"{PREFIX}.ckpt.resume"


def agent_snapshot(node_id: str) -> str:
    """A rank reserves snapshot buffers in its node agent's shared memory."""
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.snapshot"


def agent_fetch(node_id: str, job_id: str) -> str:
    """A rank of job ``job_id`` asks a node's agent to send a copy it holds of one of the
    job's snapshot shards to a member's node (:class:`~phalanx.schemas.messages.ReplicaFetch`):
    the job in the subject, so that a rank's permission names its own job's shards only."""
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.fetch.{token(job_id, 'job id')}"


def agent_fetches(node_id: str) -> str:
    """Wildcard over the fetches one node's agent answers, of every job."""
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.fetch.*"


#: JetStream KV bucket holding one NodeRecord per registered node.
NODES_BUCKET = "phalanx_nodes"
#: JetStream KV bucket holding one JobRecord per submitted job.
JOBS_BUCKET = "phalanx_jobs"
#: JetStream KV bucket with admission's ledger (``job.<job id>``: JobPlacement,
#: ``node.<node id>``: NodeClaims) and its ``leader`` (Lease).
ADMISSION_BUCKET = "phalanx_admission"
#: JetStream KV bucket holding each running job's current Generation (key = job id).
GENERATIONS_BUCKET = "phalanx_generations"
#: JetStream KV bucket holding each leader-leased service's Lease (key = service name).
LEASES_BUCKET = "phalanx_leases"
#: JetStream KV bucket holding each service's StreamCursor on the job-events stream.
CURSORS_BUCKET = "phalanx_cursors"
#: JetStream KV bucket holding each running job's elasticity JobSnapshot (key = job id).
ELASTICITY_BUCKET = "phalanx_elasticity"
#: JetStream KV bucket holding each watched job's health JobSnapshot (key = job id).
HEALTH_BUCKET = "phalanx_health"
#: JetStream KV bucket holding each job's CheckpointCatalog (key = job id).
CHECKPOINTS_BUCKET = "phalanx_checkpoints"
#: JetStream KV bucket holding each live node's BuddyPlacement (key = node id).
BUDDIES_BUCKET = "phalanx_buddies"
#: JetStream KV bucket holding each job's JobProgress, written by health (key = job id).
PROGRESS_BUCKET = "phalanx_progress"
#: JetStream KV bucket holding each job's JobHistory, written by elasticity (key = job id).
HISTORY_BUCKET = "phalanx_history"
#: JetStream KV bucket holding the chunks of values too large for one payload (key
#: ``<bucket>.<key>.<digest>.<i>``: raw bytes, the i-th slice of the value's encoding;
#: phalanx.bus.spill).
CHUNKS_BUCKET = "phalanx_chunks"
#: JetStream stream keeping the job events that drive decisions (phalanx.bus.stream).
JOB_EVENTS_STREAM = "PHALANX_JOB_EVENTS"


_ANY = "ANY-ID-WILDCARD"  # a valid token no real id uses, replaced by "*"


def any_id(builder: Callable[[str], str]) -> str:
    """The wildcard form of a one-identifier builder: ``any_id(agent_chaos)`` is
    ``phalanx.agent.*.chaos``, so a permission over every node is spelled by the same
    function as one node's subject."""
    return builder(_ANY).replace(_ANY, "*")


def everything() -> str:
    """Wildcard over every phalanx subject."""
    return f"{PREFIX}.>"


def agent_endpoints(node_id: str) -> str:
    """Wildcard over the request endpoints of one node's agent (status, launch, stop, chaos,
    snapshot; its fetches are :func:`agent_fetches`)."""
    return f"{PREFIX}.agent.{token(node_id, 'node id')}.*"


# --- The server's own subjects, as far as permissions name them --------------------------
# JetStream's API, KV records and the service API belong to nats-server; they are spelled
# here too, so the permissions derived from them (phalanx.services.auth.roles) and the code
# that uses them cannot drift apart.


def inbox(identity: str) -> str:
    """The reply-subject prefix of an identity's connection (``_INBOX.<identity>``): each
    identity may subscribe only under its own, so none reads another's replies."""
    return f"_INBOX.{token(identity, 'identity')}"


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind KV bucket ``bucket``."""
    return f"KV_{token(bucket, 'bucket')}"


def kv_key(bucket: str, key: str) -> str:
    """The subject a KV bucket stores ``key`` under (``>`` or ``*`` for every key), both
    checked as tokens (for permissions)."""
    return kv_subject(token(bucket, "bucket"),
                      key if key in (">", "*") else token(key, "KV key"))


def kv_chunks(bucket: str, key: str) -> str:
    """The subjects of the chunks of the values of ``key`` of ``bucket`` (``>``: of every
    key) in :data:`CHUNKS_BUCKET` (phalanx.bus.spill), checked as tokens."""
    tail = ">" if key == ">" else f"{key if key == '*' else token(key, 'KV key')}.>"
    return kv_subject(CHUNKS_BUCKET, f"{token(bucket, 'bucket')}.{tail}")


def kv_subject(bucket: str, key: str) -> str:
    """The subject ``key`` of ``bucket`` is stored under, as the server names it
    (unchecked: a key read back from the server, which may hold any KV key)."""
    return f"$KV.{bucket}.{key}"


def js_api(operation: str, *tokens: str) -> str:
    """A JetStream API subject: ``js_api("STREAM.INFO", stream)`` is
    ``$JS.API.STREAM.INFO.<stream>``; tokens may be wildcards or a whole subject (a direct
    get names the KV subject it reads)."""
    return ".".join(("$JS.API", operation, *tokens))


def js_account_info() -> str:
    """Where the JetStream API answers the account's info: the meta leader answers, so
    every connection asks it whether its server is in the cluster's majority
    (:mod:`phalanx.bus.majority`)."""
    return js_api("INFO")


def js_flow_control(stream: str) -> str:
    """Where a push consumer on ``stream`` answers flow-control requests."""
    return f"$JS.FC.{stream}.>"


def service_api(service: str) -> tuple[str, ...]:
    """The NATS service API subjects (``$SRV.PING|INFO|STATS``) one service answers on."""
    name = token(service, "service name")
    return ("$SRV.*", f"$SRV.*.{name}", f"$SRV.*.{name}.*")


def service_info(service: str) -> str:
    """Where every instance of one service answers who it is (``$SRV.INFO.<name>``): a
    probe's question."""
    return f"$SRV.INFO.{token(service, 'service name')}"


def service_api_requests() -> str:
    """Wildcard over every service API request (to ping, list or read stats)."""
    return "$SRV.>"


def auth_callout() -> str:
    """Where nats-server asks its auth callout whether a connection gets in (the server's
    own subject, ``$SYS.REQ.USER.AUTH``: docs/security.md)."""
    return "$SYS.REQ.USER.AUTH"


#: Buckets keyed by job id, and by node id: a record stored there names its key.
_JOB_BUCKETS = frozenset({JOBS_BUCKET, GENERATIONS_BUCKET, HISTORY_BUCKET, HEALTH_BUCKET,
                          ELASTICITY_BUCKET, PROGRESS_BUCKET, CHECKPOINTS_BUCKET})
_NODE_BUCKETS = frozenset({NODES_BUCKET, BUDDIES_BUCKET})


def owner(subject: str) -> tuple[str, str] | None:
    """The job or node ``subject`` belongs to: ``("job", id)``, ``("node", id)`` or None.

    A message on it that names a job (or a node) must name that one: permissions are
    granted per subject, so a rank may publish only on its own job's subjects and an
    agent only on its own node's, and a payload naming another must not carry it past
    them. The same holds for a record under a key of a bucket keyed by job or node
    (:func:`kv_subject`): a follower keyed by the record would
    otherwise keep an entry that no later write or delete of that key replaces.
    """
    parts = subject.split(".")
    if parts[0] == PREFIX and len(parts) == 4:
        if parts[1] == "job" or (parts[1] == "ckpt" and parts[3] == "snapshot"):
            return "job", parts[2]
        if parts[1] in ("node", "agent"):
            return "node", parts[2]
    if parts[0] == PREFIX and len(parts) == 5 and parts[1:3] == ["health", "rank"]:
        return "job", parts[3]
    if parts[0] == PREFIX and len(parts) == 5 and parts[1] == "agent" and parts[3] == "fetch":
        return "job", parts[4]
    if parts[0] == "$KV" and len(parts) >= 3:
        key = ".".join(parts[2:])
        if parts[1] in _JOB_BUCKETS:
            return "job", key
        if parts[1] in _NODE_BUCKETS:
            return "node", key
    return None

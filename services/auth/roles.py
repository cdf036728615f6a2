"""Who may do what on the bus: each role's publish and subscribe permissions.

Every process connects as one *identity*, and every identity has one *role*:
the services (admission, health, elasticity, checkpoint), an agent per node, the
ranks of one job, the operator (cli) and a read-only viewer. A role may use
exactly the subjects its process uses — found by reading every publish,
subscribe, request, KV bucket and stream each process touches — and nothing
else. The rules:

* An agent publishes only its own node's heartbeat and writes only its own
  node's registry entry; it serves requests only on its own node's endpoints.
* A rank publishes only its own job's readiness, applied generations and
  progress, and hears only its own job's generations, faults and progress.
  It publishes no fault and no job record, and writes no KV entry.
* Only the operator (cli) submits, cancels and scales; only elasticity requeues,
  launches and stops replicas; only health publishes faults; only admission
  and health publish job records (which agents act on) and write the jobs
  bucket, where submissions and cancellations are stored.
* The viewer reads: every phalanx subject, every bucket and the job-events
  stream, the service API, ``explain`` and agent status. It writes nothing.

JetStream is reached through the server's API subjects, so a role that reads a
bucket may publish to that bucket's ``STREAM.INFO``, ``DIRECT.GET``,
``STREAM.MSG.GET`` and consumer subjects; one that writes it publishes to its
``$KV.<bucket>.<key>`` subjects, per key where the role owns only some (an
agent's node, a service's lease and cursor). A process that opens a bucket or
the stream may create it if it is missing (the first one up does). Consumers
are ordered (no acknowledgements), so no role needs ``$JS.ACK``; they answer
flow control on ``$JS.FC``. Every role may ask for its account's JetStream info
(``$JS.API.INFO``): each connection does, to learn whether its server is in the
cluster's majority (:mod:`phalanx.bus.majority`). Replies come to a per-identity inbox prefix
(:func:`~phalanx.schemas.subjects.inbox`), so no identity can read another's
replies; services answer requests through ``allow_responses`` rather than a
publish permission on every inbox.

Where nodes come and go without the server's config being reloaded for each
(the Kubernetes base: DaemonSet pods), the agents share one identity of scope
:data:`ANY`, ``agents``: an agent's permissions for any node (never a service's or
the operator's, but an agent there may publish another node's heartbeat, which
per-node identities prevent). Jobs there keep identities of their own without a
reload: the auth callout (:mod:`~phalanx.services.auth.callout`, role ``callout``,
which alone hears the server's authorization requests) admits a job's ranks with
exactly :func:`permissions` of the rank role for their job. ``ranks``, a rank's
permissions for any job, remains only for deployments that choose it
(``PHALANX_AGENT_RANK_NKEY``).

Limits: a permission names subjects, not payloads. An agent may publish the
start or exit of any job's rank (it runs whichever the records place on it)
and a snapshot of any job (the replicas it keeps for its buddies' ranks), and
the node id inside such an event is not checked by the server; a stream
consumer sees the whole stream. Pure: no I/O, so tests assert on these rules
directly.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable

from phalanx.schemas import subjects as s


class Role(enum.StrEnum):
    ADMISSION = "admission"
    HEALTH = "health"
    ELASTICITY = "elasticity"
    CHECKPOINT = "checkpoint"
    AGENT = "agent"
    """One per node: the scope is the node id."""
    RANK = "rank"
    """One per job, shared by its ranks: the scope is the job id."""
    CLI = "cli"
    """The operator: submits, cancels, cordons, injects faults."""
    VIEWER = "viewer"
    """Reads everything, changes nothing."""
    CALLOUT = "callout"
    """The auth callout of a Kubernetes deployment: admits each job's ranks as their job
    (:mod:`~phalanx.services.auth.callout`). Not made by ``phalanx auth init``."""

    @property
    def scoped(self) -> bool:
        """Whether each identity of the role belongs to one node or job."""
        return self in (Role.AGENT, Role.RANK)


#: The scope of a scoped role's shared identity: every node (``agents``) or every job
#: (``ranks``).
ANY = "*"

#: The roles ``phalanx auth init`` makes one identity for (the callout is made only for
#: Kubernetes, by ``phalanx auth kubernetes``).
STATIC_ROLES = tuple(role for role in Role if not role.scoped and role is not Role.CALLOUT)

#: The service API name each role's processes register under (``$SRV``).
SERVICE_NAMES = {Role.ADMISSION: "phalanx-admission", Role.HEALTH: "phalanx-health",
                 Role.ELASTICITY: "phalanx-elasticity", Role.CHECKPOINT: "phalanx-checkpoint",
                 Role.AGENT: "phalanx-agent", Role.CALLOUT: "phalanx-callout"}


@dataclasses.dataclass(frozen=True)
class Permissions:
    """What one identity may do: subjects (with wildcards) it may publish and subscribe to."""

    publish: frozenset[str]
    subscribe: frozenset[str]
    responds: bool
    """May answer requests it received (the server's ``allow_responses``)."""


def identity(role: Role, scope: str | None = None) -> str:
    """The identity's name: the role for a static role, ``agent-<node>`` / ``rank-<job>``,
    ``agents`` / ``ranks`` for scope :data:`ANY`.

    Raises:
        ValueError: a scoped role without a scope, or a static one with one.
        SubjectError: the scope is not a valid subject token.
    """
    if role.scoped != (scope is not None):
        raise ValueError(f"role {role} {'needs' if role.scoped else 'takes no'} "
                         f"{'node' if role is Role.AGENT else 'job'} id")
    if scope is None:
        return role.value
    if scope == ANY:
        return f"{role.value}s"
    return f"{role.value}-{s.token(scope, 'node id' if role is Role.AGENT else 'job id')}"


@dataclasses.dataclass
class _Grants:
    publish: set[str] = dataclasses.field(default_factory=set)
    subscribe: set[str] = dataclasses.field(default_factory=set)

    def pub(self, *subjects: str | Iterable[str]) -> _Grants:
        self.publish.update(_flat(subjects))
        return self

    def sub(self, *subjects: str | Iterable[str]) -> _Grants:
        self.subscribe.update(_flat(subjects))
        return self

    def read_bucket(self, bucket: str, *, watch: bool = True) -> _Grants:
        """Get any key (a bucket without direct gets reads by stream message, which cannot
        be limited to a key), list keys, and watch unless ``watch`` is False."""
        stream = s.kv_stream(bucket)
        chunks = s.kv_stream(s.CHUNKS_BUCKET)
        # A value too large for one payload is read from its chunks (phalanx.bus.spill).
        return self.pub(s.js_api("STREAM.INFO", stream), s.js_api("STREAM.MSG.GET", stream),
                        s.js_api("DIRECT.GET", stream, s.kv_key(bucket, ">")),
                        s.js_api("STREAM.INFO", chunks), s.js_api("STREAM.MSG.GET", chunks),
                        s.js_api("DIRECT.GET", chunks, s.kv_chunks(bucket, ">")),
                        *(_consumer(stream) if watch else ()))

    def open_bucket(self, bucket: str, writes: str | Iterable[str] = ()) -> _Grants:
        """Read, create when missing, and write the keys ``writes`` (``">"``: every key),
        each with its chunks when its value is too large for one payload (stored, and
        purged once replaced: a purge of the chunk stream is not limited to a key)."""
        keys = [writes] if isinstance(writes, str) else list(writes)
        chunks = s.kv_stream(s.CHUNKS_BUCKET)
        self.read_bucket(bucket).pub(
            s.js_api("STREAM.CREATE", s.kv_stream(bucket)), *(s.kv_key(bucket, k) for k in keys))
        if keys:
            self.pub(s.js_api("STREAM.CREATE", chunks), s.js_api("STREAM.PURGE", chunks),
                     *(s.kv_chunks(bucket, k) for k in keys))
        return self

    def read_events(self) -> _Grants:
        return self.pub(s.js_api("STREAM.INFO", s.JOB_EVENTS_STREAM),
                        *_consumer(s.JOB_EVENTS_STREAM))

    def ensure_events(self) -> _Grants:
        return self.pub(s.js_api("STREAM.INFO", s.JOB_EVENTS_STREAM),
                        s.js_api("STREAM.CREATE", s.JOB_EVENTS_STREAM),
                        s.js_api("STREAM.UPDATE", s.JOB_EVENTS_STREAM))


def _consumer(stream: str) -> tuple[str, ...]:
    """Create, look up and delete ephemeral (ordered) consumers on ``stream``, answer flow
    control."""
    return (s.js_api("CONSUMER.CREATE", stream), s.js_api("CONSUMER.CREATE", stream, ">"),
            s.js_api("CONSUMER.INFO", stream, ">"), s.js_api("CONSUMER.DELETE", stream, ">"),
            s.js_flow_control(stream))


def _flat(items: Iterable[str | Iterable[str]]) -> list[str]:
    return [x for item in items for x in ([item] if isinstance(item, str) else item)]


_ALL_BUCKETS = (s.NODES_BUCKET, s.JOBS_BUCKET, s.ADMISSION_BUCKET, s.GENERATIONS_BUCKET,
                s.LEASES_BUCKET, s.CURSORS_BUCKET, s.ELASTICITY_BUCKET, s.HEALTH_BUCKET,
                s.PROGRESS_BUCKET, s.HISTORY_BUCKET, s.CHECKPOINTS_BUCKET, s.BUDDIES_BUCKET)


def _scoped(scope: str) -> Callable[[Callable[[str], str]], str]:
    """Makes the subject of a one-identifier builder for ``scope``: its own node or job,
    or every one (:data:`ANY`)."""
    return s.any_id if scope == ANY else lambda build: build(scope)


def permissions(role: Role, scope: str | None = None) -> Permissions:
    """The permissions of ``role`` (for node or job ``scope`` when the role is scoped).

    Raises:
        ValueError: as :func:`identity`.
    """
    name = identity(role, scope)
    # Every connection asks JetStream whether its server is in the majority.
    g = _Grants().sub(f"{s.inbox(name)}.>").pub(s.js_account_info())
    if role in SERVICE_NAMES:
        # It answers the service API, and may ask it which of its instances answer (its
        # container's liveness and readiness probe, deploy/probe.py).
        g.sub(s.service_api(SERVICE_NAMES[role])).pub(s.service_info(SERVICE_NAMES[role]))
    match role:
        case Role.ADMISSION:
            verbs = (s.admission_submit(), s.admission_cancel(), s.admission_requeue(),
                     s.admission_explain(), s.admission_scale())
            g.sub(verbs, s.any_id(s.admission_leader)).pub(
                s.any_id(s.admission_leader), s.any_id(s.job_state), s.any_id(s.job_scaling))
            g.open_bucket(s.JOBS_BUCKET, ">").open_bucket(s.NODES_BUCKET)
            g.open_bucket(s.ADMISSION_BUCKET, ">")
            # A job's world size completes its planned size change.
            g.open_bucket(s.GENERATIONS_BUCKET)
        case Role.HEALTH | Role.ELASTICITY:
            # The lease and the stream cursor are each under the service's own key.
            g.open_bucket(s.LEASES_BUCKET, role.value).open_bucket(s.CURSORS_BUCKET, role.value)
            g.open_bucket(s.JOBS_BUCKET, ">" if role is Role.HEALTH else ())
            g.ensure_events().read_events()
            if role is Role.HEALTH:
                g.sub(s.health_ranks(), s.node_heartbeats(), s.node_conditions(),
                      s.node_chaos_all())
                g.pub(s.any_id(s.job_fault), s.any_id(s.node_condition), s.any_id(s.job_state))
                g.open_bucket(s.NODES_BUCKET, ">").open_bucket(s.HEALTH_BUCKET, ">")
                g.open_bucket(s.PROGRESS_BUCKET, ">")
            else:
                g.pub(s.any_id(s.job_generation), s.any_id(s.agent_launch),
                      s.any_id(s.agent_stop), s.admission_requeue())
                g.open_bucket(s.GENERATIONS_BUCKET, ">").open_bucket(s.ELASTICITY_BUCKET, ">")
                g.open_bucket(s.HISTORY_BUCKET, ">")
                # A job admitted again resumes at the step health says it had reached.
                g.open_bucket(s.PROGRESS_BUCKET)
        case Role.CHECKPOINT:
            # It hears snapshot announcements, follows job records, keeps the catalog and
            # answers where a job can resume.
            g.sub(s.any_id(s.ckpt_snapshot), s.ckpt_resume()).read_events()
            g.read_bucket(s.JOBS_BUCKET).read_bucket(s.GENERATIONS_BUCKET)
            g.open_bucket(s.LEASES_BUCKET, role.value).open_bucket(s.CHECKPOINTS_BUCKET, ">")
            # It places every node's buddy from the registry.
            g.read_bucket(s.NODES_BUCKET).open_bucket(s.BUDDIES_BUCKET, ">")
        case Role.AGENT:
            assert scope is not None
            node = _scoped(scope)
            g.sub(node(s.agent_endpoints), node(s.agent_fetches), s.job_states())
            g.pub(node(s.node_heartbeat), node(s.node_chaos), s.any_id(s.rank_started),
                  s.any_id(s.rank_exited))
            # It announces the replicas it keeps for its wards, of whichever job, and reads
            # its own buddy's placement.
            g.pub(s.any_id(s.ckpt_snapshot)).open_bucket(s.BUDDIES_BUCKET)
            g.open_bucket(s.NODES_BUCKET, scope).open_bucket(s.JOBS_BUCKET)
            g.open_bucket(s.GENERATIONS_BUCKET).ensure_events()
        case Role.RANK:
            assert scope is not None
            job = _scoped(scope)
            g.sub(job(s.job_generation), job(s.job_fault), job(s.health_job_ranks))
            g.pub(job(s.health_job_ranks), job(s.replica_ready), job(s.generation_applied),
                  job(s.generation_given_up), job(s.ckpt_snapshot), s.any_id(s.agent_snapshot))
            # Before a restore: where the job's snapshots are, and copies of its own shards
            # fetched onto the members' nodes (agent to agent: never through the rank).
            g.pub(s.ckpt_resume(), s.any_id(lambda node: s.agent_fetch(node, scope))
                  if scope != ANY else s.any_id(s.agent_fetches))
            g.read_bucket(s.GENERATIONS_BUCKET, watch=False)
        case Role.CLI:
            g.sub(s.everything())
            g.pub(s.admission_submit(), s.admission_cancel(), s.admission_explain(),
                  s.admission_scale(), s.any_id(s.agent_chaos), s.any_id(s.agent_status),
                  s.any_id(s.agent_logs), s.any_id(s.node_condition), s.service_api_requests())
            g.open_bucket(s.NODES_BUCKET, ">").open_bucket(s.JOBS_BUCKET)
            # phalanx job shows the current membership, the history and the progress
            g.read_bucket(s.GENERATIONS_BUCKET).read_bucket(s.HISTORY_BUCKET)
            g.read_bucket(s.PROGRESS_BUCKET)
            g.read_bucket(s.CHECKPOINTS_BUCKET)  # phalanx ckpt ls / export
        case Role.CALLOUT:
            # It hears the server's authorization requests (which carry the clients'
            # tokens: no one else may) and reads whether a token's job is live.
            g.sub(s.auth_callout()).open_bucket(s.JOBS_BUCKET)
        case Role.VIEWER:
            g.sub(s.everything())
            g.pub(s.admission_explain(), s.any_id(s.agent_status), s.any_id(s.agent_logs),
                  s.service_api_requests())
            for bucket in _ALL_BUCKETS:
                g.read_bucket(bucket)
            g.read_events()
    return Permissions(frozenset(g.publish), frozenset(g.subscribe),
                       responds=role in SERVICE_NAMES)

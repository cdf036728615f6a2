"""How a process is pointed at its bus identity: environment variables, never secrets.

A phalanx process connects as the identity its environment names:
``PHALANX_NATS_NKEY`` is the path of the identity's seed file (the seed itself
never travels in an environment, a log or a command line),
``PHALANX_NATS_INBOX_PREFIX`` the reply-subject prefix it alone may subscribe
to, and ``PHALANX_NATS_CA`` the CA that signed the server's certificate.

An agent launches a job's ranks as the job's identity: it reads the job's seed
file from its rank keys directory (an auth directory's ``ranks/``) and gives
the ranks its path. Whatever identity a rank gets, or none, its environment
holds no credential variable of the agent's or of the job's spec
(:func:`phalanx.bus.config.with_identity`) and none of the agent's own
configuration (``PHALANX_AGENT_*``, its rank keys directory among them):
:func:`rank_environment`. So a rank can neither connect as its agent nor find
another job's seed through its environment.

Where the server's config cannot hold a user per job (the Kubernetes base), the agent
instead mints a rank token for the job each time it starts a rank
(:func:`token_rank_env`, :mod:`.rank_token`) and the rank connects with it
(``PHALANX_NATS_TOKEN``); the server's auth callout admits it as its job's ranks. The
token is the rank's own credential, for its job alone; the key that mints tokens stays
with the agent (``PHALANX_AGENT_RANK_TOKEN_KEY_FILE``, which no rank inherits).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from phalanx.bus.config import with_identity
from phalanx.schemas import settings, subjects
from phalanx.services.auth.roles import ANY, Role, identity


def identity_env(seed_file: Path, name: str, ca_file: str | None = None) -> dict[str, str]:
    """The variables that make a phalanx process connect as identity ``name`` (trusting
    the server that ``ca_file`` signed, when given)."""
    return _connecting_as(name, {settings.NATS_NKEY: str(seed_file)}, ca_file)


def _connecting_as(name: str, credential: dict[str, str],
                   ca_file: str | None) -> dict[str, str]:
    """``credential`` (the variable that proves the identity), the inbox prefix identity
    ``name`` may read replies on, and the CA when given."""
    env = {**credential, settings.NATS_INBOX_PREFIX: subjects.inbox(name)}
    return {**env, settings.NATS_CA: ca_file} if ca_file else env


#: The agent's own configuration variables: never a rank's.
AGENT_VARS_PREFIX = settings.AGENT.prefix


def rank_environment(env: Mapping[str, str], identity: Mapping[str, str]) -> dict[str, str]:
    """What a rank starts with: ``env`` (the agent's, the job's spec's, the rank's own)
    less every bus credential variable and every ``PHALANX_AGENT_*`` variable, plus
    ``identity``, the credential variables of the rank's own identity (empty on a bus
    without authentication)."""
    return with_identity({k: v for k, v in env.items()
                          if not k.startswith(AGENT_VARS_PREFIX)}, identity)


def rank_seed_file(ranks_dir: Path, job_id: str) -> Path:
    """Where the seed of ``job_id``'s ranks lives in a rank keys directory."""
    return ranks_dir / f"{subjects.token(job_id, 'job id')}.nk"


def rank_env(ranks_dir: Path, job_id: str, ca_file: str | None = None) -> dict[str, str]:
    """What an agent gives a rank of ``job_id`` so it connects as its job (and trusts the
    server the agent trusts, ``ca_file``).

    Raises:
        FileNotFoundError: the job has no identity in ``ranks_dir`` (``phalanx auth
            add-job`` was not run for it): the rank must not start as anyone else.
    """
    seed_file = rank_seed_file(ranks_dir, job_id)
    if not seed_file.is_file():
        raise FileNotFoundError(f"no bus identity for job {job_id}: {seed_file} is missing "
                                f"(`phalanx auth add-job` makes it)")
    return identity_env(seed_file, identity(Role.RANK, job_id), ca_file)


def shared_rank_env(seed_file: Path, ca_file: str | None = None) -> dict[str, str]:
    """What an agent gives every rank where there are no per-job identities (the
    Kubernetes base): the identity all jobs' ranks share (``ranks``, scope
    :data:`~.roles.ANY`), never the agent's."""
    return identity_env(seed_file, identity(Role.RANK, ANY), ca_file)


def token_rank_env(token: str, job_id: str, ca_file: str | None = None) -> dict[str, str]:
    """What an agent gives a rank of ``job_id`` where an auth callout admits ranks: the
    job's freshly minted rank ``token`` and the job's identity's inbox prefix (the replies
    the callout lets the rank read), trusting the server ``ca_file`` signed."""
    return _connecting_as(identity(Role.RANK, job_id), {settings.NATS_TOKEN: token}, ca_file)

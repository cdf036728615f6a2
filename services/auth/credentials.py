"""How a process is pointed at its bus identity: environment variables, never secrets.

A phalanx process connects as the identity its environment names:
``PHALANX_NATS_NKEY`` is the path of the identity's seed file (the seed itself
never travels in an environment, a log or a command line),
``PHALANX_NATS_INBOX_PREFIX`` the reply-subject prefix it alone may subscribe
to, and ``PHALANX_NATS_CA`` the CA that signed the server's certificate.

An agent launches a job's ranks as the job's identity: it reads the job's seed
file from its rank keys directory (an auth directory's ``ranks/``) and gives
the ranks its path, after removing every credential variable of its own and of
the job's spec (:func:`phalanx.bus.config.with_identity`), so a rank never
connects as its agent.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.schemas import subjects
from phalanx.services.auth.roles import Role, identity


def identity_env(seed_file: Path, name: str) -> dict[str, str]:
    """The variables that make a phalanx process connect as identity ``name``."""
    return {"PHALANX_NATS_NKEY": str(seed_file),
            "PHALANX_NATS_INBOX_PREFIX": subjects.inbox(name)}


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
    env = identity_env(seed_file, identity(Role.RANK, job_id))
    return {**env, "PHALANX_NATS_CA": ca_file} if ca_file else env

"""Job identities on the node: each job's processes run as a user of the job's own.

As slurmd runs a job as its user, an agent given a range of uids (``agent.job_uids``,
``PHALANX_AGENT_JOB_UIDS="20000-29999"``) starts every process of a job, rank or warm
spare, as a uid of that range that no other job on the node holds
(:func:`~.core.job_user`), its gid the same number, with no supplementary groups and
umask 077. So a rank of one job cannot read another job's ``/proc/<pid>/environ`` (its
bus token), signal it, or read or write what it keeps, and none can read the agent's
own keys (mode 0600/0400, the agent's): the kernel's permission checks do it.

What a job owns here, made for it before its first process starts (:meth:`prepare`),
each mode 0700 and owned by its uid:

* its private directory, ``<temp dir>/phalanx-jobs-<agent uid>/<node>-<hash>/<job>``:
  the process's ``HOME`` and, under it, ``tmp`` (``TMPDIR``), unless the job's ``env``
  sets them;
* its shared-memory directory, ``/dev/shm/phalanx-jobs-<agent uid>/<node>-<hash>/<job>``
  (``PHALANX_SHM_DIR``);
* its snapshot directory in the node's store (:mod:`.snapshots` chowns it and every
  buffer in it, the buddies' replicas included, to the job);
* its folder of the agent's default durable checkpoint directory, where its spec names
  no ``checkpoint.durable_url``.

``/dev/shm`` and ``/tmp`` themselves stay shared (sticky, each file its creator's): a
private mount of them per job needs a mount namespace, which this agent does not make.

Which job holds which uid is kept in ``<work_dir>/job-users.json``, written before a
process of a new job starts, so an agent restarted after a crash gives its adopted ranks'
jobs the uids they run as. A job's uid is given back (:meth:`release`) only once nothing
of the job is left here: no process, no snapshot, and its private directories deleted;
only then may another job get it.

A job's uid is its node's choice: the same on every node unless another job holds the
uid its id picks there. Where its ranks on several nodes share files (a durable
directory on a shared file system), they may then be different users: give such a job
a ``checkpoint.durable_url`` of its own (an object store), or its own folder's group.
A job that resumes from another's durable steps (``checkpoint.resume_from``) on the
agent's default directory cannot read them: the other job's folder is its user's.

Without ``agent.job_uids`` (the default) every process runs as the agent does, as before:
ranks of different jobs can then read each other's environment and snapshots, and the
agent's keys (docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Collection
from pathlib import Path

from phalanx.schemas import environment
from phalanx.services.agent.core import JobUser, job_user

log = logging.getLogger("phalanx.agent.identity")

#: In the agent's work directory: job id -> the uid it holds.
USERS_FILE = "job-users.json"

#: The capabilities an agent that runs jobs as their own users needs, and what for.
CAPABILITIES = {
    0: ("CAP_CHOWN", "hand each job its directories and snapshot buffers"),
    1: ("CAP_DAC_OVERRIDE", "read, replicate and delete the files jobs own"),
    3: ("CAP_FOWNER", "set the modes of the files jobs own"),
    5: ("CAP_KILL", "stop the processes of other users (the jobs')"),
    6: ("CAP_SETGID", "start a job's processes in its group, with no other groups"),
    7: ("CAP_SETUID", "start a job's processes as its user"),
}


def missing_capabilities(status: str, uids: range, agent: tuple[int, int]) -> list[str]:
    """What keeps an agent from running jobs as the users of ``uids``: each capability of
    :data:`CAPABILITIES` absent from the effective set in ``status`` (the text of
    ``/proc/self/status``), and an agent's own uid or gid (``agent``) inside the range
    (a job would then be the agent). Empty: nothing."""
    effective = next((int(line.split()[1], 16) for line in status.splitlines()
                      if line.startswith("CapEff:")), 0)
    problems = [f"{name} (to {why})" for bit, (name, why) in CAPABILITIES.items()
                if not effective >> bit & 1]
    problems += [f"the agent's own {what} {number} is in the range"
                 for what, number in zip(("uid", "gid"), agent, strict=True)
                 if number in uids]
    return problems


def private_roots(node_id: str, work_dir: Path) -> tuple[Path, Path]:
    """Where this agent makes jobs' private directories: under the temporary directory,
    and under ``/dev/shm`` (one folder per agent, as the snapshot store has)."""
    tag = f"{node_id}-{zlib.crc32(str(work_dir.resolve()).encode()):08x}"
    folder = f"phalanx-jobs-{os.getuid()}"
    return (Path(tempfile.gettempdir()) / folder / tag, Path("/dev/shm") / folder / tag)


class JobIdentities:
    """The uids the jobs on this node hold, and the directories each job owns.

    Args:
        work_dir: the agent's (where :data:`USERS_FILE` is kept).
        uids: ``agent.job_uids`` as a range.
        private: the roots of the jobs' private and shared-memory directories
            (:func:`private_roots`).
    """

    def __init__(self, work_dir: Path, uids: range, private: tuple[Path, Path]) -> None:
        self.work_dir = work_dir
        self.uids = uids
        self.private = private
        self.held: dict[str, int] = {}
        try:
            stored = json.loads((work_dir / USERS_FILE).read_text())
            self.held = {str(job): int(uid) for job, uid in stored.items()}
        except (OSError, ValueError, AttributeError):
            pass

    def user(self, job_id: str) -> JobUser:
        """The user ``job_id``'s processes run as here, held from now on (on disk before
        this returns).

        Raises:
            JobUidsExhausted: every uid of the range is held.
        """
        user = job_user(job_id, self.held, self.uids)
        if self.held.get(job_id) != user.uid:
            self.held[job_id] = user.uid
            self._save()
            log.info("job given a uid", extra={"job": job_id, "uid": user.uid})
        return user

    def prepare(self, job_id: str, checkpoint_dir: Path | None = None) -> dict[str, str]:
        """Make ``job_id``'s directories (owned by its user, mode 0700); the variables that
        point its processes there (``HOME``, ``TMPDIR``, ``PHALANX_SHM_DIR``).

        Args:
            checkpoint_dir: the agent's default durable directory, where the job gets a
                folder of its own (None: the job's spec names its own).

        Raises:
            OSError: a directory cannot be made or given to the job.
        """
        user = self.user(job_id)
        home = self._own(self.private[0], job_id, user)
        tmp = home / "tmp"
        _owned_dir(tmp, user)
        _owned_dir(self.exit_statuses(job_id), user)
        shm = self._own(self.private[1], job_id, user)
        if checkpoint_dir is not None:  # a shared root is left as its operator made it
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            _owned_dir(checkpoint_dir / job_id, user)
        return {"HOME": str(home), "TMPDIR": str(tmp), environment.SHM_DIR: str(shm),
                environment.EXIT_STATUS_DIR: str(self.exit_statuses(job_id))}

    def exit_statuses(self, job_id: str) -> Path:
        """Where ``job_id``'s processes write their exit status (in its home)."""
        return self.private[0] / job_id / EXIT_STATUSES

    def _own(self, root: Path, job_id: str, user: JobUser) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o711)  # the jobs find their own folder, and list nobody's
        path = root / job_id
        _owned_dir(path, user)
        return path

    def release(self, job_id: str, still_here: Collection[str]) -> bool:
        """Delete ``job_id``'s private directories and give its uid back, unless it is in
        ``still_here`` (the jobs with a process or a snapshot on this node); whether it
        was given back."""
        if job_id not in self.held or job_id in still_here:
            return False
        for root in self.private:
            shutil.rmtree(root / job_id, ignore_errors=True)
        uid = self.held.pop(job_id)
        self._save()
        log.info("job's uid given back", extra={"job": job_id, "uid": uid})
        return True

    def close(self) -> None:
        """The agent stops cleanly, its ranks stopped: every job's private directories
        go, with this agent's folders for them, and every uid is given back."""
        for root in self.private:
            shutil.rmtree(root, ignore_errors=True)
        self.held.clear()
        self._save()

    def _save(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.work_dir / f".{USERS_FILE}.tmp"
        tmp.write_text(json.dumps(self.held))
        tmp.replace(self.work_dir / USERS_FILE)


#: The folder of a job's exit statuses (:data:`~phalanx.schemas.environment.EXIT_STATUS_DIR`).
EXIT_STATUSES = "exits"


def _owned_dir(path: Path, user: JobUser) -> None:
    """``path`` a directory of ``user``'s, mode 0700 (made, or taken over as it is)."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if path.is_symlink() or not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    os.chown(path, user.uid, user.gid)
    os.chmod(path, 0o700)

"""Confined memory: each rank of a job that sets ``memory_per_rank`` in a cgroup of its own.

A rank that allocates past its job's ``memory_per_rank`` must die alone: not its
node's other ranks, not another job's, not the agent. So the agent puts each process
of such a job, before it runs any of the job's code (it is held until then), in a
memory cgroup of its own, a child of the agent's own cgroup, limited to
``memory_per_rank`` bytes with no swap beyond it; the kernel's OOM killer then picks
inside that cgroup alone. When the process has ended, the cgroup says whether the OOM
killer ended it (``oom_kill`` in ``memory.oom_control``, cgroup v1, or
``memory.events``, v2), the agent reports the exit with cause ``oom``, and removes it.

Both hierarchies are served: cgroup v1 where the ``memory`` controller is mounted on
its own (the cgroup is ``<mount>/<agent's cgroup>/phalanx-<node>-<rank>``), else
cgroup v2 (the same under the unified mount, with ``memory.oom.group`` 0 so that the
kernel kills the process, not its whole cgroup, and ``memory.swap.max`` 0). On v2 the
agent's own cgroup must have the memory controller delegated to its children
(``+memory`` in its ``cgroup.subtree_control``, which the agent writes itself where it
may; a cgroup that holds processes itself may not, which is why a container's agent
runs in a cgroup of its own: docs/deploy.md).

What is not confined: a warm spare runs its imports for a moment before it is moved
into its cgroup (a spare is not held); a rank's pages that it shares with the zygote it
was forked from stay charged to the zygote. Where no memory cgroup can be made here
(:meth:`MemoryCgroups.find` says why), ranks run unconfined and their logs say so.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("phalanx.agent.cgroups")
_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


class MemoryCgroups:
    """The memory cgroups this agent makes for its ranks, under ``parent``.

    Args:
        parent: the agent's own cgroup directory (in the mounted hierarchy).
        version: 1 or 2.
    """

    def __init__(self, parent: Path, version: int) -> None:
        self.parent = parent
        self.version = version

    @classmethod
    def find(cls, mountinfo: str | None = None,
             own: str | None = None) -> tuple[MemoryCgroups | None, str]:
        """This agent's memory cgroups, or None and why there are none.

        Args:
            mountinfo / own: the text of ``/proc/self/mountinfo`` and ``/proc/self/cgroup``
                (read here when None).
        """
        mountinfo = Path("/proc/self/mountinfo").read_text() if mountinfo is None else mountinfo
        own = Path("/proc/self/cgroup").read_text() if own is None else own
        v1 = v2 = None  # (mount point, the hierarchy's path mounted there)
        for line in mountinfo.splitlines():
            if " - " not in line:
                continue
            fields, after = line.split(" - ", 1)[0].split(), line.split(" - ", 1)[1].split()
            if after[0] == "cgroup" and "memory" in after[-1].split(","):
                v1 = (fields[4], fields[3])
            elif after[0] == "cgroup2" and v2 is None:
                v2 = (fields[4], fields[3])
        paths: dict[str, str] = {}  # controller ("" for v2) -> this process's cgroup
        for line in own.splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
        if v1 is not None and "memory" in paths:
            found = cls(_under(v1, paths["memory"]), 1)
        elif v2 is not None and "" in paths:
            parent = _under(v2, paths[""])
            if "memory" not in _read(parent / "cgroup.controllers").split():
                return None, (f"the memory controller is not available to {parent} "
                              "(cgroup v2: delegate it to the agent's cgroup)")
            found = cls(parent, 2)
        else:
            return None, "no memory cgroup hierarchy is mounted"
        if not os.access(found.parent, os.W_OK):
            return None, f"{found.parent} is not writable by the agent"
        return found, ""

    def path(self, node_id: str, process: str) -> Path:
        """The cgroup of one rank process (``process``: its job, replica and group rank)."""
        return self.parent / _NAME.sub("_", f"phalanx-{node_id}-{process}")

    def create(self, path: Path, limit: int) -> None:
        """Make the cgroup ``path`` limited to ``limit`` bytes of memory, none of swap.

        Raises:
            OSError: it cannot be made or limited.
        """
        if self.version == 2:
            with contextlib.suppress(OSError):  # delegated already, or not ours to change
                _write(self.parent / "cgroup.subtree_control", "+memory")
        path.mkdir(exist_ok=True)
        if self.version == 1:
            _write(path / "memory.limit_in_bytes", str(limit))
            with contextlib.suppress(OSError):  # no swap accounting on this kernel
                _write(path / "memory.memsw.limit_in_bytes", str(limit))
            with contextlib.suppress(OSError):
                _write(path / "memory.swappiness", "0")
        else:
            _write(path / "memory.max", str(limit))
            with contextlib.suppress(OSError):
                _write(path / "memory.swap.max", "0")
            with contextlib.suppress(OSError):  # kill the process, not the cgroup
                _write(path / "memory.oom.group", "0")

    def join(self, path: Path, pid: int) -> None:
        """Move process ``pid`` into the cgroup ``path`` (its later children follow it).

        Raises:
            OSError: it cannot be moved (it is gone, or the cgroup is).
        """
        _write(path / "cgroup.procs", str(pid))

    def oom_killed(self, path: Path) -> bool:
        """Whether the OOM killer killed a process in the cgroup ``path``."""
        text = _read(path / ("memory.oom_control" if self.version == 1 else "memory.events"))
        counts = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self, path: Path) -> None:
        """Remove the cgroup ``path``, once its processes are gone (no error if it is)."""
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            log.warning("a rank's cgroup still holds processes: left", extra={
                "cgroup": str(path)})


def _under(mount: tuple[str, str], path: str) -> Path:
    """Where the cgroup ``path`` is, in a hierarchy whose ``root`` is mounted at ``point``
    (``mount``: the two)."""
    point, root = mount
    relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return Path(point) / ("" if relative == "." else relative.lstrip("/"))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with path.open("w") as f:
        f.write(value)

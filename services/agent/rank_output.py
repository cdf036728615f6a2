"""Ranks' output beyond their log files: tee'd to the agent's stdout, and the files kept
under a size.

A rank writes its stdout and stderr straight into its log file (``jobs/<job>/<name>.log``,
opened to append and inherited through the zygote): it never waits on its agent and
outlives the agent's restart. So the agent follows the files rather than the processes.
What a file gained since the last look goes to the agent's stdout a line at a time as
``<job>/<name> | <line>``, where Kubernetes keeps a pod's output (``kubectl logs`` of an
agent shows its ranks'), when ``agent.tee_rank_output`` is on. A file past
``agent.rank_log_max_bytes`` is copied to ``<name>.log.1`` (the one before it replaced)
and emptied, as logrotate's ``copytruncate`` does: the rank's appends go on at the new
end, and what it writes between the copy and the truncation (microseconds) is lost.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

#: At most this much of one file is read in one look: a rank printing faster than the
#: agent follows does not hold it up for long (the rest comes at the next look).
READ_LIMIT = 1 << 20
#: A line longer than this goes out in pieces of this size.
LINE_LIMIT = 64 << 10


@dataclasses.dataclass
class Followed:
    """Where the agent is in one log file."""

    offset: int = 0
    partial: bytes = b""
    """The end of what was read, not yet ended by a newline."""


def lines_of(followed: Followed, data: bytes) -> list[bytes]:
    """The whole lines ``data`` ends (each without its newline), after what ``followed``
    held of an unfinished one; keeps the new unfinished end in ``followed``. A line grown
    past :data:`LINE_LIMIT` is given in pieces of that size."""
    text = followed.partial + data
    *lines, followed.partial = text.split(b"\n")
    while len(followed.partial) >= LINE_LIMIT:
        lines.append(followed.partial[:LINE_LIMIT])
        followed.partial = followed.partial[LINE_LIMIT:]
    return [piece for line in lines for piece in _pieces(line)]


def _pieces(line: bytes) -> list[bytes]:
    return [line[i:i + LINE_LIMIT] for i in range(0, len(line), LINE_LIMIT)] or [b""]


class RankOutput:
    """Follows the rank logs under ``jobs_dir`` (``<job>/<name>.log``): each new line to
    ``write`` (None: no tee), prefixed ``<job>/<name> | ``, and each file past
    ``max_bytes`` (0: no limit) rotated to ``<name>.log.1``.

    A follower started on existing files begins at their ends: what was written before
    (by the ranks of an agent before this one) is in the files, not tee'd again.
    """

    def __init__(self, jobs_dir: Path, write: Callable[[bytes], object] | None,
                 max_bytes: int) -> None:
        self.jobs_dir = jobs_dir
        self.write = write
        self.max_bytes = max_bytes
        self.followed: dict[Path, Followed] = {}
        self.started = False

    def look(self) -> None:
        """One pass over the files (blocking reads: run it in a thread)."""
        present = set(self.jobs_dir.glob("*/*.log"))
        for gone in self.followed.keys() - present:
            del self.followed[gone]
        for path in sorted(present):
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # its job's folder went meanwhile
                continue
            followed = self.followed.get(path)
            if followed is None:
                followed = self.followed[path] = Followed(size if not self.started else 0)
            if size < followed.offset:  # emptied by someone else: start again at its top
                followed.offset, followed.partial = 0, b""
            if size > followed.offset:
                self._read(path, followed)
            # Once all of it is read: what the copy holds has been tee'd.
            if self.max_bytes and followed.offset >= max(self.max_bytes, size):
                self._rotate(path, followed)
        self.started = True

    def _read(self, path: Path, followed: Followed) -> None:
        try:
            with path.open("rb") as log:
                log.seek(followed.offset)
                data = log.read(READ_LIMIT)
        except FileNotFoundError:
            return
        followed.offset += len(data)
        if self.write is None:
            return
        prefix = f"{path.parent.name}/{path.stem} | ".encode()
        lines = lines_of(followed, data)
        if lines:
            self.write(b"".join(prefix + line + b"\n" for line in lines))

    def _rotate(self, path: Path, followed: Followed) -> None:
        """Copy the file (to what was read of it) beside it as ``.1``, then empty it."""
        kept = path.with_name(path.name + ".1")
        try:
            with path.open("rb") as source, kept.open("wb") as copy:
                shutil.copyfileobj(source, copy)
            with path.open("r+b") as log:
                log.truncate(0)
        except FileNotFoundError:
            return
        followed.offset = 0

"""docs/deploy.md's operator commands, run as written where they can run here.

The commands are read from the doc's ``sh`` blocks, and where each runs from the doc's
table "Which of these commands run where", so neither can drift from the other or from
the files: a command the table does not list fails the test, and so do a row that no
command begins with and a command the table says runs here that fails. A row "here
as `R`" runs ``R`` in place of the command's beginning, keeping its other words but
its options (``kubectl apply -k DIR`` is rendered as ``kubectl kustomize DIR``;
``docker compose -f F up -d --build`` is read as ``docker-compose -f F config``). The
commands run in order, in one folder holding a copy of the repository's ``deploy/``
(without any auth directory), ``examples/`` and ``pyproject.toml``, with the
virtualenv's ``bin`` first on the ``PATH`` (``phalanx``, ``python3``) and ``/secure/``
made a folder of the test's.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_local import DEPLOY, REPO

DOC = REPO / "docs" / "deploy.md"
TABLE_TITLE = "## Which of these commands run where"
HERE = "here"


@dataclasses.dataclass(frozen=True)
class Where:
    """A row of the doc's table: commands beginning so run here (as ``runs_as``, or as
    written when that is None), or need what ``needs`` says."""

    begins: tuple[str, ...]
    here: bool
    runs_as: tuple[str, ...] | None
    needs: str


def table(text: str) -> list[Where]:
    """The rows of the doc's table of where each command runs."""
    section = text.split(TABLE_TITLE, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue  # the header, its rule, the prose
        where = cells[1]
        here = where.startswith(HERE)
        runs_as = re.match(r"here as `([^`]+)`", where)
        for begins in re.findall(r"`([^`]+)`", cells[0]):
            rows.append(Where(tuple(shlex.split(begins)), here,
                              tuple(shlex.split(runs_as[1])) if runs_as else None, where))
    return rows


def commands(text: str) -> list[str]:
    """Each command of the doc's ``sh`` blocks, in order: continuation lines joined, a
    here-document kept with its command, comments and blank lines dropped; commands
    that share a line (``a; b``) apart."""
    found = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        lines = iter(re.sub(r"\s*\\\n\s*", " ", block).splitlines())
        for line in lines:
            if (heredoc := re.search(r"<<'(\w+)'", line)) is not None:
                body = []
                for more in lines:
                    body.append(more)
                    if more == heredoc[1]:
                        break
                found.append("\n".join([line, *body]))
                continue
            found += split_line(line)
    return found


def split_line(line: str) -> list[str]:
    """The commands of one line, as written: cut at a comment, apart at each ``;``
    (neither inside quotes)."""
    parts, current, quote = [], "", ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif char == ";":
            parts.append(current)
            current = ""
            continue
        current += char
    return [p.strip() for p in [*parts, current] if p.strip()]


def words_of(command: str) -> list[str]:
    """The words a command begins with (a here-document's first line)."""
    return shlex.split(command.splitlines()[0], comments=True)


def where(command: str, rows: list[Where]) -> Where | None:
    """The table's row for ``command``: the longest beginning it has."""
    words = words_of(command)
    matching = [r for r in rows if tuple(words[:len(r.begins)]) == r.begins]
    return max(matching, key=lambda r: len(r.begins), default=None)


def as_run(command: str, row: Where) -> str:
    """What the test runs for ``command`` (a row that runs here)."""
    if row.runs_as is None:
        return command
    rest = [w for w in words_of(command)[len(row.begins):] if not w.startswith("-")]
    return shlex.join([*row.runs_as, *rest])


def test_the_table_reads_rows_and_the_commands_split_as_a_shell_would() -> None:
    rows = table("## Which of these commands run where\n\n| command | where |\n| --- | --- |\n"
                 "| `a b`, `c` | here, as written |\n| `d -k` | here as `e f` (why) |\n"
                 "| `g` | a cluster |\n\n## Next\n| `h` | here |\n")
    assert rows == [Where(("a", "b"), True, None, "here, as written"),
                    Where(("c",), True, None, "here, as written"),
                    Where(("d", "-k"), True, ("e", "f"), "here as `e f` (why)"),
                    Where(("g",), False, None, "a cluster")]
    text = ("```sh\na b x \\\n  y > 'o#;' # why\n# a comment\nc; g\npython3 - <<'PY'\n"
            "print(1)\nPY\n```\n\n```yaml\nh: 1\n```\n")
    assert commands(text) == ["a b x y > 'o#;'", "c", "g", "python3 - <<'PY'\nprint(1)\nPY"]
    assert as_run("d -k dir -x", rows[2]) == "e f dir"
    assert where("a b x", rows) == rows[0] and where("a x", rows) is None


def test_every_command_of_the_doc_runs_here_or_is_said_to_need_more(tmp_path: Path) -> None:
    text = DOC.read_text()
    rows = table(text)
    listed = {c: where(c, rows) for c in commands(text)}
    assert not [c for c, row in listed.items() if row is None], "commands the table lacks"
    assert not [r.begins for r in rows if r not in listed.values()], "rows of no command"
    runs = [(c, row) for c, row in listed.items() if row is not None and row.here]
    assert runs, "no command of the doc runs here"
    for needed in ("kubectl", "docker-compose"):
        if shutil.which(needed) is None:
            if os.environ.get("CI"):
                pytest.fail(f"{needed} is not installed")
            pytest.skip(f"{needed} not installed")
    work = tmp_path / "repo"
    shutil.copytree(DEPLOY, work / "deploy", ignore=shutil.ignore_patterns("auth"))
    shutil.copytree(REPO / "examples", work / "examples")
    shutil.copy(REPO / "pyproject.toml", work)
    secure = tmp_path / "secure"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}"}
    for command, row in runs:
        run = as_run(command, row).replace("/secure/", f"{secure}/")
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", run], cwd=work, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{command!r} (run as {run!r}) failed: {result.stderr}"
    # What they made is what the next steps use: each auth directory's Secrets and values.
    for auth in (work / "deploy/k8s/overlays/local/auth", secure / "phalanx-auth"):
        assert {"secrets.yaml", "nats-auth-values.yaml"} <= {p.name for p in auth.iterdir()}

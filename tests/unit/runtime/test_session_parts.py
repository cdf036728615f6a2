"""The session's private attributes are its own: its parts (membership, the resume, the
step runner, the epoch loop) take :class:`~phalanx.runtime.session_state.SessionState`,
and neither they nor any script, benchmark or test reach into the session."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ELASTIC = ROOT / "runtime" / "elastic.py"
#: Where code that might use a session lives.
FOLDERS = ("runtime", "services", "bench", "examples", "tests")


def private_attributes(elastic: Path) -> set[str]:
    """The private names of ``ElasticSession``: its ``self._x`` attributes and methods."""
    tree = ast.parse(elastic.read_text())
    session = next(node for node in tree.body
                   if isinstance(node, ast.ClassDef) and node.name == "ElasticSession")
    names = {node.name for node in session.body
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    names |= {node.attr for node in ast.walk(session) if isinstance(node, ast.Attribute)
              and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def reaches_in(root: Path, private: set[str]) -> list[str]:
    """Every ``<x>._name`` outside elastic.py where ``_name`` is the session's and ``x`` is
    not ``self``: ``file:line: expression``."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if path == root / "runtime" / "elastic.py":
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in private and not (
                        isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: "
                                 f"{ast.unparse(node)}")
    return found


def test_the_session_has_private_state_and_nothing_outside_it_names_it() -> None:
    private = private_attributes(ELASTIC)
    assert {"_s", "_membership", "_runner", "_loop"} <= private
    assert reaches_in(ROOT, private) == []


def test_a_reach_into_the_session_is_reported(tmp_path: Path) -> None:
    """Control: a part that reads the session's state through the session is named."""
    (tmp_path / "runtime").mkdir()
    part = tmp_path / "runtime" / "part.py"
    part.write_text("def committed(session):\n    return session._s.committed\n")
    assert reaches_in(tmp_path, private_attributes(ELASTIC)) == [
        "runtime/part.py:2: session._s"]

"""The port of the plain DDP char-GPT script to phalanx: its size, and the docs showing it.

``examples/chargpt_ddp.py`` (torchrun, DDP) and ``examples/chargpt.py`` (its port) are
compared as ``diff`` compares them: a changed line counts once removed and once added
(issue 24 measured the former port as 69 changed lines, 41 out and 28 in).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DDP, PORT = ROOT / "examples" / "chargpt_ddp.py", ROOT / "examples" / "chargpt.py"
#: What the port measures (11 out, 9 in). Issue 24 asks for at most 15; what is left is
#: one pair per concept (docs/runtime.md, The diff), see the test below.
MAX_CHANGED = 15


def port_diff() -> list[str]:
    """The port as one unified diff with the whole file as context (no header)."""
    ddp, port = DDP.read_text().splitlines(), PORT.read_text().splitlines()
    return list(difflib.unified_diff(ddp, port, lineterm="", n=len(ddp) + len(port)))[3:]


def test_the_port_of_the_ddp_script_is_small() -> None:
    changed = [line for line in port_diff() if line[:1] in "+-"]
    removed = sum(line.startswith("-") for line in changed)
    assert len(changed) <= MAX_CHANGED, (
        f"the port is {len(changed)} changed lines ({removed} out, "
        f"{len(changed) - removed} in):\n" + "\n".join(changed))


def test_the_docs_show_the_port_as_it_is() -> None:
    docs = (ROOT / "docs" / "runtime.md").read_text()
    section = docs[docs.index("## The diff"):]
    shown = re.search(r"```diff\n(.*?)```", section, re.DOTALL)
    assert shown is not None, "docs/runtime.md, The diff, has no diff block"
    diff = [line.rstrip() for line in port_diff()]
    # The block starts after the docstring the two files share.
    assert shown.group(1).splitlines() == diff[diff.index(" import math"):]

"""The ports of the plain DDP example scripts to phalanx: their size, and the docs showing
them.

``examples/chargpt_ddp.py`` (torchrun, DDP) and ``examples/chargpt.py`` (its port), and
``examples/cnn_ddp.py`` and ``examples/cnn.py``, and the FSDP2 HSDP trainer
``examples/chargpt_hsdp_torchrun.py`` and ``examples/chargpt_hsdp.py``, are compared as
``diff`` compares them: a changed line counts once removed and once added (issue 24
measured the former GPT port as 69 changed lines, 41 out and 28 in).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DDP, PORT = ROOT / "examples" / "chargpt_ddp.py", ROOT / "examples" / "chargpt.py"
#: What the port measures (11 out, 9 in). Issue 24 asks for at most 15; what is left is
#: one pair per concept (docs/runtime.md, The diff), see the test below.
MAX_CHANGED = 15


#: The image classifier's port (issue 50 asks for at most 15, as for the char-GPT): the
#: GPT's kinds of change (the sampler and loader are the session's, the epochs its, the
#: update its commit) and one of gradient accumulation, which the session does itself:
#: the script's count becomes 1, and its ``no_sync()``, ``loss / accumulation`` and the
#: ``if`` around the update stay (docs/runtime.md, What else a DDP script carries over).
CNN_DDP, CNN_PORT, CNN_MAX_CHANGED = (ROOT / "examples" / "cnn_ddp.py",
                                      ROOT / "examples" / "cnn.py", 15)


#: The FSDP2 HSDP trainer's port (issue 52 asks for at most 20): its mesh over the group,
#: and the DDP port's lines but ``session.backward(loss)`` (docs/hsdp.md, The port).
HSDP, HSDP_PORT, HSDP_MAX_CHANGED = (ROOT / "examples" / "chargpt_hsdp_torchrun.py",
                                     ROOT / "examples" / "chargpt_hsdp.py", 20)


def port_diff(ddp_path: Path = DDP, port_path: Path = PORT) -> list[str]:
    """The port as one unified diff with the whole file as context (no header)."""
    ddp, port = ddp_path.read_text().splitlines(), port_path.read_text().splitlines()
    return list(difflib.unified_diff(ddp, port, lineterm="", n=len(ddp) + len(port)))[3:]


@pytest.mark.parametrize(("ddp", "port", "most"), [(DDP, PORT, MAX_CHANGED),
                                                   (CNN_DDP, CNN_PORT, CNN_MAX_CHANGED),
                                                   (HSDP, HSDP_PORT, HSDP_MAX_CHANGED)],
                         ids=["chargpt", "cnn", "hsdp"])
def test_the_port_of_the_ddp_script_is_small(ddp: Path, port: Path, most: int) -> None:
    changed = [line for line in port_diff(ddp, port) if line[:1] in "+-"]
    removed = sum(line.startswith("-") for line in changed)
    assert len(changed) <= most, (
        f"the port is {len(changed)} changed lines ({removed} out, "
        f"{len(changed) - removed} in):\n" + "\n".join(changed))


def test_the_cnn_port_keeps_its_accumulation_lines_at_a_count_of_one() -> None:
    """The session accumulates (the session refuses ``no_sync()``, whose fixed count cannot
    follow a rank's share of a step): the script's count is 1, and every other line of its
    accumulation, and what a script keeps (the EMA's update, the clip), stays as it was."""
    diff = port_diff(CNN_DDP, CNN_PORT)
    removed = [line[1:].strip() for line in diff if line[:1] == "-"]
    added = [line[1:].strip() for line in diff if line[:1] == "+"]
    kept = [line[1:].strip() for line in diff if line[:1] == " "]
    assert [line for line in removed if "accumulation" in line] == [
        "accumulation = args.global_batch // (args.micro_batch * dist.get_world_size())"]
    assert [line.split("#")[0].strip() for line in added if "accumulation" in line] == [
        "accumulation = 1"]
    for line in ("with nullcontext() if (i + 1) % accumulation == 0 else model.no_sync():",
                 "loss = classification_loss(model, x.to(device), y.to(device)) / accumulation",
                 "if (i + 1) % accumulation:", "ema.update_parameters(model)",
                 "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)", "scheduler.step()"):
        assert line in kept, line


@pytest.mark.parametrize(("page", "heading", "plain", "port"), [
    ("runtime.md", "## The diff", DDP, PORT), ("hsdp.md", "## The port", HSDP, HSDP_PORT)],
    ids=["chargpt", "hsdp"])
def test_the_docs_show_the_port_as_it_is(page: str, heading: str, plain: Path,
                                         port: Path) -> None:
    docs = (ROOT / "docs" / page).read_text()
    section = docs[docs.index(heading):]
    shown = re.search(r"```diff\n(.*?)```", section, re.DOTALL)
    assert shown is not None, f"docs/{page}, {heading}, has no diff block"
    diff = [line.rstrip() for line in port_diff(plain, port)]
    # The block starts after the docstring the two files share.
    assert shown.group(1).splitlines() == diff[diff.index(" import math"):]

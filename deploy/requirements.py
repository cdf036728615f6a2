"""The control-plane image's requirements: pyproject.toml's dependencies less the agents'.

The control-plane services (admission, health, elasticity, checkpoint) import no torch,
numpy, matplotlib or pynvml: those serve the agents (NVML discovery) and the ranks they
launch (the user's training script, the demo's plot). ``deploy/Dockerfile``'s
``control-plane`` target installs what this prints, then phalanx itself with
``--no-deps``, so the image's list is derived from pyproject.toml at build time and
cannot drift from it. A name in :data:`AGENT_ONLY` that pyproject.toml no longer lists
is an error, so a renamed dependency cannot slip into the image unnoticed.

    python3 deploy/requirements.py pyproject.toml > requirements.txt

Runs on the build stage's bare Python (3.11+: ``tomllib``), with nothing installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

#: Distributions only agents and ranks need (PEP 503 names).
AGENT_ONLY = ("torch", "numpy", "matplotlib", "nvidia-ml-py")


def name(requirement: str) -> str:
    """The PEP 503 normalized distribution name a PEP 508 requirement starts with."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match[1]).lower()


def control_plane(pyproject: Path) -> list[str]:
    """``pyproject``'s ``[project] dependencies`` without :data:`AGENT_ONLY`, in order.

    Raises:
        ValueError: an :data:`AGENT_ONLY` name is not among the dependencies.
    """
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    missing = set(AGENT_ONLY) - {name(d) for d in dependencies}
    if missing:
        raise ValueError(f"{pyproject}: no dependency named {sorted(missing)}; update "
                         f"AGENT_ONLY in {Path(__file__).name} to the new names")
    return [d for d in dependencies if name(d) not in AGENT_ONLY]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} PYPROJECT_TOML")
    try:
        print("\n".join(control_plane(Path(sys.argv[1]))))
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"{sys.argv[0]}: {exc!r}")

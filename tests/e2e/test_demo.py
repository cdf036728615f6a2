"""``phalanx demo``, the README's first command, at a small size: the job loses a rank,
a warm spare takes its place, and the model ends identical to the fault-free run's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_demo_recovers_through_a_warm_spare_and_matches_the_reference(
        tmp_path: Path) -> None:
    # Small widths train fast: 600 steps outlast the spare's join by far.
    result = subprocess.run(
        [sys.executable, "-m", "phalanx.services.cli", "demo", "--out", str(tmp_path),
         "--widths", "64,128,64", "--samples", "1280", "--steps", "600", "--kill-at", "20"],
        capture_output=True, text=True, timeout=600, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    summary = out[out.index("phalanx demo — summary"):]
    assert "replacement r1-1 from a warm spare: running" in summary, summary
    assert "a member" in summary  # it joined before the end
    assert "lost or repeated: 0" in summary
    assert "every sample exactly once per epoch: yes" in summary
    assert "largest parameter difference 0\n" in summary
    assert (tmp_path / "demo.png").exists()

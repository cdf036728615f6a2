"""The exit status of a rank process (:mod:`phalanx.runtime.teardown`): a lost state that
a later generation may find is EXIT_STATE_LOST and a rank fenced out of its job
EXIT_DROPPED, whether or not the process trained over gloo; anything else uncaught is 1."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phalanx.schemas.environment import EXIT_DROPPED, EXIT_STATE_LOST


@pytest.mark.parametrize("armed", [False, True], ids=["before-gloo", "after-gloo"])
@pytest.mark.parametrize(("raised", "status"), [
    ("StateLost('generation 6: no complete step')", EXIT_STATE_LOST),
    ("StateLost('no snapshots: never anywhere', retry=False)", 1),
    ("Dropped('r0-0 is not a member of generation 2 of j')", EXIT_DROPPED),
    ("RuntimeError('the script failed')", 1),
])
def test_an_uncaught_exception_ends_the_rank_with_its_status(armed: bool, raised: str,
                                                             status: int) -> None:
    script = ("from phalanx.runtime import teardown\n"
              "from phalanx.runtime.recovery import StateLost\n"
              "from phalanx.runtime.membership import Dropped\n"
              f"teardown.{'arm' if armed else 'watch'}()\n"
              f"raise {raised}\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == status, done.stderr
    assert raised.split("(")[0] in done.stderr  # the traceback is still printed

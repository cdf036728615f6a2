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


#: A sharded model's session alone, in the script's own group (world 1 here; torchrun
#: gives it S ranks): closing it leaves the process to end without gloo's teardown.
SHARDED_ALONE = """
import atexit, sys
atexit.register(lambda: print("torn down", flush=True))  # before phalanx.runtime's handler
import numpy as np, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from phalanx.runtime.dataset import MemmapDataset, write_arrays
from phalanx.runtime.elastic import ElasticSession
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = np.zeros((8, 4), dtype=np.float32)
data = MemmapDataset(write_arrays(sys.argv[1], {"x": x, "y": x[:, :2]}))
session = ElasticSession.from_env(model, optimizer, data, env={}, global_batch=4)
for step in session.steps(1):
    for (x, y), weight in step.batches():
        (torch.nn.functional.mse_loss(model(x), y) * weight).backward()
    step.commit()
session.close()
print("closed", flush=True)
"""


def test_a_sharded_session_alone_ends_without_gloos_teardown(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", SHARDED_ALONE, str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "closed" in done.stdout and "torn down" not in done.stdout

"""A job of three times the old 512-replica cap through the real control plane.

``bench/scale.py --big-job 1536``: real admission, health and elasticity processes and
192 simulated nodes (bench/loadgen.py). The job is admitted whole, its generation 0
reaches every member and every member applies it; a rank SIGKILLed is one crash fault,
answered by one fault generation without it and a join generation back to 1,536.
1,536 replicas is past elasticity's ``DEFER_ABOVE``: its state is stored behind the
events, not after each. (Values past one payload, at 16,384 replicas, are
tests/integration/test_spill.py's, against the same kind of server.) Its timings are
the benchmark's to record, not this test's to assert.
"""

from __future__ import annotations

import json

import pytest

from phalanx.bench import scale
from phalanx.services.elasticity.service import DEFER_ABOVE

REPLICAS = 1536


@pytest.mark.timeout(240)
def test_a_1536_replica_job_is_admitted_formed_and_survives_a_rank_fault(capsys) -> None:
    assert REPLICAS > DEFER_ABOVE
    assert scale.main(["--big-job", str(REPLICAS), "--big-per-process", "96",
                       "--big-heartbeat-s", "1", "--big-step-s", "1", "--big-timeout-s",
                       "60", "--no-record"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["big_job"]
    assert "error" not in result, result.get("error")
    assert result["admitted"] and result["world_size_0"] == REPLICAS
    assert result["applied_0"] == REPLICAS
    assert result["members_received"]["0"] == REPLICAS
    assert result["faults"] == [f"crash {result['crashes'][0]['replica_id']}"]
    reasons = [(g["reason"], g["world_size"]) for g in result["generations"].values()]
    assert reasons == [("start", REPLICAS), ("fault", REPLICAS - 1), ("join", REPLICAS)]
    assert result["generators_lost"] == 0
    stored = result["bytes"]
    assert stored["generation_stored"]["value_bytes"] == stored["generation"]["2"]
    assert stored["elasticity_state"] is not None and stored["health_state"] is not None

"""The control plane at cluster scale, in a size CI can run: ``bench/scale.py`` at 16
simulated nodes (128 ranks, 16 jobs) with a storm of 8 crashes, then a burst of 500
submissions.

The benchmark's own judge says what must hold at any size, and this test asserts it:
every job admitted and started, every crash reported by exactly one crash fault, no
fault nobody caused, every fault answered by exactly one fault generation of its job,
every generation received by every member; every submission of the burst answered and
queued, the slots freed taken from the queue, no node given more than its slots. Its
timings are the benchmark's to record, not this test's to assert.
"""

from __future__ import annotations

import json

import pytest

from phalanx.bench import scale


@pytest.mark.timeout(300)
def test_a_crash_storm_over_16_simulated_nodes_misses_and_doubles_nothing(capsys) -> None:
    assert scale.main(["--nodes", "16", "--crashes", "8", "--window-s", "2",
                       "--settle-s", "6", "--burst", "500", "--no-record"]) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["scale"]
    assert result["admitted"] == result["jobs"] == 16
    assert result["first_generations"] == 16
    assert result["crashes"] == 8
    assert result["crash_faults_missed"] == 0 and result["crash_faults_doubled"] == 0
    assert result["crash_faults_unexplained"] == 0
    assert result["faults_not_one_generation"] == 0
    assert result["fanout_missed"] == 0
    assert result["other_faults"] == {}, "the generator lagged: a hang or node loss it caused"
    burst = result["burst"]
    assert burst["answered"] == 500 and burst["refused"] == 0, burst["refusals"]
    assert burst["admitted_while_full"] == 0  # the burst queued behind the running jobs
    assert burst["freed_slots"] > 0 and burst["admitted_after_release"] > 0
    assert burst["nodes_over_their_slots"] == 0

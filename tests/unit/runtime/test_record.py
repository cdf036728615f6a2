"""Reading records back: a clean elastic run verifies; every kind of loss or repeat is named."""

from __future__ import annotations

import json
from pathlib import Path

from phalanx.runtime import record
from phalanx.runtime.data import ElasticOrder

ORDER = ElasticOrder(16, 4, seed=1)  # 4 steps per epoch


def run(worlds: list[int], generation_of: list[int] | None = None) -> dict[str, list[dict]]:
    """The records a run would write: step ``s`` on ``worlds[s]`` ranks."""
    records: dict[str, list[dict]] = {}
    for step, world in enumerate(worlds):
        generation = generation_of[step] if generation_of else 0
        epoch, in_epoch = divmod(step, ORDER.steps_per_epoch)
        for rank in range(world):
            indices = [i for m in ORDER.plan(epoch, in_epoch, world, rank, 2)
                       for i in m.indices]
            lines = records.setdefault(f"r{rank}-0", [])
            if step and not any(x["kind"] == "commit" and x["step"] == step - 1 for x in lines):
                # It sat out the last step: it receives the state at this one.
                lines.append({"kind": "adopt", "step": step, "generation": generation})
            lines.append({"kind": "batch", "step": step, "generation": generation,
                          "rank": rank, "world_size": world, "indices": indices, "loss": 0.25})
            lines.append({"kind": "commit", "step": step, "generation": generation,
                          "rank": rank, "t": 100.0 + step})
    return records


def test_a_run_whose_membership_changes_every_step_verifies() -> None:
    records = run([4, 3, 2, 4, 1, 3, 2, 2], [0, 1, 2, 3, 4, 5, 6, 6])
    assert record.verify(records, ORDER, 8) == []
    steps = record.timeline(records)
    assert [(s.step, s.world_size) for s in steps][:3] == [(0, 4), (1, 3), (2, 2)]
    assert steps[0].loss == 1.0  # the four shares summed


def test_a_repeated_step_is_named() -> None:
    records = run([2, 2, 2, 2])
    records["r0-0"].append({"kind": "commit", "step": 2, "generation": 0, "rank": 0,
                            "t": 200.0})
    assert any("repeated or skipped" in p for p in record.verify(records, ORDER, 4))


def test_a_missing_step_and_a_lost_share_are_named() -> None:
    records = run([2, 2, 2, 2])
    records["r1-0"] = [line for line in records["r1-0"]
                       if not (line["kind"] == "batch" and line["step"] == 1)]
    problems = record.verify(records, ORDER, 5)
    assert "steps never committed: [4]" in problems
    assert any(p.startswith("step 1 (generation 0) trained on 2 samples") for p in problems)
    assert "epoch 0 did not use every sample exactly once" in problems


def test_the_generation_that_ran_a_step_again_is_the_one_kept() -> None:
    records = run([2, 2, 2, 2])
    # A rank that died had committed step 3 in generation 0 before the survivors re-ran
    # it in generation 1 (its commit died with it).
    for line in run([1, 1, 1, 1], [1, 1, 1, 1])["r0-0"]:
        if line["step"] == 3:
            records["r0-0"].append(line)
    records["r0-0"] = [x for x in records["r0-0"] if not (x["step"] == 3
                                                          and x["generation"] == 0)]
    assert [s.generation for s in record.timeline(records)] == [0, 0, 0, 1]
    assert record.verify(records, ORDER, 4) == []


def test_records_are_read_per_replica_and_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "r0-0.jsonl").write_text(json.dumps({"kind": "commit"}) + "\n{\"kind\": \"ba")
    assert record.read(tmp_path) == {"r0-0": [{"kind": "commit"}]}


def test_a_snapshot_line_is_folded_into_its_steps_commit(tmp_path: Path) -> None:
    recorder = record.Recorder(tmp_path, "r0-0")
    recorder.write(kind="commit", step=4, compute_s=0.1)
    recorder.write(kind="snapshot", step=4, snapshot_s=0.02, snapshot_every=2)
    recorder.write(kind="commit", step=5, compute_s=0.1)  # its snapshot never recorded
    recorder.write(kind="snapshot", step=9, snapshot_s=0.02)  # no commit of 9: dropped
    recorder.close()
    lines = record.read(tmp_path)["r0-0"]
    assert [(line["kind"], line["step"], line.get("snapshot_s"), line.get("snapshot_every"))
            for line in lines] == [("commit", 4, 0.02, 2), ("commit", 5, None, None)]


def test_downtime_is_the_longest_gap_around_the_event_against_the_median_step() -> None:
    steps = [record.StepRecord(i, 0, 4, t, 0.0)
             for i, t in enumerate([0.0, 1.0, 2.0, 3.0, 6.5, 7.5])]
    gap, median = record.downtime(steps, at=3.2)
    assert (gap, median) == (3.5, 1.0)


def test_a_downtime_ends_where_the_next_event_starts() -> None:
    steps = [record.StepRecord(i, 0, 4, t, 0.0)
             for i, t in enumerate([0.0, 1.0, 2.0, 3.0, 4.5, 5.5, 9.0, 10.0])]
    assert record.downtime(steps, at=3.2, until=8.0) == (1.5, 1.0)
    assert record.downtime(steps, at=3.2) == (3.5, 1.0)  # the 3.5 s gap of the next event


def test_a_generation_that_starts_over_after_every_holder_of_the_state_died_is_named() -> None:
    """What the chaos benchmark once produced: every replica holding the job's progress was
    stopped, and new replicas trained from step 0 again; each step looks fine on its own."""
    records = run([2, 2, 2, 2])
    again = run([2, 2, 2, 2], [1, 1, 1, 1])
    for replica, lines in again.items():
        records[replica.replace("-0", "-1")] = [{**x, "t": x.get("t", 0) + 50} for x in lines]
    problems = record.verify(records, ORDER, 4)
    assert any("generation 1 trained 3 step(s) again" in p and "reached step 3" in p
               for p in problems), problems


def admitted_again(at: int, steps: int, world: int = 2) -> dict[str, list[dict]]:
    """A run preempted in step ``at`` (in flight: committed by one rank only) and admitted
    again, its replicas ``r<rank>-0`` again in generation 0 again, restored after step
    ``at - 1`` from memory; each line names its admission, as a Recorder writes it."""
    first = run([world] * steps)
    records: dict[str, list[dict]] = {}
    for replica, lines in first.items():
        kept = [x for x in lines if x["step"] < at
                or (x["step"] == at and replica == "r0-0")]
        again = [{**x, "admission": 2, "t": x.get("t", 0) + 50} for x in lines
                 if x["step"] >= at]
        restore = {"kind": "restore", "step": at, "generation": 0, "admission": 2}
        records[replica] = [{**x, "admission": 1} for x in kept] + [restore] + again
    return records


def test_a_run_admitted_again_verifies_across_its_admissions() -> None:
    """Both admissions number their generations from 0 and reuse the replica ids: the
    step the first one had in flight is kept as the second one ran it."""
    records = admitted_again(at=2, steps=4)
    assert record.verify(records, ORDER, 4) == []
    assert [(s.admission, s.generation) for s in record.timeline(records)] == [
        (1, 0), (1, 0), (2, 0), (2, 0)]


def test_a_sample_the_second_admission_trains_again_is_named() -> None:
    records = admitted_again(at=2, steps=4)
    records["r1-0"] = [x for x in records["r1-0"]
                       if not (x["kind"] == "batch" and x["step"] == 3 and x["admission"] == 2)]
    problems = record.verify(records, ORDER, 4)
    assert any(p.startswith("step 3 (generation 0 of admission 2) trained on 2 samples")
               for p in problems), problems


def test_a_recorder_names_its_admission_on_every_line(tmp_path: Path) -> None:
    recorder = record.Recorder(tmp_path, "r0-0", admission=2)
    recorder.write(kind="commit", step=0, generation=0)
    recorder.close()
    plain = record.Recorder(tmp_path, "r1-0")
    plain.write(kind="commit", step=0, generation=0)
    plain.close()
    lines = record.read(tmp_path)
    assert lines["r0-0"][0]["admission"] == 2 and "admission" not in lines["r1-0"][0]

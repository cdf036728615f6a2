"""What ``phalanx jobs``, ``job`` and ``top`` print, as pure functions of what the bus holds:
ids never cut into ambiguity, the job id first, the history's resume steps from the
members' own reports, nothing placed once a job ended, events at their own times."""

from __future__ import annotations

import io
import time

import msgspec
from rich.console import Console

from phalanx.schemas.messages import (
    ExitCause,
    Generation,
    GenerationApplied,
    GenerationReason,
    GenerationRecord,
    JobHistory,
    JobProgress,
    JobRecord,
    JobSpec,
    JobState,
    Member,
    RankExited,
    ReasonCode,
    ReplicaRange,
    StateSource,
)
from phalanx.services import top
from phalanx.services.cli.jobs import (
    history_lines,
    history_rows,
    job_lines,
    jobs_table,
    progress_fields,
    record_row,
)
from phalanx.services.tables import print_whole, step_cell

T0 = 1_795_700_000.0


def spec(name: str = "train", lo: int = 2, hi: int = 2) -> JobSpec:
    return JobSpec(name=name, team="nlp-research", priority_class="normal",
                   replicas=ReplicaRange(min=lo, max=hi), command=["python", "train.py"])


def record(job_id: str, state: JobState = JobState.ADMITTED, **kw) -> JobRecord:
    nodes = ["local-0", "local-1"] if state is JobState.ADMITTED else []
    return JobRecord(job_id=job_id, spec=spec(), state=state, submitted_at=T0, updated_at=T0,
                     reason_code=ReasonCode.ADMITTED, nodes=nodes, **kw)


def text(renderable, width: int = 80) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


def whole(table, width: int = 80) -> str:
    out = io.StringIO()
    print_whole(table, Console(file=out, width=width, color_system=None))
    return out.getvalue()


def test_ids_that_share_a_long_prefix_stay_whole_at_80_columns() -> None:
    records = [record("train-gpt-char-level-deterministic-a1b2c3"),
               record("train-gpt-char-level-deterministic-a1b2c4", JobState.PENDING)]
    rows = [{**record_row(r), "size": 2, "step": 120, "total_steps": 1000} for r in records]
    shown = whole(jobs_table(records, rows))
    assert all(r.job_id in shown for r in records), shown
    board = top.Board(jobs={r.job_id: r for r in records})
    shown = text(top.render(board, T0, 3.0))
    assert all(r.job_id in shown for r in records), shown
    # top's other cells stay whole too (its panel read "size (min..ma…"); a live view
    # fits its terminal, so with ids this long the columns past it (nodes) are off screen.
    assert "2 (2..2)" in shown and "admitted" in shown, shown


def test_no_cell_of_the_jobs_table_is_cut_in_a_narrow_terminal() -> None:
    """Issue 24: at 80 columns states read "admitt…" and steps "545/5…"; a step cut to
    "120/1" reads as another number. Every cell stays whole; only nodes wrap."""
    records = [record("train-gpt-char-level-deterministic-a1b2c3"),
               record("gpt-c0e626", JobState.FAILED, reason="r0-0 failed")]
    records[1] = msgspec.structs.replace(records[1], reason_code=ReasonCode.APP_FAILED)
    rows = [{**record_row(r), "size": 2, "step": 545, "total_steps": 1000} for r in records]
    for width in (60, 80, 200):
        shown = whole(jobs_table(records, rows), width)
        lines = shown.splitlines()
        for cell in ("admitted", "failed (app_failed)", "nlp-research", "normal", "2 (2..2)",
                     "545/1000", "local-0"):
            assert cell in shown, (width, shown)
        # One row's cells on one line: nothing folded but the nodes.
        assert any(line.split()[:2] == ["gpt-c0e626", "failed"] for line in lines if line.strip())


def test_an_ended_job_places_no_replicas() -> None:
    for state in (JobState.FINISHED, JobState.CANCELLED, JobState.FAILED, JobState.PENDING):
        assert record_row(record("j", state))["replicas"] == 0
    assert record_row(record("j"))["replicas"] == 2


def test_a_job_admitted_again_shows_the_step_it_had_reached_beside_its_own() -> None:
    again = progress_fields(JobProgress(job_id="j", step=40, reached=300, total_steps=1000),
                             record("j", admission=2))
    assert (again["step"], again["reached"]) == (40, 300)
    first = progress_fields(JobProgress(job_id="j", step=40), record("j"))
    assert (first["step"], first["reached"]) == (40, 40)  # not stored yet: its own step


def history() -> JobHistory:
    return JobHistory(job_id="j", generations=[
        GenerationRecord(generation=0, reason=GenerationReason.START, world_size=2,
                         members=["r0-0", "r1-0"], resume_step=0, decided_at=T0,
                         cause="admitted", applied_resume_step=0),
        GenerationRecord(generation=1, reason=GenerationReason.FAULT, world_size=1,
                         members=["r0-0"], resume_step=1, decided_at=T0 + 9.5,
                         cause="dropped r1-0", pause_s=0.4, applied_resume_step=59),
        GenerationRecord(generation=2, reason=GenerationReason.JOIN, world_size=2,
                         members=["r0-0", "r1-1"], resume_step=60, decided_at=T0 + 12,
                         cause="joined r1-1")])


def test_the_history_resumes_where_the_members_said_and_says_so() -> None:
    rows = history_rows(history().generations)
    assert [(g["resume_step"], g["resume_source"], g["decided_resume_step"]) for g in rows] == [
        (0, "members", 0), (59, "members", 1), (60, "elasticity", 60)]
    lines = history_lines(rows)
    assert "resumed after step 59 (its members' report)" in lines[1]
    assert "resume after step 60 (elasticity's estimate" in lines[2]


def test_a_restore_from_a_tier_says_how_many_steps_are_trained_again() -> None:
    """A down/up: the job had reached step 78, the durable tier held step 70."""
    restored = GenerationRecord(
        generation=0, reason=GenerationReason.START, world_size=4,
        members=["r0-0", "r1-0", "r2-0", "r3-0"], resume_step=78, decided_at=T0,
        cause="admitted", applied_resume_step=70, restored_from=StateSource.DURABLE)
    [line] = history_lines(history_rows([restored]))
    assert "resumed after step 70 (its members' report), state from durable storage, 8 " \
        "step(s) trained again (the job had reached step 78)" in line
    whole_again = msgspec.structs.replace(restored, applied_resume_step=78)
    [line] = history_lines(history_rows([whole_again]))
    assert "trained again" not in line


def test_a_generation_replaced_before_any_member_applied_it_says_so() -> None:
    """Seen after a cluster restart: two generations decided as the ranks died, shown
    as "resume after step 1 (elasticity's estimate)" while the job was at step 186."""
    gone = history()
    gone.generations.insert(2, GenerationRecord(
        generation=2, reason=GenerationReason.FAULT, world_size=1, members=["r1-0"],
        resume_step=1, decided_at=T0 + 10, cause="dropped r0-0"))
    gone.generations[3] = msgspec.structs.replace(gone.generations[3], generation=3)
    lines = history_lines(history_rows(gone.generations))
    assert "fault: 1 rank(s), never applied (g3 replaced it first) (dropped r0-0)" in lines[2]
    assert "step 1" not in lines[2]


def test_the_job_id_comes_first_and_scaling_after_the_record() -> None:
    row = {**record_row(record("j")), "scaling": {
        "sizes": [1, 2], "scale_up_cooldown_s": 30.0, "graceful_shutdown_timeout_s": 30.0,
        "scaling_timeout_s": 120.0, "pinned_replicas": None, "change": None},
        "history": history_rows(history().generations)}
    lines = job_lines(row, T0)
    assert lines[0].split() == ["job_id:", "j"]
    scaling = next(i for i, line in enumerate(lines) if line.split()[0] == "scaling:")
    assert scaling > next(i for i, line in enumerate(lines) if line.split()[0] == "reason:")
    assert lines.index(f"{'history':>18}:") > scaling


def test_the_job_view_is_read_by_people_and_the_json_by_programs() -> None:
    """Times as local times and how long ago, objects as pairs, lists comma-separated,
    nothing printed for a field that has no value, a failed rank's output indented."""
    reason = "r0-0 on n0: rank 0 exited with code 1: boom\nits last output:\nboom"
    row = {**record_row(record("j", JobState.FAILED, reason=reason)),
           "restart_policy": {"max_restarts": 16, "window_s": 300.0}, "eta_s": None,
           "members": ["r0-0", "r1-1"]}
    view = "\n".join(job_lines(row, T0 + 200))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(T0))
    assert f"submitted_at: {stamp} (3 min 20 s ago)" in view, view
    assert "restart_policy: max_restarts 16, window_s 300\n" in view
    assert view.endswith("members: r0-0, r1-1") and "nodes: -\n" in view
    assert "eta_s" not in view and "None" not in view
    assert f"reason: r0-0 on n0: rank 0 exited with code 1: boom\n{'':20}its last output:\n" \
        f"{'':20}boom\n" in view
    assert row["submitted_at"] == T0  # what --json prints is unchanged


def test_a_start_from_the_first_step_says_so() -> None:
    [start, *_] = history_lines(history_rows(history().generations))
    assert start == "g0 +0.0 s start: 2 rank(s), from the first step (admitted)"


def test_events_are_shown_at_their_own_time_in_the_order_they_happened() -> None:
    board = top.Board()
    # As `top --once` reads them: the applied generation was stored before the exit.
    board.note(GenerationApplied(job_id="j", generation=1, replica_id="r0-0",
                                 committed_step=60, resume_step=59), T0 + 10)
    board.note(RankExited(job_id="j", rank=0, node_id="local-0", pid=7, exited_at=T0 + 20,
                          cause=ExitCause.EXITED, exit_code=0), T0 + 20.5)
    board.note(Generation(job_id="j", generation=1, world_size=1, rendezvous="j-g1",
                          resume_step=1, reason=GenerationReason.FAULT,
                          members=[Member(replica_id="r0-0", rank=0, node_id="local-0",
                                          endpoint="h:1")]), T0 + 9)
    assert [at for at, _, _ in sorted(board.events)] == [T0 + 9, T0 + 10, T0 + 20]
    shown = text(top.render(board, T0 + 30, 3.0), width=120)
    assert shown.index("generation 1 (fault)") < shown.index("applied generation 1") \
        < shown.index("exited")


def test_checkpoint_sizes_read_in_binary_units() -> None:
    from phalanx.services.cli.ckpt import size_text

    assert [size_text(n) for n in (0, 1023, 1024, 8_242_480, 32_969_920, 5 << 30)] == [
        "0 B", "1023 B", "1.0 KiB", "7.9 MiB", "31.4 MiB", "5.0 GiB"]


def test_the_history_shows_earlier_admissions_each_ended_by_a_requeue() -> None:
    first = [GenerationRecord(generation=0, reason=GenerationReason.START, world_size=2,
                              members=["r0-0", "r1-0"], resume_step=0,
                              decided_at=T0 - 100, cause="admitted", applied_resume_step=0),
             GenerationRecord(generation=1, reason=GenerationReason.FAULT, world_size=1,
                              members=["r0-0"], resume_step=30, decided_at=T0 - 80,
                              cause="dropped r1-0")]
    stored = JobHistory(job_id="j", generations=history().generations, earlier=first)
    rows = history_rows(stored.generations)
    row = {**record_row(record("j")), "history": rows,
           "earlier_history": history_rows(stored.earlier)}
    lines = [line.strip() for line in job_lines(row, T0)]
    at = lines.index("history:")
    assert lines[at + 1:at + 4] == [
        "g0 +0.0 s start: 2 rank(s), from the first step (admitted)",
        "g1 +20.0 s fault: 1 rank(s), never applied (the job was requeued first) "
        "(dropped r1-0)",
        "requeued, then admitted again:"]
    # The current admission's times count from the first admission's start too.
    assert lines[at + 4].startswith("g0 +100.0 s start")
    assert lines[at + 5].startswith("g1 +109.5 s fault")


def test_a_job_back_from_an_outage_shows_the_step_it_had_reached() -> None:
    """Its new admission starts counting at 0; the step an earlier one reached is shown
    beside it until it is caught up (top read "step 0" for a job at step 78)."""
    assert step_cell(0, 200, 78) == "0/200 (reached 78)"
    assert step_cell(80, 200, 78) == step_cell(80, 200) == "80/200"
    job = record("gpt")
    board = top.Board(jobs={"gpt": job}, progress={"gpt": JobProgress(
        job_id="gpt", step=0, total_steps=200, reached=78)})
    assert "0/200 (reached 78)" in text(top.render(board, T0, 3.0), 120)
    rows = [{**record_row(job), "size": 2, "step": 0, "total_steps": 200, "reached": 78}]
    assert "0/200 (reached 78)" in whole(jobs_table([job], rows), 120)


def test_top_shows_the_generation_applied_and_one_decided_after_it_as_pending() -> None:
    """During a down/up outage top showed ``gen 2`` for a job still training in generation
    1: generation 2 was decided and never applied. The members' generation is shown, the
    decided one beside it as pending, with the applied generation's size."""
    decided = Generation(job_id="j", generation=2, reason=GenerationReason.JOIN,
                         world_size=2, members=[Member(replica_id="r0-0", rank=0, node_id="n0"),
                                                Member(replica_id="r1-1", rank=1, node_id="n1")],
                         rendezvous="j-g2", resume_step=60)
    board = top.Board(jobs={"j": record("j")}, generations={"j": decided},
                      histories={"j": history()})
    row = next(line for line in text(top.render(board, T0, 3.0), 120).splitlines()
               if line.lstrip("│ ").startswith("j "))
    assert "1 (2 pending)" in row and "1 (2..2)" in row, row
    assert top.generation_cells(decided, history()) == (1, "1 (2 pending)")
    applied = history()
    applied.generations[2] = msgspec.structs.replace(applied.generations[2],
                                                     applied_resume_step=60)
    assert top.generation_cells(decided, applied) == (2, "2")
    starting = JobHistory(job_id="j", generations=[msgspec.structs.replace(
        history().generations[0], applied_resume_step=None)])
    first = msgspec.structs.replace(
        decided, generation=0, reason=GenerationReason.START,
        members=[decided.members[0], msgspec.structs.replace(decided.members[1],
                                                             replica_id="r1-0")])
    assert top.generation_cells(first, starting) == (2, "- (0 pending)")
    assert top.generation_cells(decided, None) == (2, "2")  # no history yet: as decided
    # A history of another admission (or one behind the decision) is not this generation's.
    other = msgspec.structs.replace(decided, generation=1)
    assert top.generation_cells(other, history()) == (2, "1")
    assert top.generation_cells(None, applied) == (None, "-")


def test_a_replica_of_several_ranks_shows_its_ranks_and_their_slots() -> None:
    group = msgspec.structs.replace(spec(), ranks_per_replica=2, slots_per_replica=4)
    grouped = msgspec.structs.replace(record("hsdp"), spec=group)
    rows = [{**record_row(r), "size": 2, "step": 1, "total_steps": 10}
            for r in (grouped, record("ddp"))]
    assert (rows[0]["ranks_per_replica"], rows[0]["slots_per_replica"]) == (2, 4)
    shown = whole(jobs_table([grouped, record("ddp")], rows), 200)
    assert "2 (2..2) x 2 ranks x 4 slots" in shown, shown
    assert "2 (2..2) x" not in shown.split("hsdp")[1].split("\n", 1)[1], shown


def test_logs_of_a_replica_or_a_slot_are_every_process_of_its_group() -> None:
    from phalanx.services.cli.logs import ReplicaLog, _chosen

    names = ["r0-0_g0", "r0-0_g1", "r1-0_g0", "r1-0_g1", "r1-1_g0", "r1-1_g1", "r2-0"]
    logs = [ReplicaLog("n1", name) for name in names]
    assert [log.replica_id for log in _chosen(logs, "r1-0", None)] == ["r1-0_g0", "r1-0_g1"]
    assert [log.replica_id for log in _chosen(logs, None, 1)] == ["r1-1_g0", "r1-1_g1"]
    assert [log.replica_id for log in _chosen(logs, None, 2)] == ["r2-0"]
    assert _chosen(logs, None, 7) == [] and _chosen(logs, None, None) == logs

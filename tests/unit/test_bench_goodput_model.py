"""bench/goodput_model.py's rules: MTTF scaling, Young/Daly, ETTR falling with N for every
system, a system that loses nothing keeping all of it, and `goodput.py --project`'s JSON
naming every input's source."""

from __future__ import annotations

import json
import math

import pytest

from phalanx.bench import goodput, goodput_model
from phalanx.bench.goodput_model import (
    GROWTHS,
    INPUTS,
    KINDS,
    SYSTEMS,
    Input,
    SystemModel,
    ettr,
    fit_linear,
    mix,
    mttf_s,
    project,
    rate_from_mttf,
    values,
    young_daly_s,
)
from phalanx.schemas import MAX_PAYLOAD_BYTES
from phalanx.schemas.codec import encode
from phalanx.schemas.messages import Generation, GenerationReason, Member


def test_mttf_scales_as_one_over_n_from_the_published_mark() -> None:
    rate = rate_from_mttf(1.8, 16384)
    assert mttf_s(16384, rate) == pytest.approx(1.8 * 3600)
    # Kokolis et al.'s ~14 min at 131,072 GPUs follows from the same rate.
    assert mttf_s(131072, rate) / 60 == pytest.approx(13.5)
    assert mttf_s(2048, rate) == pytest.approx(2 * mttf_s(4096, rate))
    assert values()["rate"] == pytest.approx(rate)


def test_young_daly_minimises_checkpoint_cost_plus_lost_work() -> None:
    cost, mtbf = 5.0, 6480.0

    def waste(interval: float) -> float:  # a checkpoint per interval, half of one redone
        return cost / interval + interval / 2 / mtbf

    best = young_daly_s(cost, mtbf)
    assert best == pytest.approx(math.sqrt(2 * cost * mtbf))
    assert waste(best) < waste(best * 0.8) and waste(best) < waste(best * 1.25)


def test_a_line_is_fitted_through_measured_points_and_needs_two_sizes() -> None:
    line = fit_linear([(100.0, 3.0), (200.0, 5.0), (300.0, 7.0)])
    assert (line.intercept, line.slope) == pytest.approx((1.0, 0.02))
    assert line.at(1000) == pytest.approx(21.0)
    with pytest.raises(ValueError, match="two sizes"):
        fit_linear([(1024.0, 0.2), (1024.0, 0.3)])


def test_every_input_names_its_kind_and_source() -> None:
    with pytest.raises(ValueError, match="source"):
        Input(1.0, "s", "assumption", "")
    with pytest.raises(ValueError, match="kind"):
        Input(1.0, "s", "guess", "why not")
    for name, growth in GROWTHS.items():
        assert len({x for x, _ in growth.points}) >= 2, name
        assert growth.source, name


def test_a_generations_size_per_member_is_the_codecs() -> None:
    members = [Member(replica_id=f"r{i}-0", rank=i, node_id=f"node-{i // 8:05d}",
                      endpoint=f"10.0.{i // 256}.{i % 256}:29500") for i in range(1024)]
    generation = Generation(job_id="job-llm", generation=7, members=members,
                            world_size=1024, rendezvous="job-llm-g7", resume_step=1000,
                            reason=GenerationReason.FAULT)
    per_member = len(encode(generation)) / 1024
    assert per_member == pytest.approx(values()["generation_bytes_per_member"], rel=0.01)
    limit = goodput_model.max_generation_members(values(), MAX_PAYLOAD_BYTES)
    assert 14_000 < limit < 16384  # why 16,384 ranks is blocked as built


def test_the_mix_covers_every_kind_and_sums_to_one() -> None:
    shares = mix(values())
    assert set(shares) == set(KINDS)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["node"] > shares["rank"] > shares["hang"]  # Llama 3: mostly hardware


@pytest.mark.parametrize("system", SYSTEMS)
def test_ettr_falls_as_the_job_grows(system: str) -> None:
    sizes = [1024 * 2**i for i in range(8)]  # 1k .. 128k
    figures = [project(system, n).ettr for n in sizes]
    assert all(0 < e < 1 for e in figures)
    assert figures == sorted(figures, reverse=True), figures
    assert figures[0] > figures[-1]


def test_a_system_that_loses_nothing_keeps_every_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    free = SystemModel(lost=lambda kind, n, v, f: {"detect": 0.0},
                       overhead=lambda n, v: 0.0)
    monkeypatch.setitem(goodput_model.MODELS, "free", free)
    for n in (1024, 100_000):
        assert project("free", n).ettr == 1.0
    assert ettr(0.0, 60.0, 0.0) == 1.0
    assert ettr(30.0, 60.0, 0.0) == 0.5
    assert ettr(30.0, 60.0, 0.5) == 0.25
    assert ettr(120.0, 60.0, 0.0) == 0.0  # more lost than there is: nothing kept


def test_torchrun_pays_its_checkpoints_and_half_an_interval_per_failure() -> None:
    v = values()
    p = project("torchrun", 16384)
    c = goodput_model.checkpoint_s(v)
    interval = young_daly_s(c, p.mttf_s)
    assert p.overhead == pytest.approx(c / interval)
    assert p.by_cause_s["redo"] == pytest.approx(interval / 2)


def test_project_prints_a_table_and_json_with_every_input_and_its_source(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert goodput.main(["--project", "--no-record"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])["project"]
    assert set(data["inputs"]) == set(INPUTS) | set(GROWTHS)
    for name, entry in data["inputs"].items():
        assert entry["kind"] in ("measured", "fit", "published", "assumption"), name
        assert entry["source"], name
    assert {(p["system"], p["gpus"]) for p in data["projections"]} == {
        (s, n) for s in SYSTEMS for n in goodput_model.SIZES}
    assert any(line.startswith("| 16,384 |") for line in out)

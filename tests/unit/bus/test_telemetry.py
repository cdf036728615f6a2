"""Span names of bus operations: subjects with their ids named by what they are."""

from __future__ import annotations

import pytest

from phalanx.bus.telemetry import destination_template
from phalanx.schemas import subjects


@pytest.mark.parametrize(("subject", "template"), [
    (subjects.node_heartbeat("n-7"), "phalanx.node.{node}.heartbeat"),
    (subjects.agent_status("gpu-node-12"), "phalanx.agent.{node}.status"),
    (subjects.job_fault("train-42"), "phalanx.job.{job}.fault"),
    (subjects.rank_exited("train-42"), "phalanx.job.{job}.exited"),
    (subjects.ckpt_snapshot("train-42"), "phalanx.ckpt.{job}.snapshot"),
    (subjects.health_rank("train-42", 3), "phalanx.health.rank.{job}.{rank}"),
    (subjects.kv_subject(subjects.JOBS_BUCKET, "train-42"), "$KV.phalanx_jobs.{job}"),
    (subjects.kv_subject(subjects.NODES_BUCKET, "n-7"), "$KV.phalanx_nodes.{node}"),
    (subjects.admission_submit(), subjects.admission_submit()),
    (subjects.admission_leader("scale"), "phalanx.admission.leader.scale"),
    (subjects.ckpt_resume(), "phalanx.ckpt.resume"),
])
def test_the_template_names_each_id_by_its_kind_and_keeps_the_rest(subject: str,
                                                                   template: str) -> None:
    assert destination_template(subject) == template


def test_templates_do_not_grow_with_the_number_of_nodes_or_jobs() -> None:
    names = {destination_template(subjects.node_heartbeat(f"n{i}")) for i in range(100)}
    names |= {destination_template(subjects.job_generation(f"j{i}")) for i in range(100)}
    assert names == {"phalanx.node.{node}.heartbeat", "phalanx.job.{job}.generation"}

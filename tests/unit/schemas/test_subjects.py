"""Subject builders spell every subject; tokens can never widen or escape a subject."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError, SubjectError


@pytest.mark.parametrize(
    ("built", "expected"),
    [
        (lambda: subjects.node_heartbeat("gpu-07"), "phalanx.node.gpu-07.heartbeat"),
        (lambda: subjects.node_heartbeats(), "phalanx.node.*.heartbeat"),
        (lambda: subjects.agent_status("gpu-07"), "phalanx.agent.gpu-07.status"),
        (lambda: subjects.agent_launch("gpu-07"), "phalanx.agent.gpu-07.launch"),
        (lambda: subjects.admission_submit(), "phalanx.admission.submit"),
        (lambda: subjects.job_generation("llama_ft"), "phalanx.job.llama_ft.generation"),
        (lambda: subjects.job_fault("llama_ft"), "phalanx.job.llama_ft.fault"),
        (lambda: subjects.health_rank("llama_ft", 3), "phalanx.health.rank.llama_ft.3"),
        (lambda: subjects.health_rank("llama_ft", "12"), "phalanx.health.rank.llama_ft.12"),
        (lambda: subjects.ckpt_snapshot("llama_ft"), "phalanx.ckpt.llama_ft.snapshot"),
    ],
    ids=["node_heartbeat", "node_heartbeats", "agent_status", "agent_launch",
         "admission_submit", "job_generation", "job_fault", "health_rank",
         "health_rank_str", "ckpt_snapshot"],
)
def test_builders_yield_the_documented_form(built, expected: str) -> None:
    assert built() == expected


def test_wildcard_matches_every_concrete_heartbeat_subject() -> None:
    pattern = re.escape(subjects.node_heartbeats()).replace(r"\*", r"[^.]+")
    assert re.fullmatch(pattern, subjects.node_heartbeat("n-1"))
    assert not re.fullmatch(pattern, subjects.agent_status("n-1"))


def test_nodes_bucket_name() -> None:
    assert subjects.NODES_BUCKET == "phalanx_nodes"


BAD_TOKENS = ["", "a.b", "*", ">", "a b", "$x", "a\tb", "é", "a/b", "x\r"]


@pytest.mark.parametrize("value", BAD_TOKENS, ids=repr)
def test_token_rejects_forbidden_values(value: str) -> None:
    with pytest.raises(SubjectError) as excinfo:
        subjects.token(value, "node id")
    err = excinfo.value
    assert isinstance(err, ValueError)
    assert isinstance(err, PhalanxError)
    assert f"node id {value!r} cannot be a subject token" in str(err)


def test_token_rejects_trailing_newline() -> None:
    with pytest.raises(SubjectError):
        subjects.token("x\n", "node id")


@pytest.mark.parametrize("value", ["a", "gpu-node_07", "A-Z_0-9", "x" * 200])
def test_token_accepts_identifiers(value: str) -> None:
    assert subjects.token(value, "node id") == value


@pytest.mark.parametrize(("rank", "text"), [(0, "0"), (7, "7"), (1023, "1023")])
def test_token_accepts_ints(rank: int, text: str) -> None:
    assert subjects.token(rank, "rank") == text


@pytest.mark.parametrize(
    "build",
    [subjects.node_heartbeat, subjects.agent_status, subjects.agent_launch,
     subjects.job_generation, subjects.job_fault, subjects.ckpt_snapshot,
     lambda ident: subjects.health_rank(ident, 0), lambda ident: subjects.health_rank("j", ident)],
    ids=["node_heartbeat", "agent_status", "agent_launch", "job_generation", "job_fault",
         "ckpt_snapshot", "health_rank-job", "health_rank-rank"],
)
@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "$SYS"])
def test_every_builder_refuses_bad_identifiers(build, bad: str) -> None:
    with pytest.raises(SubjectError):
        build(bad)


def test_error_names_what_was_being_built() -> None:
    with pytest.raises(SubjectError, match=re.escape("job id 'a.b'")):
        subjects.job_fault("a.b")
    with pytest.raises(SubjectError, match="node id '>'"):
        subjects.agent_status(">")
    with pytest.raises(SubjectError, match=re.escape("rank '1.5'")):
        subjects.health_rank("j", 1.5)  # type: ignore[arg-type]


@settings(derandomize=True, database=None, max_examples=300)
@given(st.text(alphabet=st.characters(exclude_characters="\n"), max_size=12))
def test_token_accepts_exactly_the_identifier_alphabet(value: str) -> None:
    # A trailing "\n" is excluded here: see test_token_rejects_trailing_newline.
    valid = re.fullmatch(r"[A-Za-z0-9_-]+", value) is not None
    try:
        assert subjects.token(value, "t") == value
    except SubjectError:
        assert not valid
    else:
        assert valid
        assert subjects.node_heartbeat(value).split(".") == ["phalanx", "node", value,
                                                             "heartbeat"]

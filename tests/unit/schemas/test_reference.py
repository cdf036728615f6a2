"""docs/wire.md is generated from the code and checked to be current."""

from __future__ import annotations

from pathlib import Path

import msgspec.inspect as mi
import pytest

from phalanx.schemas import reference, subjects
from phalanx.schemas.codec import MAX_PAYLOAD_BYTES
from phalanx.schemas.messages import (
    ALL_MESSAGES,
    JobSpec,
    Member,
    NodeInfo,
    Placement,
    ReplicaRange,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
WIRE_MD = REPO_ROOT / "docs" / "wire.md"

SUBJECT_PATTERNS = [
    "phalanx.node.<node>.heartbeat",
    "phalanx.agent.<node>.status",
    "phalanx.agent.<node>.launch",
    "phalanx.agent.<node>.stop",
    "phalanx.agent.<node>.logs",
    "phalanx.admission.submit",
    "phalanx.admission.cancel",
    "phalanx.admission.requeue",
    "phalanx.admission.explain",
    "phalanx.admission.scale",
    "phalanx.admission.leader.<verb>",
    "phalanx.job.<job>.state",
    "phalanx.job.<job>.scaling",
    "phalanx.job.<job>.generation",
    "phalanx.job.<job>.ready",
    "phalanx.job.<job>.applied",
    "phalanx.job.<job>.given_up",
    "phalanx.job.<job>.fault",
    "phalanx.job.<job>.started",
    "phalanx.job.<job>.exited",
    "phalanx.agent.<node>.chaos",
    "phalanx.node.<node>.condition",
    "phalanx.health.rank.<job>.<rank>",
    "phalanx.node.<node>.chaos",
    "phalanx.ckpt.<job>.snapshot",
    "phalanx.agent.<node>.snapshot",
    "phalanx.ckpt.resume",
    "phalanx.agent.<node>.fetch.<job>",
]


@pytest.fixture(scope="module")
def text() -> str:
    return reference.render()


def test_render_is_deterministic(text: str) -> None:
    assert reference.render() == text
    assert text.endswith("\n") and not text.endswith("\n\n")


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
def test_every_message_has_a_section_with_its_wire_name(text: str, cls) -> None:
    assert f"### {cls.__name__}\n" in text
    assert f"Wire name: `{cls.wire_name()}`" in text
    for field in mi.type_info(cls).fields:
        assert f"| `{field.encode_name}` |" in text


@pytest.mark.parametrize("part", [NodeInfo, ReplicaRange, Placement, Member],
                         ids=lambda c: c.__name__)
def test_every_nested_part_has_a_section(text: str, part) -> None:
    assert f"### {part.__name__}\n" in text


@pytest.mark.parametrize("pattern", SUBJECT_PATTERNS)
def test_every_subject_pattern_is_listed(text: str, pattern: str) -> None:
    assert f"| `{pattern}` |" in text


def test_catalog_covers_every_subject_and_message(text: str) -> None:
    assert len(reference.CATALOG) == len(SUBJECT_PATTERNS)
    documented = {s.message for s in reference.CATALOG} | {
        s.reply for s in reference.CATALOG if s.reply} | {v[2] for v in reference.KV_VALUES}
    nested_only = {JobSpec}  # travels inside SubmitRequest and JobRecord
    assert documented | nested_only == set(ALL_MESSAGES)


def test_limits_and_bucket_are_stated(text: str) -> None:
    assert str(MAX_PAYLOAD_BYTES) in text
    assert f"`{subjects.NODES_BUCKET}`" in text


def test_constraints_are_rendered(text: str) -> None:
    # Ident fields show their pattern and lengths; enums their values.
    ident = mi.type_info(NodeInfo).fields[0].type
    assert f"min len 1, max len 128, ~ `{ident.pattern}`" in text
    assert '"crash" \\| "hang" \\| "straggler" \\| "node_lost"' in text


def test_check_accepts_a_current_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "wire.md"
    path.write_text(text)
    assert reference.main(["--check", str(path)]) == 0


def test_check_refuses_a_stale_file(tmp_path: Path, text: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wire.md"
    path.write_text(text.replace("phalanx.node_heartbeat.v1", "phalanx.node_heartbeat.v0"))
    assert reference.main(["--check", str(path)]) == 1
    assert f"{path} is stale" in capsys.readouterr().err


def test_check_refuses_a_file_with_only_a_trailing_change(tmp_path: Path, text: str) -> None:
    path = tmp_path / "wire.md"
    path.write_text(text + "\n")
    assert reference.main(["--check", str(path)]) == 1


def test_check_refuses_a_missing_file(tmp_path: Path) -> None:
    assert reference.main(["--check", str(tmp_path / "absent.md")]) == 1


def test_without_check_prints_the_reference(text: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert reference.main([]) == 0
    assert capsys.readouterr().out == text


def test_checked_in_wire_reference_is_current(text: str) -> None:
    assert WIRE_MD.is_file(), WIRE_MD
    assert WIRE_MD.read_text() == text, (
        "docs/wire.md is stale: run `python -m phalanx.schemas.reference > docs/wire.md`")
    assert reference.main(["--check", str(WIRE_MD)]) == 0

"""Job spec files: every invalid field is refused with its name, before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.services.client import SpecError, load_job_spec, new_job_id, parse_job_spec

VALID = {"name": "llm", "team": "nlp", "priority_class": "high",
         "replicas": {"min": 2, "max": 4}, "slots_per_replica": 2,
         "command": ["python", "train.py"], "placement": {"node_labels": {"gpu": "a100"}},
         "schedule_timeout_s": 600}


def test_a_valid_spec_round_trips_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: llm\nteam: nlp\npriority_class: high\nreplicas: {min: 2, max: 4}\n"
                    "slots_per_replica: 2\ncommand: [python, train.py]\n"
                    "placement: {node_labels: {gpu: a100}}\nschedule_timeout_s: 600\n")
    assert load_job_spec(path) == parse_job_spec(VALID)


@pytest.mark.parametrize(("change", "named"), [
    ({"replicas": {"min": 5, "max": 2}}, "replicas.min 5 is greater than replicas.max 2"),
    ({"replicas": {"min": 0, "max": 2}}, "$.replicas.min"),
    ({"slots_per_replica": -1}, "$.slots_per_replica"),
    ({"command": []}, "$.command"),
    ({"name": "has space"}, "$.name"),
    ({"schedule_timeout_s": 0}, "$.schedule_timeout_s"),
    ({"gpus": 8}, "unknown field `gpus`"),
    ({"placement": {"node_label": {}}}, "unknown field `node_label`"),
    ({"replicas": "four"}, "$.replicas"),
    # What no process can be started with (the agent's exec would fail on each launch).
    ({"env": {"1ST": "x"}}, "at key `1ST` in `$.env`"),
    ({"env": {"A=B": "x"}}, "at key `A=B` in `$.env`"),
    ({"env": {"OK": "nul\x00byte"}}, "at `$.env.OK`"),
    ({"command": ["python", "train\x00.py"]}, "$.command[1]"),
])
def test_invalid_fields_are_named(change: dict, named: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_job_spec({**VALID, **change}, "job.yaml")
    assert named in str(err.value) and str(err.value).startswith("job.yaml: ")


def test_missing_required_field_is_named() -> None:
    spec = {k: v for k, v in VALID.items() if k != "team"}
    with pytest.raises(SpecError, match="missing required field `team`"):
        parse_job_spec(spec)


def test_unreadable_and_malformed_files_say_so(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_job_spec(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_job_spec(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(SpecError, match="expected a mapping of fields, got str"):
        load_job_spec(scalar)


def test_job_ids_are_readable_unique_subject_tokens() -> None:
    ids = {new_job_id("llm") for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("llm-") and "." not in i for i in ids)


@pytest.mark.parametrize(("typo", "meant"), [("replica", "replicas"),
                                             ("hang_timeout", "hang_timeout_s"),
                                             ("slot_per_replica", "slots_per_replica")])
def test_an_unknown_field_names_the_one_it_is_closest_to(typo: str, meant: str) -> None:
    with pytest.raises(SpecError, match=f"unknown field `{typo}` \\(did you mean `{meant}`\\?\\)"):
        parse_job_spec({**VALID, typo: 1})


def test_a_nested_unknown_field_gets_its_hint_and_path() -> None:
    with pytest.raises(SpecError, match="unknown field `max_app_failure` \\(did you mean "
                                        "`max_app_failures`\\?\\) - at `\\$.restart_policy`"):
        parse_job_spec({**VALID, "restart_policy": {"max_app_failure": 1}})


def test_every_error_is_reported_at_once_in_the_order_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: llm\nteam: nlp\npriority_class: high\nreplicas: {min: 2, max: 4}\n"
                    "hang_timeout: 5\nslots_per_replica: 0\ncommand: [python, train.py]\n"
                    "replica: 3\n")
    with pytest.raises(SpecError) as err:
        load_job_spec(path)
    first, *errors = str(err.value).splitlines()
    assert first == f"{path}: 3 errors:"
    assert [e.strip() for e in errors] == [
        "Object contains unknown field `hang_timeout` (did you mean `hang_timeout_s`?)",
        "Expected `int` >= 1 - at `$.slots_per_replica`",
        "Object contains unknown field `replica` (did you mean `replicas`?)"]


def test_a_spec_without_command_says_so_with_the_other_missing_fields() -> None:
    spec = {k: v for k, v in VALID.items() if k not in ("command", "priority_class")}
    with pytest.raises(SpecError) as err:
        parse_job_spec(spec)
    assert "missing required field `command`" in str(err.value)
    assert "missing required field `priority_class`" in str(err.value)
    spec = {k: v for k, v in VALID.items() if k != "command"}
    with pytest.raises(SpecError, match="^job spec: Object missing required field `command`$"):
        parse_job_spec(spec)


@pytest.mark.parametrize(("change", "said"), [
    ({"name": "has space"}, "Expected `str` of letters, digits, '_' and '-' only "
                            "(got 'has space') - at `$.name`"),
    ({"env": {"1ST": "x"}}, "Expected `str` of an environment variable's name (letters, "
                            "digits and '_', not starting with a digit) - at key `1ST` in `$.env`"),
    ({"command": "python train.py --epochs 2"},
     "Expected `array`, got `str` (a YAML list: did you mean [python, train.py, --epochs, "
     "2]?) - at `$.command`"),
])
def test_an_error_says_what_is_allowed_in_words(change: dict, said: str) -> None:
    """Not the pattern's regex, nor a bare type name where a list was meant."""
    with pytest.raises(SpecError) as err:
        parse_job_spec({**VALID, **change}, "job.yaml")
    assert str(err.value) == f"job.yaml: {said}"


def test_a_bad_env_entry_names_its_key() -> None:
    """msgspec says ``$.env[...]`` for any bad value of a mapping; each is named."""
    spec = {**VALID, "env": {"OMP_NUM_THREADS": 4, "GOOD": "x", "1BAD": "y", "LIST": [1]}}
    with pytest.raises(SpecError) as err:
        parse_job_spec(spec)
    assert [e.strip() for e in str(err.value).splitlines()[1:]] == [
        "Expected `str`, got `int` - at `$.env.OMP_NUM_THREADS`",
        "Expected `str` of an environment variable's name (letters, digits and '_', not "
        "starting with a digit) - at key `1BAD` in `$.env`",
        "Expected `str`, got `array` - at `$.env.LIST`"]


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[3] / "examples")
                                        .glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_job_spec_is_valid(path: Path) -> None:
    assert load_job_spec(path).name == path.stem

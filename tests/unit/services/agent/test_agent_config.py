"""AgentConfig: PHALANX_AGENT_* parsing and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.schemas.registry import DEFAULT_LOST_AFTER_S
from phalanx.services.agent.config import AgentConfig, parse_labels

BASE = {"PHALANX_AGENT_NODE_ID": "gpu-07"}


def test_from_env_reads_every_field() -> None:
    env = {
        "PHALANX_AGENT_NODE_ID": "gpu-07",
        "PHALANX_AGENT_SLOTS": "8",
        "PHALANX_AGENT_FAILURE_DOMAIN": "rack-3",
        "PHALANX_AGENT_LABELS": "a=1,b=2",
        "PHALANX_AGENT_HEARTBEAT_INTERVAL_S": "0.25",
        "PHALANX_AGENT_LOST_AFTER_S": "2",
        "PHALANX_AGENT_SHUTDOWN_TIMEOUT_S": "7.5",
    }
    assert AgentConfig.from_env(env) == AgentConfig(
        node_id="gpu-07", slots=8, failure_domain="rack-3", labels={"a": "1", "b": "2"},
        heartbeat_interval_s=0.25, lost_after_s=2.0, shutdown_timeout_s=7.5,
    )


def test_from_env_converts_types() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_SLOTS": "16",
                                   "PHALANX_AGENT_LOST_AFTER_S": "4"})
    assert config.slots == 16 and isinstance(config.slots, int)
    assert config.lost_after_s == 4.0 and isinstance(config.lost_after_s, float)


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("Yes", True),
                                            ("0", False), ("false", False), ("", False)])
def test_flags_are_parsed(raw: str, value: bool) -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_STOP_IS_RESTART": raw,
                                   "PHALANX_AGENT_LAUNCH": raw})
    assert config.stop_is_restart is value and config.launch is value


def test_a_bad_flag_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="PHALANX_AGENT_STOP_IS_RESTART must be 1/0"):
        AgentConfig.from_env({**BASE, "PHALANX_AGENT_STOP_IS_RESTART": "maybe"})


def test_defaults() -> None:
    config = AgentConfig.from_env(BASE)
    assert config.node_id == "gpu-07"
    assert config.slots is None  # decided at start: the GPUs NVML finds, else the CPUs
    assert config.discover_gpus is True and config.gpu_poll_interval_s == 1.0
    assert config.failure_domain == "default"
    assert config.labels == {}
    assert config.heartbeat_interval_s == 0.5
    assert config.lost_after_s == DEFAULT_LOST_AFTER_S
    assert config.shutdown_timeout_s == 5.0


def test_overrides_beat_env_and_none_is_ignored() -> None:
    env = {**BASE, "PHALANX_AGENT_SLOTS": "8", "PHALANX_AGENT_LABELS": "a=1"}
    config = AgentConfig.from_env(env, slots=2, node_id=None, labels={"z": "9"})
    assert config.slots == 2
    assert config.node_id == "gpu-07"
    assert config.labels == {"z": "9"}


def test_overrides_given_as_strings_are_parsed() -> None:
    config = AgentConfig.from_env(BASE, slots="3", labels="gpu=a100", lost_after_s="9")
    assert (config.slots, config.labels, config.lost_after_s) == (3, {"gpu": "a100"}, 9.0)


def test_unrelated_env_is_ignored() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT": "x", "PHALANX_NATS_URL": "y",
                                   "PHALANX_AGENT_UNKNOWN": "z"})
    assert config == AgentConfig.from_env(BASE)


@pytest.mark.parametrize(
    ("text", "labels"),
    [
        ("a=1,b=2", {"a": "1", "b": "2"}),
        (" gpu = a100 , zone=eu-1b ", {"gpu": "a100", "zone": "eu-1b"}),
        ("", {}),
        (",,", {}),
        ("a=", {"a": ""}),
        ("k=v=w", {"k": "v=w"}),
        ("a=1,a=2", {"a": "2"}),
    ],
)
def test_parse_labels(text: str, labels: dict[str, str]) -> None:
    assert parse_labels(text) == labels


@pytest.mark.parametrize("text", ["x", "a=1,x", "=v"])
def test_parse_labels_refuses_items_without_key_and_value(text: str) -> None:
    with pytest.raises(ValueError, match="is not key=value"):
        parse_labels(text)


# --- validation ----------------------------------------------------------------------------


def config_error(env: dict[str, str], *fragments: str, **overrides) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        AgentConfig.from_env(env, **overrides)
    for fragment in fragments:
        assert fragment in str(excinfo.value), f"{fragment!r} not in {excinfo.value}"
    return excinfo.value


def test_bad_label() -> None:
    config_error({**BASE, "PHALANX_AGENT_LABELS": "gpu=a100,x"}, "label 'x' is not key=value")


@pytest.mark.parametrize("slots", ["0", "-2"])
def test_slots_below_one(slots: str) -> None:
    config_error({**BASE, "PHALANX_AGENT_SLOTS": slots}, "agent.slots must be >= 1",
                 f"got {slots}")


@pytest.mark.parametrize("slots", ["many", "1.5", ""])
def test_slots_not_an_int(slots: str) -> None:
    config_error({**BASE, "PHALANX_AGENT_SLOTS": slots}, "agent config")


def test_interval_not_a_number() -> None:
    config_error({**BASE, "PHALANX_AGENT_HEARTBEAT_INTERVAL_S": "often"}, "agent config",
                 "often")


@pytest.mark.parametrize("node_id", ["a.b", "", "gpu*", "a b", "$SYS"])
def test_bad_node_id(node_id: str) -> None:
    config_error({"PHALANX_AGENT_NODE_ID": node_id}, "agent.node_id", repr(node_id))


def test_bad_failure_domain() -> None:
    config_error({**BASE, "PHALANX_AGENT_FAILURE_DOMAIN": "rack.3"}, "agent.failure_domain",
                 "'rack.3'")


@pytest.mark.parametrize(("interval", "lost"), [("0.5", "0.5"), ("1", "0.5"), ("3", "3.0")])
def test_lost_after_must_exceed_heartbeat_interval(interval: str, lost: str) -> None:
    config_error({**BASE, "PHALANX_AGENT_HEARTBEAT_INTERVAL_S": interval,
                  "PHALANX_AGENT_LOST_AFTER_S": lost},
                 "agent.lost_after_s", "agent.heartbeat_interval_s")


def test_lost_after_just_above_interval_is_accepted() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_HEARTBEAT_INTERVAL_S": "1",
                                   "PHALANX_AGENT_LOST_AFTER_S": "1.001"})
    assert config.lost_after_s == 1.001


@pytest.mark.parametrize("interval", ["0", "-1"])
def test_heartbeat_interval_must_be_positive(interval: str) -> None:
    config_error({**BASE, "PHALANX_AGENT_HEARTBEAT_INTERVAL_S": interval},
                 "agent.heartbeat_interval_s must be > 0")


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match=r"agent\.slots"):
        AgentConfig(node_id="n", slots=0)


def test_node_id_with_trailing_newline_is_refused() -> None:
    config_error({"PHALANX_AGENT_NODE_ID": "gpu-07\n"}, "agent.node_id")


@pytest.mark.parametrize("var", ["PHALANX_AGENT_HEARTBEAT_INTERVAL_S",
                                 "PHALANX_AGENT_LOST_AFTER_S"])
def test_nan_intervals_are_refused(var: str) -> None:
    config_error({**BASE, var: "nan"})


@pytest.mark.parametrize("nice", ["-1", "20"])
def test_replacement_nice_outside_0_to_19_is_refused(nice: str) -> None:
    config_error({**BASE, "PHALANX_AGENT_REPLACEMENT_NICE": nice},
                 "agent.replacement_nice must be within 0..19", f"got {nice}")


def test_replacement_nice_not_an_int() -> None:
    config_error({**BASE, "PHALANX_AGENT_REPLACEMENT_NICE": "low"}, "agent config", "low")


def test_the_ranks_shared_identity_excludes_per_job_identities() -> None:
    config = AgentConfig.from_env({"PHALANX_AGENT_RANK_NKEY": "/keys/ranks.nk"}, node_id="n1")
    assert config.rank_nkey == "/keys/ranks.nk"
    with pytest.raises(ConfigError, match="exclude each other"):
        AgentConfig(node_id="n1", rank_nkey="/keys/ranks.nk", rank_keys_dir="/auth/ranks")


def test_a_rank_token_key_is_a_third_way_for_ranks_and_excludes_the_others() -> None:
    config = AgentConfig.from_env({"PHALANX_AGENT_RANK_TOKEN_KEY_FILE": "/id/rank-token.key",
                                   "PHALANX_AGENT_RANK_TOKEN_TTL_S": "86400"}, node_id="n1")
    assert (config.rank_token_key_file, config.rank_token_ttl_s) == ("/id/rank-token.key",
                                                                     86400.0)
    with pytest.raises(ConfigError, match="rank_nkey and agent.rank_token_key_file exclude"):
        AgentConfig(node_id="n1", rank_nkey="/keys/ranks.nk", rank_token_key_file="/k")
    with pytest.raises(ConfigError, match="rank_token_ttl_s must be at least 60"):
        AgentConfig(node_id="n1", rank_token_ttl_s=5)


def test_the_rank_output_settings_are_read_and_checked() -> None:
    config = AgentConfig.from_env({**BASE, "PHALANX_AGENT_TEE_RANK_OUTPUT": "1",
                                   "PHALANX_AGENT_RANK_LOG_MAX_BYTES": "1000"})
    assert config.tee_rank_output is True and config.rank_log_max_bytes == 1000
    with pytest.raises(ConfigError, match="agent.rank_log_max_bytes must be >= 0"):
        AgentConfig.from_env({**BASE, "PHALANX_AGENT_RANK_LOG_MAX_BYTES": "-1"})


def test_a_pods_node_local_durable_default_is_warned_of_and_nowhere_else() -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    default = Path("/var/lib/phalanx/checkpoints")
    warning = AgentConfig(node_id="n").node_local_durable(default, pod)
    assert warning is not None and str(default) in warning
    assert "durable_url" in warning and "PHALANX_AGENT_CHECKPOINT_DIR" in warning
    assert AgentConfig(node_id="n").node_local_durable(default, {}) is None
    shared = AgentConfig(node_id="n", checkpoint_dir="/mnt/shared/checkpoints")
    assert shared.node_local_durable(default, pod) is None

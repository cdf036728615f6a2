"""BusConfig.load: overrides > environment > TOML file > defaults, validated at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.bus.config import DEFAULT_URL, BusConfig, with_identity
from phalanx.schemas.errors import ConfigError, PhalanxError


def write_toml(tmp_path: Path, body: str, name: str = "phalanx.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    path = tmp_path / "user.creds"
    path.write_text("-----BEGIN NATS USER JWT-----\n")
    return path


def test_defaults_with_empty_env() -> None:
    config = BusConfig.load(env={})
    assert config == BusConfig()
    assert config.servers == (DEFAULT_URL,)
    assert config.connect_timeout_s == 5.0
    assert config.user is None and config.creds_file is None
    assert not config.uses_tls


def test_file_overrides_defaults(tmp_path: Path) -> None:
    path = write_toml(tmp_path, """
[bus]
servers = ["nats://a:4222", "nats://b:4222"]
connect_timeout_s = 2
user = "alice"
password = "s3cret"
""")
    config = BusConfig.load(path, env={})
    assert config.servers == ("nats://a:4222", "nats://b:4222")
    assert config.connect_timeout_s == 2.0
    assert isinstance(config.connect_timeout_s, float)
    assert (config.user, config.password) == ("alice", "s3cret")
    assert config.reconnect_wait_s == 0.25  # untouched default


def test_file_may_give_servers_as_a_comma_separated_string(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\nservers = "nats://a:1, nats://b:2"\n')
    assert BusConfig.load(path, env={}).servers == ("nats://a:1", "nats://b:2")


def test_file_without_bus_table_gives_defaults(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[other]\nx = 1\n')
    assert BusConfig.load(path, env={}) == BusConfig()


def test_env_overrides_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, """
[bus]
servers = ["nats://file:4222"]
connect_timeout_s = 2
token = "file-token"
""")
    env = {"PHALANX_NATS_URL": "nats://env:4222", "PHALANX_NATS_CONNECT_TIMEOUT_S": "7.5"}
    config = BusConfig.load(path, env=env)
    assert config.servers == ("nats://env:4222",)
    assert config.connect_timeout_s == 7.5
    assert config.token == "file-token"  # not in env: the file's value stays


def test_overrides_beat_env_and_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\nservers = ["nats://file:4222"]\nconnect_timeout_s = 2\n')
    env = {"PHALANX_NATS_URL": "nats://env:4222", "PHALANX_NATS_CONNECT_TIMEOUT_S": "7"}
    config = BusConfig.load(path, env=env, servers=["nats://arg:4222"], connect_timeout_s=1)
    assert config.servers == ("nats://arg:4222",)
    assert config.connect_timeout_s == 1.0


def test_none_overrides_are_ignored() -> None:
    env = {"PHALANX_NATS_URL": "nats://env:4222"}
    config = BusConfig.load(env=env, servers=None, token=None)
    assert config.servers == ("nats://env:4222",)
    assert config.token is None


def test_empty_env_values_are_ignored(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\nservers = ["nats://file:4222"]\n')
    config = BusConfig.load(path, env={"PHALANX_NATS_URL": ""})
    assert config.servers == ("nats://file:4222",)


def test_config_file_path_from_env(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\ntoken = "from-file"\n')
    assert BusConfig.load(env={"PHALANX_CONFIG": str(path)}).token == "from-file"


def test_explicit_path_beats_phalanx_config(tmp_path: Path) -> None:
    explicit = write_toml(tmp_path, '[bus]\ntoken = "explicit"\n', "a.toml")
    from_env = write_toml(tmp_path, '[bus]\ntoken = "env"\n', "b.toml")
    config = BusConfig.load(explicit, env={"PHALANX_CONFIG": str(from_env)})
    assert config.token == "explicit"


def test_comma_separated_url_env() -> None:
    env = {"PHALANX_NATS_URL": "nats://a:4222, tls://b:4222 ,nats://c:4222"}
    config = BusConfig.load(env=env)
    assert config.servers == ("nats://a:4222", "tls://b:4222", "nats://c:4222")
    assert config.uses_tls


def test_every_env_variable_is_read(tmp_path: Path, creds: Path) -> None:
    files = {name: tmp_path / name for name in ("seed.nk", "ca.pem", "cert.pem", "key.pem")}
    for path in files.values():
        path.write_text("x")
    env = {
        "PHALANX_NATS_URL": "tls://n:4222",
        "PHALANX_NATS_USER": "u",
        "PHALANX_NATS_PASSWORD": "p",
        "PHALANX_NATS_TOKEN": "t",
        "PHALANX_NATS_NKEY": str(files["seed.nk"]),
        "PHALANX_NATS_CREDS": str(creds),
        "PHALANX_NATS_CA": str(files["ca.pem"]),
        "PHALANX_NATS_CERT": str(files["cert.pem"]),
        "PHALANX_NATS_KEY": str(files["key.pem"]),
        "PHALANX_NATS_CONNECT_TIMEOUT_S": "3",
        "PHALANX_NATS_REPLICAS": "3",
    }
    config = BusConfig.load(env=env)
    assert config == BusConfig(
        servers=("tls://n:4222",), user="u", password="p", token="t",
        nkey_seed_file=str(files["seed.nk"]), creds_file=str(creds),
        tls_ca_file=str(files["ca.pem"]), tls_cert_file=str(files["cert.pem"]),
        tls_key_file=str(files["key.pem"]), connect_timeout_s=3.0, jetstream_replicas=3,
    )


def test_jetstream_replicas_from_file_and_env(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[bus]\njetstream_replicas = 3\n")
    assert BusConfig.load(path, env={}).jetstream_replicas == 3
    assert BusConfig.load(path, env={"PHALANX_NATS_REPLICAS": "5"}).jetstream_replicas == 5
    assert BusConfig.load(env={}).jetstream_replicas == 1


@pytest.mark.parametrize("value", ["0", "6", "-1", "3.0", "three"])
def test_jetstream_replicas_out_of_range_or_not_an_integer(value: str) -> None:
    with pytest.raises(ConfigError, match="jetstream_replicas"):
        BusConfig.load(env={"PHALANX_NATS_REPLICAS": value})


@pytest.mark.parametrize("body", ["jetstream_replicas = 2.5", "jetstream_replicas = true",
                                  'jetstream_replicas = "x"'])
def test_jetstream_replicas_wrongly_typed_in_file(tmp_path: Path, body: str) -> None:
    with pytest.raises(ConfigError, match="jetstream_replicas"):
        BusConfig.load(write_toml(tmp_path, f"[bus]\n{body}\n"), env={})


def test_ca_file_turns_tls_on(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    assert BusConfig.load(env={}, tls_ca_file=str(ca)).uses_tls


# --- errors --------------------------------------------------------------------------------


def config_error(*fragments: str, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        BusConfig.load(**kwargs)
    err = excinfo.value
    assert isinstance(err, ValueError) and isinstance(err, PhalanxError)
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
    return err


def test_user_without_password() -> None:
    config_error("bus.user", "bus.password", env={"PHALANX_NATS_USER": "alice"})


def test_password_without_user() -> None:
    config_error("bus.user", "bus.password", env={}, password="s3cret")


def test_cert_without_key(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    config_error("bus.tls_cert_file", "bus.tls_key_file", env={"PHALANX_NATS_CERT": str(cert)})


def test_missing_creds_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.creds"
    config_error("bus.creds_file", "no such file", str(missing),
                 env={"PHALANX_NATS_CREDS": str(missing)})


def test_creds_path_that_is_a_directory(tmp_path: Path) -> None:
    config_error("bus.creds_file", env={}, creds_file=str(tmp_path))


@pytest.mark.parametrize("field", ["nkey_seed_file", "tls_ca_file"])
def test_other_missing_files(tmp_path: Path, field: str) -> None:
    config_error(f"bus.{field}", env={}, **{field: str(tmp_path / "absent")})


def test_unknown_option_in_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\nservers = ["nats://a:1"]\nreconect_wait_s = 1\n')
    err = config_error("unknown bus option", "reconect_wait_s", path=path, env={})
    assert "reconnect_wait_s" in str(err)  # the known options are listed


def test_unknown_override() -> None:
    config_error("unknown bus option", "colour", env={}, colour="red")


def test_invalid_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[bus\nservers = \n")
    config_error("not valid TOML", str(path), path=path, env={})


def test_bus_must_be_a_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'bus = "nats://a:1"\n')
    config_error("[bus] must be a table", path=path, env={})


def test_unreadable_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    config_error("cannot read config file", str(missing), path=missing, env={})


def test_config_file_named_by_env_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    config_error("cannot read config file", env={"PHALANX_CONFIG": str(missing)})


@pytest.mark.parametrize("value", ["soon", "", "1s"])
def test_non_number_timeout(value: str) -> None:
    if value == "":  # an empty env var is ignored, so pass it as an override
        config_error("bus.connect_timeout_s must be a number", env={}, connect_timeout_s=value)
    else:
        config_error("bus.connect_timeout_s must be a number", repr(value),
                     env={"PHALANX_NATS_CONNECT_TIMEOUT_S": value})


def test_non_number_timeout_in_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[bus]\nreconnect_wait_s = "fast"\n')
    config_error("bus.reconnect_wait_s must be a number", "'fast'", path=path, env={})


@pytest.mark.parametrize("value", ["0", "-1"])
def test_non_positive_connect_timeout(value: str) -> None:
    config_error("bus.connect_timeout_s must be > 0",
                 env={"PHALANX_NATS_CONNECT_TIMEOUT_S": value})


def test_negative_reconnect_wait() -> None:
    config_error("bus.reconnect_wait_s must be >= 0", env={}, reconnect_wait_s=-0.1)


def test_zero_reconnect_wait_is_allowed() -> None:
    assert BusConfig.load(env={}, reconnect_wait_s=0).reconnect_wait_s == 0.0


@pytest.mark.parametrize("value", ["", " ", "nats://a:1,,nats://b:2", ","])
def test_empty_server_urls(value: str) -> None:
    config_error("bus.servers", env={}, servers=value)


def test_empty_server_list_in_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[bus]\nservers = []\n")
    config_error("bus.servers", path=path, env={})


def test_nan_connect_timeout_is_refused() -> None:
    config_error("bus.connect_timeout_s", env={"PHALANX_NATS_CONNECT_TIMEOUT_S": "nan"})


@pytest.mark.parametrize(
    ("body", "field"),
    [("servers = 5", "bus.servers"), ("servers = [1, 2]", "bus.servers"),
     ("tls_ca_file = 5", "bus.tls_ca_file")],
    ids=["servers-int", "servers-int-list", "ca-int"],
)
def test_wrongly_typed_file_values_are_config_errors(tmp_path: Path, body: str,
                                                     field: str) -> None:
    path = write_toml(tmp_path, f"[bus]\n{body}\n")
    config_error(field, path=path, env={})


def test_a_child_with_an_identity_never_keeps_its_parents_credentials() -> None:
    parent = {"PHALANX_NATS_NKEY": "/agent.nk", "PHALANX_NATS_USER": "u",
              "PHALANX_NATS_PASSWORD": "p", "PHALANX_NATS_INBOX_PREFIX": "_INBOX.agent-a",
              "PHALANX_NATS_CA": "/ca.pem", "PATH": "/bin"}
    child = with_identity(parent, {"PHALANX_NATS_NKEY": "/job.nk"})
    assert child == {"PHALANX_NATS_NKEY": "/job.nk", "PHALANX_NATS_CA": "/ca.pem",
                     "PATH": "/bin"}


def test_an_inbox_prefix_cannot_widen_a_subscription() -> None:
    assert BusConfig.load(env={"PHALANX_NATS_INBOX_PREFIX": "_INBOX.rank-j1"}).inbox_prefix \
        == "_INBOX.rank-j1"
    with pytest.raises(ConfigError, match="inbox_prefix"):
        BusConfig.load(env={"PHALANX_NATS_INBOX_PREFIX": "_INBOX.>"})


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8080", "wss://nats.example:443"])
def test_a_websocket_server_is_refused_by_name(url: str) -> None:
    """phalanx leaves nats-py's websocket transport out (phalanx.bus.transport): a ws://
    URL is named at once, not met later as 'Could not import aiohttp transport'."""
    with pytest.raises(ConfigError, match=r"bus.servers: 'wss?://.*': phalanx connects over nats://"):
        BusConfig(servers=("nats://127.0.0.1:4222", url))

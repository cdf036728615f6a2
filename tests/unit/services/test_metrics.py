"""The metrics endpoint's configuration and exposition (prometheus_client on a real port)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from phalanx.bus.client import Counters
from phalanx.services import metrics


@pytest.mark.parametrize(("raw", "port"), [(None, None), ("", None), (" ", None), ("0", 0),
                                           ("9464", 9464), ("65535", 65535)])
def test_the_port_comes_from_the_environment(raw: str | None, port: int | None) -> None:
    env = {} if raw is None else {metrics.PORT_ENV: raw}
    assert metrics.port_from_env(env) == port


@pytest.mark.parametrize("raw", ["http", "-1", "65536", "94.64"])
def test_a_bad_port_is_refused_naming_the_variable_and_the_value(raw: str) -> None:
    with pytest.raises(metrics.MetricsConfigError) as error:
        metrics.port_from_env({metrics.PORT_ENV: raw})
    assert metrics.PORT_ENV in str(error.value) and repr(raw) in str(error.value)


def test_no_port_no_endpoint() -> None:
    assert metrics.serve({}) is None


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_endpoint_serves_the_exposition_with_what_was_counted() -> None:
    server = metrics.serve({metrics.PORT_ENV: "0", metrics.ADDR_ENV: "127.0.0.1"})
    assert server is not None
    port = server.server_address[1]
    metrics.register(metrics.BUS + metrics.HEALTH + metrics.ELASTICITY)
    try:
        metrics.FAULTS.labels("crash").inc()
        metrics.JOB_WORLD_SIZE.labels("unit-job").set(3)
        samples = _scrape(port)
        assert samples[("phalanx_faults_total", (("kind", "crash"),))] >= 1
        # phalanx_job, not job: Prometheus would rename that exported_job on scrape.
        assert samples[("phalanx_job_world_size", (("phalanx_job", "unit-job"),))] == 3
        assert ("phalanx_bus_reconnects_total", ()) in samples
        metrics.forget_job("unit-job", metrics.JOB_WORLD_SIZE, metrics.JOB_STEP)  # absent: fine
        assert ("phalanx_job_world_size", (("phalanx_job", "unit-job"),)) not in _scrape(port)
    finally:
        server.shutdown()
        server.server_close()


def test_an_inherited_socket_is_served_on_its_port_even_when_a_port_is_also_named() -> None:
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    # The server takes the socket over (as a child given it by its supervisor would).
    server = metrics.serve({metrics.FD_ENV: str(listening.detach()), metrics.PORT_ENV: "1"})
    assert server is not None and server.server_address[1] == port
    metrics.register(metrics.HEALTH)
    try:
        metrics.FAULTS.labels("hang").inc()
        assert _scrape(port)[("phalanx_faults_total", (("kind", "hang"),))] >= 1
    finally:
        server.shutdown()
        server.server_close()


def test_the_bus_failure_counts_of_every_connection_and_bucket_are_counters() -> None:
    server = metrics.serve({metrics.PORT_ENV: "0", metrics.ADDR_ENV: "127.0.0.1"})
    assert server is not None
    port = server.server_address[1]
    names = ("phalanx_bus_bad_messages_total", "phalanx_bus_handler_errors_total",
             "phalanx_bus_denials_total")
    metrics.register(metrics.BUS)
    try:
        before = _scrape(port)
        connection, bucket = Counters(), Counters()
        connection.bad_message("bad")
        bucket.bad_message("worse")
        connection.handler_error("boom")
        bucket.denial("Permissions Violation")
        after = _scrape(port)
        assert [after[(n, ())] - before[(n, ())] for n in names] == [2, 1, 1]
        assert (bucket.bad_messages, bucket.denials, bucket.last_error) == \
            (1, 1, "Permissions Violation")
        types = {f.name: f.type for f in text_string_to_metric_families(
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
            .read().decode())}
        assert all(types[n.removesuffix("_total")] == "counter" for n in names)
    finally:
        server.shutdown()
        server.server_close()


def test_a_family_is_exported_once_registered_and_registering_it_again_is_harmless() -> None:
    server = metrics.serve({metrics.PORT_ENV: "0", metrics.ADDR_ENV: "127.0.0.1"})
    assert server is not None
    port = server.server_address[1]
    family = Gauge("phalanx_unit_registered", "A family of this test only", registry=None)
    family.set(7)
    try:
        assert ("phalanx_unit_registered", ()) not in _scrape(port)
        metrics.register((family,))
        metrics.register((family,))  # a second service in the same process
        assert _scrape(port)[("phalanx_unit_registered", ())] == 7
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("raw", ["three", "-3", "3.0"])
def test_a_bad_descriptor_is_refused_naming_the_variable_and_the_value(raw: str) -> None:
    with pytest.raises(metrics.MetricsConfigError) as error:
        metrics.serve({metrics.FD_ENV: raw})
    assert metrics.FD_ENV in str(error.value) and repr(raw) in str(error.value)


def test_a_descriptor_that_is_no_socket_is_refused_naming_it(tmp_path) -> None:
    with (tmp_path / "file").open("w") as file:
        fd = file.fileno()
        with pytest.raises(metrics.MetricsConfigError) as error:
            metrics.serve({metrics.FD_ENV: str(fd)})
    assert f"{metrics.FD_ENV}={fd} is not an open socket" in str(error.value)

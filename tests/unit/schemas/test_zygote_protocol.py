"""Which commands a zygote may fork, and the frames an agent and its zygote exchange."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from phalanx.schemas import zygote as protocol

PYTHON = "/opt/venv/bin/python"


@pytest.fixture
def path(tmp_path: Path) -> str:
    """A PATH whose ``python`` is :data:`PYTHON`'s stand-in (an executable file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "python3.11"):
        (bin_dir / name).write_text("")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def entry(command: list[str], path: str, executable: str | None = None
          ) -> protocol.Entry | None:
    return protocol.python_entry(command, {"PATH": path},
                                 executable or os.path.join(path, "python"))


def test_a_script_or_a_module_of_the_same_interpreter_is_forkable(path: str) -> None:
    assert entry(["python", "train.py", "--lr", "3"], path) == protocol.Entry(
        argv=("train.py", "--lr", "3"))
    assert entry([os.path.join(path, "python"), "-u", "train.py"], path) == protocol.Entry(
        argv=("train.py",), unbuffered=True)
    assert entry(["python", "-u", "-m", "pkg.train", "-x"], path) == protocol.Entry(
        argv=("pkg.train", "-x"), module=True, unbuffered=True)


def test_another_name_of_the_same_binary_in_the_same_directory_is_the_same_interpreter(
        tmp_path: Path) -> None:
    """``python`` and ``python3`` of one virtual environment: links to one binary."""
    venv, system = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    venv.mkdir(parents=True)
    system.mkdir(parents=True)
    (system / "python3.11").write_text("")
    (system / "python3.11").chmod(0o755)
    for folder in (venv, system):
        for name in ("python", "python3"):
            (folder / name).symlink_to(system / "python3.11")
    executable = str(venv / "python3")
    assert protocol.python_entry(["python", "t.py"], {"PATH": str(venv)}, executable) \
        == protocol.Entry(argv=("t.py",))
    # The same binary elsewhere (the system's, outside the environment): cold.
    assert protocol.python_entry(["python", "t.py"], {"PATH": str(system)}, executable) is None


def test_anything_a_child_could_not_run_exactly_as_given_starts_cold(path: str) -> None:
    # Another interpreter, even one that links to the same binary (a venv's and the
    # system's python import different things).
    assert entry(["python3.11", "train.py"], path) is None
    assert entry(["/usr/bin/python3", "train.py"], path) is None
    assert entry(["torchrun", "train.py"], path) is None
    assert entry(["bash", "-c", "python train.py"], path) is None
    # Options a child cannot honour, or no program at all.
    for rest in (["-c", "print(1)"], ["-X", "importtime", "t.py"], ["-O", "t.py"], ["-"],
                 ["-m"], ["-m", "-u"], [], [""]):
        assert entry(["python", *rest], path) is None, rest
    assert protocol.python_entry([], {"PATH": path}, PYTHON) is None


def test_a_frame_carries_one_request_and_its_length_is_bounded() -> None:
    request = protocol.Fork(request=7, stdin=True)
    data = protocol.frame(request)
    length = protocol.frame_length(data[:protocol.HEADER_BYTES])
    assert length == len(data) - protocol.HEADER_BYTES
    assert protocol.decode_request(data[protocol.HEADER_BYTES:]) == request
    too_long = (protocol.MAX_FRAME + 1).to_bytes(protocol.HEADER_BYTES, "big")
    with pytest.raises(ValueError, match="bytes"):
        protocol.frame_length(too_long)
    with pytest.raises(msgspec.ValidationError):
        protocol.decode_request(b'{"type": "fork", "request": 1, "env": {}}')


def test_events_and_programs_read_back_as_written() -> None:
    for event in (protocol.Ready(pid=3, seconds=1.5), protocol.Forked(request=1, pid=9),
                  protocol.ForkFailed(request=1, error="no"), protocol.Exited(pid=9, code=-9)):
        line = protocol.encode_event(event)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert protocol.decode_event(line) == event
    program = protocol.Program(command=("python", "t.py"), entry=protocol.Entry(argv=("t.py",)),
                               env={"A": "1"}, cwd="/")
    assert protocol.decode_program(protocol.encode_program(program)) == program
    as_user = msgspec.structs.replace(program, uid=20001, gid=20001)
    assert protocol.decode_program(protocol.encode_program(as_user)) == as_user
    with pytest.raises(msgspec.DecodeError):
        protocol.decode_event(b"not json\n")


def test_one_zygote_serves_every_job_of_an_import_environment() -> None:
    """What the agent sets per job (its id, its private HOME and TMPDIR where jobs run as
    users of their own) and per replica is not part of the environment a zygote starts
    in: two jobs that differ only there share one."""
    job = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "HOME": "/tmp/jobs/a",
           "TMPDIR": "/tmp/jobs/a/tmp", "PHALANX_JOB_ID": "a", "RANK": "0"}
    other = {**job, "HOME": "/tmp/jobs/b", "TMPDIR": "/tmp/jobs/b/tmp", "PHALANX_JOB_ID": "b"}
    assert protocol.import_environment(job) == protocol.import_environment(other) == {
        "PATH": "/bin", "OMP_NUM_THREADS": "4"}


def test_what_no_preloaded_import_reads_costs_no_zygote_of_its_own() -> None:
    """A rank reads OpenTelemetry's settings when its session sets tracing up, after the
    fork, and pytest renames its test phase in the environment at every phase: neither
    makes an environment another zygote's, while a variable an import may read does."""
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "4"}
    traced = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
              "OTEL_BSP_SCHEDULE_DELAY": "100", "PYTEST_CURRENT_TEST": "t.py::t (call)"}
    assert protocol.import_environment(traced) == base
    assert protocol.import_environment({**base, "TORCHINDUCTOR_CACHE_DIR": "/c"}) != base

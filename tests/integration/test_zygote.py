"""Ranks forked from a zygote behave as ranks started cold; a zygote's faults cost no rank.

Real processes: the agent's :class:`~phalanx.services.agent.zygote.Launcher`
starts a real zygote (``python -m phalanx.runtime.zygote``, torch imported) and
forks real scripts from it. Each case runs the same probe script both ways,
forked and cold, and compares what it saw of itself: what a script can observe
is exactly what must not change.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import pytest
from proc_tree import parent
from process_env import shared_environment

from phalanx.schemas import zygote as protocol
from phalanx.services.agent import pidfd
from phalanx.services.agent.zygote import ForkedProcess, Launcher, Template

PROBE = r'''
import atexit, json, os, sys, threading, time
import torch
out = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
       "rank": os.environ.get("RANK"), "threads": torch.get_num_threads(),
       "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\0")[:-1],
       "environ_rank": ("RANK=" + os.environ.get("RANK", "")).encode()
                       in open("/proc/self/environ", "rb").read().split(b"\0"),
       "sid_is_pid": os.getsid(0) == os.getpid(), "stdin": sys.stdin.readline().strip(),
       "buffered": not sys.stdout.write_through}
print(json.dumps(out), flush=True)
atexit.register(lambda: print("atexit", flush=True))
# A non-daemon thread: the interpreter's exit waits for it.
threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
how = os.environ.get("END", "")
if how == "raise":
    raise RuntimeError("the probe failed")
if how == "exit-text":
    sys.exit("a message")
sys.exit(int(how or 0))
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(PROBE)
    return path


def agent_environment(**extra: str) -> dict[str, str]:
    """This process's environment without the variable pytest changes per test phase."""
    return {**shared_environment(), **extra}


def launch_environment(**extra: str) -> dict[str, str]:
    """A rank's environment as its agent makes it (the interpreter's folder first on
    ``PATH``)."""
    return protocol.with_interpreter_path(agent_environment(**extra), sys.executable)


@pytest.fixture
async def launcher(tmp_path: Path, zygote_template: Template) -> AsyncIterator[Launcher]:
    """An agent's launcher; its zygotes come from the test process's template (a zygote
    of its own in an environment the template does not serve: a cold start's path)."""
    launcher = Launcher(tmp_path / "agent", template=zygote_template.path)
    yield launcher
    await launcher.close()


async def start(launcher: Launcher, command: list[str], out: Path, *,
                env: Mapping[str, str] = {}, stdin: bytes | None = None
                ) -> tuple[object, int, str]:
    """Start ``command``, feed it ``stdin``, wait: (the process, its status, its output)."""
    with out.open("wb") as output:
        process = await launcher.start(command, launch_environment(**{"RANK": "3", **env}),
                                       output, stdin=stdin is not None)
    if stdin is not None:
        assert process.stdin is not None
        process.stdin.write(stdin)
        await process.stdin.drain()
        process.stdin.close()
    code = await asyncio.wait_for(process.wait(), 60)
    return process, code, out.read_text()


def observed(output: str) -> dict:
    return json.loads(output.splitlines()[0])


@pytest.mark.parametrize("end", ["0", "3", "raise", "exit-text"])
async def test_a_forked_script_sees_and_ends_as_it_does_started_cold(
        launcher: Launcher, probe: Path, tmp_path: Path, end: str) -> None:
    command = [sys.executable, str(probe), "--lr", "3"]
    cold = Launcher(tmp_path / "cold", zygotes=False)
    cold_process, cold_code, cold_out = await start(cold, command, tmp_path / "cold.log",
                                                    env={"END": end}, stdin=b"hello\n")
    process, code, out = await start(launcher, command, tmp_path / "forked.log",
                                     env={"END": end}, stdin=b"hello\n")
    assert isinstance(process, ForkedProcess) and not isinstance(cold_process, ForkedProcess)
    assert code == cold_code == {"0": 0, "3": 3, "raise": 1, "exit-text": 1}[end]
    # What the script saw of itself, /proc included (what ps shows), is the same.
    assert observed(out) == observed(cold_out)
    assert observed(out)["cmdline"] == command and observed(out)["environ_rank"]
    assert observed(out)["stdin"] == "hello" and observed(out)["sid_is_pid"]
    # Exit as the interpreter exits: threads joined, then atexit; a traceback that
    # starts at the script's own frame.
    assert out.splitlines()[1:] == cold_out.splitlines()[1:]
    assert out.splitlines()[-2:] == ["thread done", "atexit"]
    if end == "raise":
        assert "Traceback (most recent call last):\n  File \"" + str(probe) in out
        assert "RuntimeError: the probe failed" in out and "zygote" not in out


async def test_a_module_unbuffered_and_a_signal_end_as_started_cold(
        launcher: Launcher, probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    command = [sys.executable, "-u", "-m", "probe", "x"]
    with monkeypatch.context() as cwd:
        cwd.chdir(probe.parent)  # -m finds the module in the working directory
        _, _, cold_out = await start(Launcher(tmp_path / "cold", zygotes=False), command,
                                     tmp_path / "cold.log")
        _, code, out = await start(launcher, command, tmp_path / "forked.log")
    assert code == 0
    assert observed(out) == observed(cold_out)
    assert observed(out)["argv"] == [str(probe), "x"] and not observed(out)["buffered"]

    # Killed by a signal: the status says which, as for a process started cold.
    with (tmp_path / "killed.log").open("wb") as output:
        process = await launcher.start([sys.executable, str(probe)],
                                       launch_environment(END="0"), output, stdin=True)
    assert isinstance(process, ForkedProcess)
    os.killpg(process.pid, signal.SIGKILL)
    assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGKILL


async def test_one_zygote_per_import_environment_and_its_variables_reach_the_imports(
        launcher: Launcher, probe: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(probe)]
    first, _, _ = await start(launcher, command, tmp_path / "a.log", env={"RANK": "0"})
    second, _, _ = await start(launcher, command, tmp_path / "b.log", env={"RANK": "1"})
    # Both forked from one zygote: replica variables are not the import environment.
    assert isinstance(first, ForkedProcess) and isinstance(second, ForkedProcess)
    assert len(launcher._zygotes) == 1
    # A variable torch reads at import (OMP_NUM_THREADS) gets a zygote of its own.
    _, _, out = await start(launcher, command, tmp_path / "c.log",
                            env={"OMP_NUM_THREADS": "1"})
    assert observed(out)["threads"] == 1
    assert len(launcher._zygotes) == 2
    # A command a child cannot run as given starts cold.
    cold, code, out = await start(launcher, [sys.executable, "-c", "print('cold')"],
                                  tmp_path / "d.log")
    assert not isinstance(cold, ForkedProcess) and code == 0 and out == "cold\n"


async def test_a_zygote_killed_leaves_its_children_running_and_the_next_launch_gets_a_new_one(
        launcher: Launcher, probe: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(probe)]
    with (tmp_path / "a.log").open("wb") as output:
        child = await launcher.start(command, launch_environment(RANK="3"), output,
                                     stdin=True)
    assert isinstance(child, ForkedProcess)
    (zygote,) = launcher._zygotes.values()
    assert zygote.pid is not None and parent(child.pid) == zygote.pid
    os.kill(zygote.pid, signal.SIGKILL)
    await asyncio.wait_for(pidfd.ended(zygote.pid), 30)
    os.kill(child.pid, 0)  # still running, waiting on its standard input
    assert child.stdin is not None
    child.stdin.close()  # it reads EOF, ends
    assert await asyncio.wait_for(child.wait(), 30) == 255 and child.status_lost
    process, code, _ = await start(launcher, command, tmp_path / "b.log")
    assert isinstance(process, ForkedProcess) and code == 0
    (new,) = launcher._zygotes.values()
    assert new is not zygote


async def test_requests_a_zygote_cannot_serve_are_refused_and_it_serves_on(
        tmp_path: Path) -> None:
    """Spoken to directly: a bad frame, a request without its descriptors."""
    requests, theirs_requests = socket.socketpair()
    events, theirs_events = socket.socketpair()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", protocol.MODULE,
        env={**os.environ, protocol.REQUESTS_FD: str(theirs_requests.fileno()),
             protocol.EVENTS_FD: str(theirs_events.fileno())},
        pass_fds=(theirs_requests.fileno(), theirs_events.fileno()))
    theirs_requests.close()
    theirs_events.close()
    lines = events.makefile("rb")
    try:
        assert isinstance(protocol.decode_event(await asyncio.to_thread(lines.readline)),
                          protocol.Ready)
        body = b'{"type": "fork", "request": "x"}'
        requests.sendall(len(body).to_bytes(4, "big") + body)
        failed = protocol.decode_event(await asyncio.to_thread(lines.readline))
        assert isinstance(failed, protocol.ForkFailed) and "bad request" in failed.error
        requests.sendall(protocol.frame(protocol.Fork(request=2)))  # no descriptors
        failed = protocol.decode_event(await asyncio.to_thread(lines.readline))
        assert failed == protocol.ForkFailed(
            request=2, error="0 descriptor(s) came with the request, not 2")
        assert process.returncode is None
        # A frame longer than any request: the zygote closes (no boundary can be trusted).
        requests.sendall((protocol.MAX_FRAME + 1).to_bytes(4, "big"))
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        requests.close()
        events.close()
        if process.returncode is None:
            process.kill()
            await process.wait()


# An agent in miniature: starts a script that leaves the file ``sys.argv[2]`` held
# (forked when argv[1] is "fork"), releases it when argv[3] is "release", says the pid and
# how it started, then dies as a SIGKILLed agent does.
HOLDING_AGENT = r'''
import asyncio, os, signal, sys
from pathlib import Path
from phalanx.services.agent.zygote import ForkedProcess, Launcher

async def main() -> None:
    how, marker, then = sys.argv[1], sys.argv[2], sys.argv[3]
    script = Path(marker + ".py")
    script.write_text(f"open({marker!r}, 'w')\n")
    launcher = Launcher(Path(marker).parent / "agent", zygotes=how == "fork")
    with open(marker + ".log", "wb") as out:
        process = await launcher.start([sys.executable, str(script)], dict(os.environ), out,
                                       hold=True)
    if then == "release":
        process.release()
    print(process.pid, isinstance(process, ForkedProcess), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
'''


@pytest.mark.parametrize("how", ["fork", "cold"])
@pytest.mark.parametrize("then", ["die", "release"])
async def test_a_held_process_runs_nothing_if_its_agent_dies_before_releasing_it(
        tmp_path: Path, how: str, then: str) -> None:
    marker = tmp_path / "ran"
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDING_AGENT, how, str(marker), then,
        stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(agent.communicate(), 120)
    assert agent.returncode == -signal.SIGKILL
    pid, forked = out.split()
    assert forked == str(how == "fork").encode()
    await asyncio.wait_for(pidfd.ended(int(pid)), 30)  # the held process ends by itself
    log = Path(f"{marker}.log").read_text()
    if then == "release":
        assert marker.exists() and protocol.NOT_RELEASED_LINE not in log
    else:  # its agent died with it held: none of the job's command ran
        assert not marker.exists() and log == protocol.NOT_RELEASED_LINE


async def test_a_held_cold_start_fails_at_once_for_a_command_exec_refuses(
        tmp_path: Path) -> None:
    cold = Launcher(tmp_path / "cold", zygotes=False)
    with (tmp_path / "out.log").open("wb") as out:
        with pytest.raises(FileNotFoundError):
            await cold.start(["no-such-command-here"], dict(os.environ), out, hold=True)
        with pytest.raises(PermissionError):
            await cold.start([str(tmp_path)], dict(os.environ), out, hold=True)


@pytest.fixture
def template(tmp_path: Path) -> Iterator[Template]:
    template = Template(tmp_path / "template.log", agent_environment())
    assert template.wait_listening()
    yield template
    template.stop()


async def launch(launcher: Launcher, command: list[str], out: Path,
                 **extra: str) -> tuple[object, int, str]:
    with out.open("wb") as output:
        process = await launcher.start(command, launch_environment(RANK="3", **extra), output)
    code = await asyncio.wait_for(process.wait(), 60)
    return process, code, out.read_text()


def zygote_of(launcher: Launcher) -> int:
    (zygote,) = launcher._zygotes.values()
    assert zygote.pid is not None
    return zygote.pid


async def test_agents_zygotes_forked_from_one_template_fork_ranks_as_a_zygote_of_their_own(
        template: Template, probe: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(probe), "--lr", "3"]
    agents = [Launcher(tmp_path / f"agent-{i}", template=template.path) for i in range(2)]
    alone = Launcher(tmp_path / "alone")
    try:
        results = [await launch(agent, command, tmp_path / f"{i}.log")
                   for i, agent in enumerate([*agents, alone])]
        # Each agent has a zygote of its own, both children of the template; the agent
        # without one started its own, as before.
        assert [parent(zygote_of(agent)) for agent in agents] == [template.process.pid] * 2
        assert parent(zygote_of(alone)) == os.getpid()
        assert len({zygote_of(agent) for agent in agents}) == 2
        for process, code, out in results:
            assert isinstance(process, ForkedProcess) and code == 0
            assert observed(out) == observed(results[-1][2])
            assert out.splitlines()[-2:] == ["thread done", "atexit"]
        # A zygote from the template imported nothing itself: the template did, once.
        assert "torch" in Path(f"/proc/{template.process.pid}/maps").read_text()
    finally:
        for launcher in (*agents, alone):
            await launcher.close()


async def test_a_template_serves_only_its_own_environment_and_a_gone_one_is_passed_over(
        template: Template, probe: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(probe)]
    agent = Launcher(tmp_path / "agent", template=template.path)
    try:
        # A variable torch reads at import: the template's imports did not see it.
        process, code, out = await launch(agent, command, tmp_path / "a.log",
                                          OMP_NUM_THREADS="1")
        assert isinstance(process, ForkedProcess) and code == 0
        assert observed(out)["threads"] == 1 and parent(zygote_of(agent)) == os.getpid()
    finally:
        await agent.close()
    template.stop()
    agent = Launcher(tmp_path / "later", template=template.path)
    try:
        process, code, _ = await launch(agent, command, tmp_path / "b.log")
        assert isinstance(process, ForkedProcess) and code == 0
        assert parent(zygote_of(agent)) == os.getpid()
    finally:
        await agent.close()


async def test_requests_a_template_cannot_serve_are_refused_and_it_serves_on(
        template: Template, tmp_path: Path) -> None:
    async def ask(frame: bytes, fds: list[int]) -> protocol.TemplateReply:
        def exchange() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(30)
                connection.connect(template.path)
                socket.send_fds(connection, [frame], fds)
                return connection.makefile("rb").readline()
        return protocol.decode_template_reply(await asyncio.to_thread(exchange))

    body = b'{"type": "spawn", "env": 3}'
    reply = await ask(len(body).to_bytes(4, "big") + body, [])
    assert isinstance(reply, protocol.SpawnFailed) and "bad request" in reply.error
    reply = await ask(protocol.frame(protocol.Spawn(env=launch_environment())), [])
    assert reply == protocol.SpawnFailed(error="0 descriptor(s) came with the request, not 3")
    reply = await ask(protocol.frame(protocol.Spawn(env=launch_environment(OMP_NUM_THREADS="3"))),
                      [0, 1, 2])
    assert isinstance(reply, protocol.SpawnFailed) and "['OMP_NUM_THREADS']" in reply.error
    assert template.process.poll() is None


#: Asks the template at argv[1] for a zygote of this environment, its reply printed.
ASK_FROM_ELSEWHERE = """
import os, socket, sys
from phalanx.schemas import zygote as protocol
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
    connection.settimeout(30)
    connection.connect(sys.argv[1])
    socket.send_fds(connection, [protocol.frame(protocol.Spawn(env=dict(os.environ)))],
                    [0, 1, 2])
    sys.stdout.write(connection.makefile("rb").readline().decode())
"""


def test_an_agent_in_another_network_namespace_gets_no_zygote_of_the_templates(
        template: Template, tmp_path: Path) -> None:
    """A zygote forked by the template lives in the template's namespaces: an agent that
    runs in a network of its own (a partitioned node) must start its own."""
    if os.geteuid() != 0:
        pytest.skip("a network namespace of its own needs root")
    result = subprocess.run(["unshare", "--net", sys.executable, "-c", ASK_FROM_ELSEWHERE,
                             template.path], capture_output=True, text=True, timeout=60,
                            env=launch_environment())
    if result.returncode != 0 and "unshare" in result.stderr:
        pytest.skip(f"unshare: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    reply = protocol.decode_template_reply(result.stdout.encode())
    assert isinstance(reply, protocol.SpawnFailed), reply
    assert "other namespaces than the template's (net)" in reply.error

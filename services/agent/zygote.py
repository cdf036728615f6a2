"""Starting a job's processes: forked from a zygote when the command allows, else cold.

Every rank and warm spare the agent starts goes through :class:`Launcher`. A
command that is this agent's own interpreter running a script or a module
(:func:`~phalanx.schemas.zygote.python_entry`) is forked from a *zygote*
(:mod:`phalanx.runtime.zygote`): an interpreter the agent keeps with torch and
the rank runtime imported, so the rank skips 1.5 to 2 s of imports. Anything else
(another interpreter, a shell, ``torchrun``) starts cold, as before, and so does
every command when the zygote cannot serve (it failed to start or died; the
reason is logged and the next launch tries a new one).

A zygote is shared by the jobs whose processes start in the same environment
once the variables the agent sets per job and per replica are left out (every
``PHALANX_*`` variable and the replica's identity): it is started in that
environment, so what an import reads from it (``OMP_NUM_THREADS``,
``PYTHONPATH`` …) is the job's. It holds nothing of any job: a child's
variables, its command line and its working directory reach the child alone,
through a pipe the zygote passes on unread. At most :data:`MAX_ZYGOTES` are
kept, the least recently used stopped first; all are stopped with the agent.

A rank is started *held* (``hold=True``): it runs none of the job's code until the
agent, having put it on its record, calls :meth:`ChildProcess.release`. Should the
agent die in between, the process sees its end of a pipe close and exits with
:data:`~phalanx.schemas.zygote.NOT_RELEASED`, so a restarted agent never misses a
rank that is running: either the rank is on the record it adopts from, or it never
ran. A fork's program is written into its pipe at the release; a cold start runs
under ``/bin/sh``, which waits for a line on its standard input before it execs
the command (same process, same start time).

Where the machine keeps a zygote template (:class:`Template`; a local cluster starts
one for its agents), the zygote is forked from it, its imports already done, when the
template serves the zygote's environment; else it is started cold.

A forked process is the zygote's child, not the agent's: the zygote reports its
exit status (:class:`ForkedProcess`). If the zygote dies first, the exits of its
children still running are watched through a pidfd and reported with no status
(as for a rank adopted after an agent restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import msgspec

from phalanx.schemas import zygote as protocol
from phalanx.services.agent import pidfd
from phalanx.services.agent.core import JobUser
from phalanx.services.natsd import die_with_parent

log = logging.getLogger("phalanx.agent.zygote")
#: Zygotes kept at once (one per distinct import environment).
MAX_ZYGOTES = 2
#: How long a launch waits for a zygote's imports before it starts cold instead.
READY_TIMEOUT_S = 120.0
#: How long a fork request may take to be answered.
FORK_TIMEOUT_S = 10.0
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


class ChildProcess(Protocol):
    """What the agent needs of a process it started: ``asyncio.subprocess.Process``
    for a cold start, :class:`ForkedProcess` for a fork."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    @property
    def stdin(self) -> asyncio.StreamWriter | None: ...

    async def wait(self) -> int: ...

    def release(self) -> None:
        """Let a held process run its command (nothing, if it was not held)."""


#: What a held cold start runs: its command, once a line arrives on its standard input
#: (the agent's release); at end of input (the agent died first) nothing of it.
_HELD = ('read -r _ || { echo "' + protocol.NOT_RELEASED_LINE.strip() + '" >&2; exit '
         + str(protocol.NOT_RELEASED) + '; }; exec "$@" </dev/null')


class ColdProcess:
    """A process started cold; held, its shell runs the command once released."""

    def __init__(self, process: asyncio.subprocess.Process, *, held: bool) -> None:
        self._process = process
        self._held = held

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    @property
    def stdin(self) -> asyncio.StreamWriter | None:
        return None if self._held else self._process.stdin

    async def wait(self) -> int:
        return await self._process.wait()

    def release(self) -> None:
        if self._held:
            self._held = False
            gate = self._process.stdin
            assert gate is not None
            with contextlib.suppress(OSError):  # it died already: its exit tells
                gate.write(b"\n")
                gate.close()


class ForkedProcess:
    """A process forked from a zygote; its exit comes from the zygote (or its pidfd)."""

    def __init__(self, pid: int, stdin: asyncio.StreamWriter | None,
                 held: tuple[int, bytes] | None = None) -> None:
        self._pid = pid
        self._stdin = stdin
        self._held = held  # (the program pipe's write end, the program) until released
        self._code: int | None = None
        self._lost = False
        self._ended = asyncio.Event()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def stdin(self) -> asyncio.StreamWriter | None:
        return self._stdin

    @property
    def status_lost(self) -> bool:
        """It ended after its zygote died, so its exit status is unknowable
        (:meth:`wait` then gives :data:`UNKNOWN_STATUS`)."""
        return self._lost

    async def wait(self) -> int:
        """Its exit status as ``subprocess`` gives it (a signal: its negative)."""
        await self._ended.wait()
        assert self._code is not None
        return self._code

    def release(self) -> None:
        if self._held is not None:
            fd, payload = self._held
            self._held = None
            # It fits: the pipe was sized for it, and is empty. An error: it died already,
            # and its exit tells.
            with contextlib.suppress(OSError):
                os.write(fd, payload)
            os.close(fd)

    def ended(self, code: int, *, lost: bool = False) -> None:
        if self._held is not None:  # ended unreleased: the program is not for anyone
            os.close(self._held[0])
            self._held = None
        if self._code is None:
            self._code = code
            self._lost = lost
            self._ended.set()


#: The status of a forked process that ended while no zygote could see how.
UNKNOWN_STATUS = 255


class ZygoteProcess:
    """One zygote: its process, its two sockets, and the children it forked."""

    def __init__(self, env: Mapping[str, str], log_path: Path,
                 template: str | None = None) -> None:
        self.env = dict(env)
        self.log_path = log_path
        self.template = template
        self.pid: int | None = None
        self._ended: asyncio.Task[int | None] | None = None  # its status, where known
        self.ready: asyncio.Future[protocol.Ready] | None = None
        self.failed: str | None = None
        self._requests: socket.socket | None = None
        self._events: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[protocol.Forked | protocol.ForkFailed]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._orphans: set[asyncio.Task[None]] = set()  # watches of children it left
        self._early_exits: dict[int, int] = {}
        self._next_request = 0
        self._lock = asyncio.Lock()
        self._stopping = False

    async def start(self) -> None:
        """Start the process (its imports go on in the background: :attr:`ready`):
        forked by the machine's template where there is one that serves this
        environment, else started cold."""
        loop = asyncio.get_running_loop()
        self.ready = loop.create_future()
        requests, theirs_requests = socket.socketpair()
        events, theirs_events = socket.socketpair()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.log_path.open("ab") as log_file:
                theirs = (theirs_requests.fileno(), theirs_events.fileno(), log_file.fileno())
                spawned = None if self.template is None else \
                    await self._spawn_from_template(self.template, theirs)
                from_template = spawned is not None
                if spawned is not None:
                    self.pid = spawned
                    self._ended = asyncio.create_task(pidfd.ended(spawned))  # no status
                else:
                    process = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", protocol.MODULE,
                        env={**self.env, protocol.REQUESTS_FD: str(theirs[0]),
                             protocol.EVENTS_FD: str(theirs[1])},
                        stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                        pass_fds=theirs[:2], start_new_session=True)
                    self.pid = process.pid
                    self._ended = asyncio.create_task(process.wait())
        except OSError as exc:
            requests.close()
            events.close()
            self._fail(f"cannot start: {exc}")
            return
        finally:
            theirs_requests.close()
            theirs_events.close()
        requests.settimeout(FORK_TIMEOUT_S)
        self._requests = requests
        # The writer is kept: a writer collected closes the socket under the reader.
        reader, self._events = await asyncio.open_unix_connection(sock=events)
        self._reader = asyncio.create_task(self._read(reader))
        log.info("zygote started", extra={"pid": self.pid, "from_template": from_template})

    async def _spawn_from_template(self, path: str, fds: Sequence[int]) -> int | None:
        """The pid of a zygote the template at ``path`` forked with ``fds`` (its two
        sockets and its log); None where it would not or could not (said in the log)."""
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.setblocking(False)
            try:
                async with asyncio.timeout(READY_TIMEOUT_S):  # the first waits for imports
                    await loop.sock_connect(connection, path)
                    await loop.run_in_executor(None, functools.partial(
                        socket.send_fds, connection,
                        [protocol.frame(protocol.Spawn(env=self.env))], list(fds)))
                    line = bytearray()
                    while not line.endswith(b"\n"):
                        chunk = await loop.sock_recv(connection, 4096)
                        if not chunk:
                            raise ConnectionError("the template closed the connection")
                        line += chunk
                reply = protocol.decode_template_reply(bytes(line))
            except (OSError, TimeoutError, msgspec.ValidationError,
                    msgspec.DecodeError) as exc:
                log.warning("the zygote template at %s did not answer (%s): starting a "
                            "zygote of this agent's own", path, exc)
                return None
        if isinstance(reply, protocol.SpawnFailed):
            log.info("the zygote template at %s spawned no zygote (%s): starting one of "
                     "this agent's own", path, reply.error)
            return None
        return reply.pid

    async def fork(self, program: protocol.Program, output: BinaryIO,
                   stdin: bool, *, hold: bool = False) -> ForkedProcess:
        """A child running ``program`` (held: once released).

        Raises:
            OSError: the zygote cannot serve (not ready, gone, or the fork failed).
        """
        assert self.ready is not None
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await asyncio.shield(self.ready)
        except TimeoutError:
            raise OSError(f"the zygote's imports took over {READY_TIMEOUT_S:g} s") from None
        payload = protocol.encode_program(program)
        program_read, program_write = os.pipe()
        stdin_read = stdin_write = -1
        try:
            with contextlib.suppress(OSError):  # a larger pipe where the system allows
                fcntl.fcntl(program_write, _F_SETPIPE_SZ, len(payload))
            if fcntl.fcntl(program_write, _F_GETPIPE_SZ) < len(payload):
                raise OSError(f"a program of {len(payload)} bytes does not fit a pipe")
            os.set_blocking(program_write, False)
            if not hold:
                os.write(program_write, payload)
                os.close(program_write)
                program_write = -1
            fds = [program_read, output.fileno()]
            if stdin:
                stdin_read, stdin_write = os.pipe()
                fds.append(stdin_read)
            async with self._lock:
                self._next_request += 1
                request = self._next_request
                answer = asyncio.get_running_loop().create_future()
                self._pending[request] = answer
                try:
                    if self._requests is None:
                        raise OSError(self.failed or "the zygote is gone")
                    socket.send_fds(self._requests,
                                    [protocol.frame(protocol.Fork(request=request,
                                                                  stdin=stdin))], fds)
                    async with asyncio.timeout(FORK_TIMEOUT_S):
                        reply = await answer
                except TimeoutError:
                    raise OSError("the zygote did not answer a fork") from None
                finally:
                    self._pending.pop(request, None)
            if isinstance(reply, protocol.ForkFailed):
                raise OSError(f"the zygote could not fork: {reply.error}")
        except BaseException:
            for fd in (program_write, stdin_write):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (program_read, stdin_read):
                if fd >= 0:
                    os.close(fd)
        writer = await _pipe_writer(stdin_write) if stdin_write >= 0 else None
        child = ForkedProcess(reply.pid, writer,
                              (program_write, payload) if program_write >= 0 else None)
        self._children[reply.pid] = child
        if reply.pid in self._early_exits:
            child.ended(self._early_exits.pop(reply.pid))
        elif self._reader is None or self._reader.done():
            self._watch_orphan(child)
        return child

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                try:
                    event = protocol.decode_event(line)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    log.warning("zygote: unreadable event %r: %s", line[:200], exc)
                    continue
                self._on(event)
        finally:
            code = self._ended.result() if self._ended is not None and self._ended.done() \
                and not self._ended.cancelled() else None
            self._fail(f"it ended (status {code})" if code is not None else "it ended")

    def _on(self, event: protocol.Event) -> None:
        if isinstance(event, protocol.Ready):
            log.info("zygote ready", extra={"pid": event.pid, "seconds": event.seconds})
            if self.ready is not None and not self.ready.done():
                self.ready.set_result(event)
        elif isinstance(event, protocol.Exited):
            child = self._children.pop(event.pid, None)
            if child is None:  # the exit overtook the agent's handling of the fork
                self._early_exits[event.pid] = event.code
            else:
                child.ended(event.code)
        else:
            answer = self._pending.get(event.request)
            if answer is not None and not answer.done():
                answer.set_result(event)

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            if not self._stopping:
                log.warning("zygote %s: ranks start cold", reason)
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(OSError(f"the zygote {reason}"))
            self.ready.exception()  # retrieved: a launch that never waited is no error
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(OSError(f"the zygote {reason}"))
        for child in list(self._children.values()):
            self._watch_orphan(child)

    def _watch_orphan(self, child: ForkedProcess) -> None:
        """Watch a child whose zygote is gone until it ends (its status is lost with the
        zygote)."""
        async def watch() -> None:
            await pidfd.ended(child.pid)
            child.ended(UNKNOWN_STATUS, lost=True)

        task = asyncio.create_task(watch())
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def stop(self) -> None:
        """Close the zygote (it exits; children it forked go on, watched by pidfd)."""
        self._stopping = True
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self.pid is not None and self._ended is not None and not self._ended.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            await self._ended
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._events is not None:
            self._events.close()


class Launcher:
    """Starts the processes of jobs' commands: forked from a zygote, else cold."""

    def __init__(self, work_dir: Path, *, zygotes: bool = True,
                 template: str | None = None) -> None:
        self.work_dir = work_dir
        self.use_zygotes = zygotes
        self.template = template
        self._zygotes: OrderedDict[tuple[tuple[str, str], ...], ZygoteProcess] = OrderedDict()
        self._count = 0

    async def start(self, command: Sequence[str], env: Mapping[str, str], output: BinaryIO,
                    *, stdin: bool = False, hold: bool = False,
                    user: JobUser | None = None) -> ChildProcess:
        """A process of ``command`` in ``env``, writing to ``output``, in its own session;
        with ``stdin``, its standard input is a pipe (else /dev/null); with ``hold``, it
        runs the command only once :meth:`ChildProcess.release` is called; with ``user``,
        as that user and group, with no supplementary groups and umask 077 (a fork drops
        to them before the program runs, :func:`phalanx.runtime.zygote.drop_privileges`;
        a cold start before its shell runs).

        Raises:
            OSError: the command cannot start (missing, not executable …).
        """
        assert not (stdin and hold), "a held process's standard input is its gate"
        entry = protocol.python_entry(command, env, sys.executable) \
            if self.use_zygotes else None
        if entry is not None:
            zygote = await self._zygote(protocol.import_environment(env))
            if zygote is not None:
                program = protocol.Program(
                    command=tuple(command), entry=entry, env=dict(env), cwd=os.getcwd(),
                    uid=None if user is None else user.uid,
                    gid=None if user is None else user.gid)
                try:
                    return await zygote.fork(program, output, stdin, hold=hold)
                except OSError as exc:
                    log.warning("cannot fork from the zygote (%s): starting cold", exc)
        if hold:
            # What exec would refuse, refused here, where the shell cannot: a command that
            # cannot start is the launch's failure, not the job's exit status 127.
            executable(command[0], env)
            command = ["/bin/sh", "-c", _HELD, "phalanx-held", *command]
        # uvloop's subprocesses take no user, group or umask: the child drops to them itself,
        # with nothing but system calls between fork and exec.
        as_user: dict[str, Any] = {} if user is None else {
            "preexec_fn": functools.partial(_become_user, user.uid, user.gid)}
        process = await asyncio.create_subprocess_exec(
            *command, env=dict(env),
            stdin=asyncio.subprocess.PIPE if stdin or hold else asyncio.subprocess.DEVNULL,
            stdout=output, stderr=output, start_new_session=True, **as_user)
        return ColdProcess(process, held=hold)

    async def _zygote(self, env: Mapping[str, str]) -> ZygoteProcess | None:
        key = tuple(sorted(env.items()))
        zygote = self._zygotes.get(key)
        if zygote is not None and zygote.failed is not None:
            await zygote.stop()
            del self._zygotes[key]
            zygote = None
        if zygote is None:
            while len(self._zygotes) >= MAX_ZYGOTES:
                _, oldest = self._zygotes.popitem(last=False)
                await oldest.stop()
            self._count += 1
            zygote = ZygoteProcess(env, self.work_dir / "zygotes" / f"zygote-{self._count}.log",
                                   self.template)
            self._zygotes[key] = zygote
            await zygote.start()
        self._zygotes.move_to_end(key)
        return None if zygote.failed is not None else zygote

    async def close(self) -> None:
        """Stop every zygote (the agent is stopping)."""
        zygotes = list(self._zygotes.values())
        self._zygotes.clear()
        for zygote in zygotes:
            await zygote.stop()


class Template:
    """A zygote template (:class:`phalanx.runtime.zygote.Template`) this process started
    for the agents it starts: they are given :attr:`path`. It stops with its starter."""

    def __init__(self, log_path: Path, env: Mapping[str, str] | None = None) -> None:
        # A folder of its own under the temporary dir: a socket's path is at most 107 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="phalanx-zygotes-"))
        self.path = str(self.folder / "template.sock")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._listening, theirs = os.pipe()  # closed by the template once it listens
        try:
            with log_path.open("ab") as log_file:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", protocol.MODULE, "--template", self.path,
                     str(theirs)],
                    env=protocol.with_interpreter_path(os.environ if env is None else env,
                                                       sys.executable),
                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                    pass_fds=(theirs,), start_new_session=True, preexec_fn=die_with_parent)
        finally:
            os.close(theirs)

    def wait_listening(self) -> bool:
        """Block until the template listens (True) or has died (False)."""
        if self._listening >= 0:
            os.read(self._listening, 1)  # end of file either way
            os.close(self._listening)
            self._listening = -1
        return self.process.poll() is None

    def stop(self) -> None:
        """Stop it (the zygotes it forked go on until their agents close them)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self._listening >= 0:
            os.close(self._listening)
            self._listening = -1
        shutil.rmtree(self.folder, ignore_errors=True)


def _become_user(uid: int, gid: int) -> None:
    """In a cold start's child, before exec: ``uid``:``gid``, no other groups, umask 077."""
    os.umask(0o077)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def executable(program: str, env: Mapping[str, str]) -> str:
    """The file ``exec`` would run for ``program`` in ``env`` (searched on its ``PATH``
    when the name has no slash).

    Raises:
        FileNotFoundError: there is no such file.
        PermissionError: it is not an executable file.
    """
    path = program if "/" in program else protocol.which(
        program, os.pathsep.join(os.get_exec_path(dict(env))))
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    return path


async def _pipe_writer(fd: int) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(fd, "wb", buffering=0)
    transport, stream_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, pipe)
    return asyncio.StreamWriter(transport, stream_protocol, None, loop)

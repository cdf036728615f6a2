"""A zygote: an interpreter with torch and the runtime imported, that ranks are forked from.

A rank started cold spends its first 1.5 to 2 s of CPU (more on a loaded machine)
importing torch and the runtime before the script's first line of its own.
A node agent keeps a zygote (``python -m phalanx.runtime.zygote``, started in
the job's environment) that has done those imports once; each rank or warm spare
whose command is a script or module of the same interpreter is then a ``fork``
of it that runs the script (:mod:`runpy`) as ``python script.py`` would: its own
session, its standard streams on the descriptors the agent passed, the job's and
the replica's variables in ``os.environ``, ``sys.argv`` and ``sys.path[0]`` as
the interpreter sets them, and on the way out non-daemon threads joined,
``atexit`` run, and the exit status an uncaught exception or ``SystemExit`` gives.
The protocol is :mod:`phalanx.schemas.zygote`.

Why a fork is safe here: the zygote forks only while it runs no Python thread
but its own, imports nothing but :data:`~phalanx.schemas.zygote.PRELOAD` (torch
starts no thread at import; OpenBLAS's pool, which numpy starts, is rebuilt by its
own fork handlers), and never touches CUDA, so a child initialises its GPU as a
fresh process would. Python's ``random`` reseeds itself in a child; numpy's
global generator does not, so the child reseeds it (a fresh process would seed it
from the OS too). What the script does is the child's alone: nothing of it runs
in the zygote.

The zygote is the children's parent, so it reports their exits
(:class:`~phalanx.schemas.zygote.Exited`). It exits when its agent closes the
request socket or dies; children still running then go on (the agent that
restarts adopts them like any rank). Nothing it is sent can make it crash: a
request it cannot read or fork is answered :class:`~phalanx.schemas.zygote.ForkFailed`
and the zygote goes on.

Run with ``--template PATH`` it is a machine's :class:`Template` instead: it listens on
a Unix socket and forks the agents' zygotes, with the imports done once between them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import msgspec

from phalanx.runtime import teardown
from phalanx.schemas import zygote as protocol

log = logging.getLogger("phalanx.runtime.zygote")


class Zygote:
    """The serving loop: read fork requests, fork, report children's exits."""

    def __init__(self, requests: socket.socket, events: socket.socket) -> None:
        self.requests = requests
        self.events = events
        self.children: set[int] = set()
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._selector = selectors.DefaultSelector()
        self._pending = bytearray()
        self._fds: list[int] = []

    def serve(self) -> None:
        """Serve until the request socket ends (the agent closed it or died)."""
        signal.set_wakeup_fd(self._wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self._selector.register(self.requests, selectors.EVENT_READ)
        self._selector.register(self._wakeup_read, selectors.EVENT_READ)
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self.requests and not self._read_requests():
                    return
            self._reap()

    def _read_requests(self) -> bool:
        """Read what arrived and serve every whole request; False when the socket ended."""
        try:
            data, fds, _, _ = socket.recv_fds(self.requests, 1 << 16, 4)
        except OSError as exc:
            log.warning("zygote: the request socket failed: %s", exc)
            return False
        if not data:
            return False
        self._pending += data
        self._fds += fds
        while len(self._pending) >= protocol.HEADER_BYTES:
            try:
                length = protocol.frame_length(bytes(self._pending[:protocol.HEADER_BYTES]))
            except ValueError as exc:  # no frame boundary can be trusted after this one
                log.error("zygote: %s; closing", exc)
                return False
            end = protocol.HEADER_BYTES + length
            if len(self._pending) < end:
                break
            body = bytes(self._pending[protocol.HEADER_BYTES:end])
            del self._pending[:end]
            fds, self._fds = self._fds, []
            self._serve_one(body, fds)
        return True

    def _serve_one(self, body: bytes, fds: list[int]) -> None:
        try:
            try:
                request = protocol.decode_request(body)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self._send(protocol.ForkFailed(request=-1, error=f"bad request: {exc}"))
                return
            wanted = 3 if request.stdin else 2
            if len(fds) != wanted:
                self._send(protocol.ForkFailed(
                    request=request.request,
                    error=f"{len(fds)} descriptor(s) came with the request, not {wanted}"))
                return
            if threading.active_count() != 1:  # never fork under a running thread
                self._send(protocol.ForkFailed(
                    request=request.request,
                    error=f"{threading.active_count()} threads run in the zygote"))
                return
            if _cuda_initialized():  # a child could not use the GPU a fork copied
                self._send(protocol.ForkFailed(request=request.request,
                                               error="CUDA is initialised in the zygote"))
                return
            for stream in (sys.stdout, sys.stderr):  # nothing of ours is copied into a child
                with contextlib.suppress(Exception):
                    stream.flush()
            # Answered once the child leads its own session, as a cold start is: a stop
            # (SIGTERM to the group) right after must reach it.
            session_read, session_write = os.pipe()
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(session_read)
                os.close(session_write)
                self._send(protocol.ForkFailed(request=request.request, error=str(exc)))
                return
            if pid == 0:
                os.close(session_read)
                self._become(request, fds, session_write)
            os.close(session_write)
            os.read(session_read, 1)  # EOF: the child closed its end (or died)
            os.close(session_read)
            self.children.add(pid)
            self._send(protocol.Forked(request=request.request, pid=pid))
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wakeup_read, 512):
                pass
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self.children.discard(pid)
                self._send(protocol.Exited(pid=pid, code=os.waitstatus_to_exitcode(status)))

    def _send(self, event: protocol.Event) -> None:
        with contextlib.suppress(OSError):  # the agent is gone: the request socket ends too
            self.events.sendall(protocol.encode_event(event))

    def _become(self, request: protocol.Fork, fds: list[int], session: int) -> NoReturn:
        """In the child: undo the zygote, take the request's identity, run the program."""
        code = 1
        try:
            os.setsid()
            os.close(session)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self._wakeup_read, self._wakeup_write):
                os.close(fd)
            self._selector.close()
            self.requests.close()
            self.events.close()
            program_pipe, output = fds[0], fds[1]
            stdin = fds[2] if request.stdin else os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            os.dup2(output, 1)
            os.dup2(output, 2)
            with os.fdopen(program_pipe, "rb") as pipe:
                payload = pipe.read()
            for fd in {stdin, output}:
                if fd > 2:
                    os.close(fd)
            if payload:
                program = protocol.decode_program(payload)
                os.chdir(program.cwd)
                os.environ.clear()
                os.environ.update(program.env)
                tempfile.tempdir = None  # what the preload cached of the zygote's TMPDIR
                present_as(program.command, program.env)
                if program.uid is not None:
                    drop_privileges(program.uid, program.uid if program.gid is None
                                    else program.gid)
                code = run(program.entry)
            else:
                # Held, and the agent died before this process was on its record: running
                # would leave a rank no agent knows of.
                sys.stderr.write(protocol.NOT_RELEASED_LINE)
                code = protocol.NOT_RELEASED
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            teardown.record_status(code)
            os._exit(code)


_PR_SET_DUMPABLE = 4


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``:``gid`` for good, as a job's process must before any of its code runs:
    no supplementary groups, real, effective and saved ids all changed (no way back),
    umask 077 (what it creates is its own), and not dumpable, so a process of another
    user (another job) can neither read its ``/proc/<pid>/environ`` (its bus token) nor
    attach to it.

    Raises:
        PermissionError: this process may not change its ids (no ``CAP_SETUID`` /
            ``CAP_SETGID``), or the change did not take.
    """
    os.umask(0o077)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(f"still {os.getresuid()}/{os.getresgid()} after dropping to "
                              f"{uid}:{gid}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise PermissionError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def run(entry: protocol.Entry) -> int:
    """Run ``entry`` as the interpreter would run it as its main program; its exit status."""
    if entry.unbuffered:  # -u: no buffer under the text layer
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding,
                             errors=stream.errors, write_through=True)
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    sys.argv = list(entry.argv)
    _reseed_numpy()
    code = 0
    try:
        if entry.module:
            sys.path[0] = os.getcwd()
            runpy.run_module(entry.argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(entry.argv[0]))
            runpy.run_path(entry.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # reported as the interpreter reports it
        program_tb = _program_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(program_tb), program_tb)
        code = 1
    # Then what the interpreter's exit does: join the threads that are not daemons, run
    # the atexit functions.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    return code


def _program_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the program's first frame on: the zygote's and runpy's frames left out,
    as in the traceback of the program run by ``python`` itself."""
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


class _MemoryMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
        "arg_start", "arg_end", "env_start", "env_end", "auxv")] + [
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_PR_SET_MM, _PR_SET_MM_MAP = 35, 14
_presented: list[ctypes.Array[ctypes.c_char]] = []  # the new areas live as long as we do


def present_as(command: Sequence[str], env: Mapping[str, str]) -> bool:
    """Make ``/proc/self/cmdline`` and ``/proc/self/environ`` show ``command`` and ``env``
    (as they would for a process started with them) instead of the zygote's: what ``ps``,
    ``top`` and an operator's scripts read. ``prctl(PR_SET_MM_MAP)`` with this process's
    own memory map, new argument and environment areas; it needs no privilege on Linux
    3.18 and later with checkpoint/restore built in. False (the zygote's shown) where
    the kernel refuses."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(") ", 1)[1].split()
        stat = {number: int(fields[number - 3]) for number in (26, 27, 28, 45, 46, 47)}
        args = b"".join(a.encode(errors="surrogateescape") + b"\0" for a in command)
        variables = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0"
                             for k, v in env.items())
        area = ctypes.create_string_buffer(args + variables, len(args) + len(variables))
        base = ctypes.addressof(area)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sbrk.restype = ctypes.c_void_p
        memory = _MemoryMap(
            start_code=stat[26], end_code=stat[27], start_stack=stat[28], start_data=stat[45],
            end_data=stat[46], start_brk=stat[47], brk=libc.sbrk(0) or stat[47],
            arg_start=base, arg_end=base + len(args), env_start=base + len(args),
            env_end=base + len(args) + len(variables), auxv=0, auxv_size=0,
            exe_fd=0xFFFFFFFF)  # -1: the executable unchanged
        if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(memory),
                      ctypes.sizeof(memory), 0) != 0:
            return False
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    _presented.append(area)
    return True


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _reseed_numpy() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


def preload() -> float:
    """Import :data:`~phalanx.schemas.zygote.PRELOAD`; the seconds it took."""
    started = time.perf_counter()
    for name in protocol.PRELOAD:
        importlib.import_module(name)
    return time.perf_counter() - started


class Template:
    """A zygote of zygotes: forks each agent's zygote with :data:`PRELOAD` imported once.

    It serves one :class:`~phalanx.schemas.zygote.Spawn` per connection, in turn, and
    only for an environment equal to its own (once ``PHALANX_*`` and the replica's
    variables are left out): its imports must have read what the zygote's would have.
    It imports at the first request, so a machine whose agents never fork pays nothing.
    """

    def __init__(self, listener: socket.socket,
                 environment: Mapping[str, str] | None = None) -> None:
        self.listener = listener
        self.environment = protocol.import_environment(
            os.environ if environment is None else environment)
        self.seconds: float | None = None  # the imports', once done

    def serve(self) -> NoReturn:
        """Serve until killed (a template's children are reaped as they end)."""
        signal.signal(signal.SIGCHLD, _reap_all)
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError as exc:  # a connection reset before it was accepted
                log.warning("zygote template: accept failed: %s", exc)
                continue
            with connection:
                self.serve_one(connection)

    def serve_one(self, connection: socket.socket) -> None:
        """Read one request from ``connection``, answer it, close what came with it."""
        connection.settimeout(_TEMPLATE_READ_TIMEOUT_S)
        fds: list[int] = []
        try:
            body, fds = _read_frame(connection)
            reply = self._spawn(body, fds, connection)
        except (OSError, ValueError) as exc:
            reply = protocol.SpawnFailed(error=f"bad request: {exc}")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(OSError):  # the agent gave up waiting: its loss
            connection.sendall(protocol.encode_template_reply(reply))

    def _spawn(self, body: bytes, fds: list[int],
               connection: socket.socket) -> protocol.TemplateReply:
        try:
            request = protocol.decode_spawn(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return protocol.SpawnFailed(error=f"bad request: {exc}")
        if len(fds) != 3:
            return protocol.SpawnFailed(
                error=f"{len(fds)} descriptor(s) came with the request, not 3")
        elsewhere = namespaces_not_shared(connection)
        if elsewhere:
            return protocol.SpawnFailed(
                error=f"the agent runs in other namespaces than the template's "
                      f"({', '.join(elsewhere)}): a zygote forked here would not")
        wanted = protocol.import_environment(request.env)
        if wanted != self.environment:
            differing = sorted(k for k in wanted.keys() | self.environment.keys()
                               if wanted.get(k) != self.environment.get(k))
            return protocol.SpawnFailed(
                error=f"the environment differs from the template's in {differing[:8]}")
        if self.seconds is None:
            self.seconds = preload()
        if threading.active_count() != 1 or _cuda_initialized():
            return protocol.SpawnFailed(error="the template cannot fork safely")
        try:
            pid = os.fork()
        except OSError as exc:
            return protocol.SpawnFailed(error=str(exc))
        if pid == 0:
            self._become(request, fds, connection)
        return protocol.Spawned(pid=pid)

    def _become(self, request: protocol.Spawn, fds: list[int],
                connection: socket.socket) -> NoReturn:
        """In the child: leave the template, serve as a zygote until its agent goes."""
        try:
            os.setsid()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.listener.close()
            connection.close()
            requests_fd, events_fd, output = fds
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(output)
            stdin = os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            os.close(stdin)
            os.environ.clear()
            os.environ.update(request.env)
            zygote = Zygote(socket.socket(fileno=requests_fd), socket.socket(fileno=events_fd))
            zygote.requests.setblocking(True)
            zygote.events.setblocking(True)
            zygote._send(protocol.Ready(pid=os.getpid(), seconds=self.seconds or 0.0))
            zygote.serve()
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        os._exit(0)


#: The namespaces a process forked by a template lives in: the template's, not those of
#: the agent that asked (``ip netns exec``: a node of its own network).
NAMESPACES = ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup")


def namespaces_not_shared(connection: socket.socket) -> list[str]:
    """The namespaces the process at the other end of ``connection`` does not share with
    this one. A zygote forked here for an agent in another network namespace ran its
    ranks in the template's network: partitioned nodes whose ranks were not cut off."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
    pid = struct.unpack("3i", credentials)[0]
    differing = []
    for kind in NAMESPACES:
        try:
            if os.readlink(f"/proc/{pid}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"):
                differing.append(kind)
        except OSError:  # a kernel without that namespace, or the peer gone
            continue
    return differing


#: How long a template waits for the rest of a request once a connection is accepted.
_TEMPLATE_READ_TIMEOUT_S = 5.0


def _read_frame(connection: socket.socket) -> tuple[bytes, list[int]]:
    """One frame and the descriptors that came with it.

    Raises:
        ValueError: the frame is too long, or the connection ended first.
        OSError: reading failed (timed out, reset).
    """
    data = bytearray()
    fds: list[int] = []
    try:
        while True:
            chunk, more, _, _ = socket.recv_fds(connection, 1 << 16, 4)
            fds += more
            if not chunk:
                raise ValueError("the connection ended inside a request")
            data += chunk
            if len(data) >= protocol.HEADER_BYTES:
                end = protocol.HEADER_BYTES + protocol.frame_length(
                    bytes(data[:protocol.HEADER_BYTES]))
                if len(data) >= end:
                    return bytes(data[protocol.HEADER_BYTES:end]), fds
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise


def _reap_all(*_: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def serve_template(path: str, listening: int) -> NoReturn:
    """Listen on the Unix socket ``path`` (only this user may connect), say so by closing
    the descriptor ``listening``, and serve."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old_mask)
    listener.listen(16)
    os.close(listening)
    Template(listener).serve()


def main() -> None:
    # No logging set up here: a child would inherit the handlers, and the script's own
    # ``logging.basicConfig`` would then do nothing.
    if len(sys.argv) == 4 and sys.argv[1] == "--template":
        serve_template(sys.argv[2], int(sys.argv[3]))
    requests = socket.socket(fileno=int(os.environ.pop(protocol.REQUESTS_FD)))
    events = socket.socket(fileno=int(os.environ.pop(protocol.EVENTS_FD)))
    requests.setblocking(True)
    events.setblocking(True)
    seconds = preload()
    zygote = Zygote(requests, events)
    zygote._send(protocol.Ready(pid=os.getpid(), seconds=seconds))
    zygote.serve()


if __name__ == "__main__":
    main()

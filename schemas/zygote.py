"""What a node agent and its zygote say to each other, and which commands a zygote can run.

A *zygote* (:mod:`phalanx.runtime.zygote`) is a Python interpreter an agent keeps
with torch and the rank runtime already imported; a rank or a warm spare whose
command is a Python script run by that same interpreter is *forked* from it
instead of started cold, so it skips the imports (1.5 to 2 s of CPU on a quiet
machine, several seconds on a loaded one). Both sides take the protocol from
here, so neither imports the other.

The agent talks over two sockets it passes to the zygote: on the *request*
socket it sends one :class:`Fork` at a time as a frame (:func:`frame`: a 4-byte
length, then the JSON), with the file descriptors the child gets attached
(``SCM_RIGHTS``): a pipe holding its :class:`Program`, its standard output/error
and input; on the *event* socket the zygote
writes JSON lines: :class:`Ready` once, then :class:`Forked` or
:class:`ForkFailed` for each request and :class:`Exited` for each child that
ended (the zygote is their parent, so only it can collect their exit status).

A machine that runs several agents (a local cluster, ``phalanx up``) may keep one
*template* (``python -m phalanx.runtime.zygote --template PATH``): a zygote of zygotes
listening on a Unix socket, that imports :data:`PRELOAD` once, at its first request,
and forks each agent's zygote from then on, so the machine pays torch's imports once
rather than once per agent. An agent told of one (``PHALANX_AGENT_ZYGOTE_TEMPLATE``)
connects, sends one :class:`Spawn` frame with the new zygote's two sockets and its log
attached, and reads one JSON line back: :class:`Spawned` or :class:`SpawnFailed`. A
template serves only an environment equal to its own (:func:`import_environment`):
what its imports read must be what the zygote's would have read; for any other the
agent starts a zygote of its own, as it would without a template.

A rank's program may be *held*: the agent writes it into the pipe only once the
rank is on its record (where a restarted agent finds it), so a child whose agent
died before that reads nothing and exits with :data:`NOT_RELEASED` without
running any of the job's code.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence

import msgspec

from phalanx.schemas import settings

#: The module an agent runs (``python -m``) as a zygote.
MODULE = "phalanx.runtime.zygote"
#: What a zygote imports before it forks anything: what every rank imports first, and
#: ``torch._dynamo``, which torch imports at an optimizer's first step (over 800 modules,
#: 1 to 2.5 s of CPU: more than torch itself).
PRELOAD = ("torch", "torch._dynamo", "phalanx.runtime.elastic")
#: Interpreter options a forked child can honour (``-u``: unbuffered output).
OPTIONS = frozenset({"-u"})
#: The variables that give the zygote its two sockets' descriptor numbers.
REQUESTS_FD = "PHALANX_ZYGOTE_REQUESTS_FD"
EVENTS_FD = "PHALANX_ZYGOTE_EVENTS_FD"
#: The exit status of a process held for its agent that never let it run (the agent died
#: before the process was on its record): nothing of the job's command ran.
NOT_RELEASED = 125
#: What such a process writes to its log before it exits.
NOT_RELEASED_LINE = "=== phalanx: not started: the agent that launched it died first\n"
#: The most bytes one frame may hold (a request is its command and environment).
MAX_FRAME = 4 << 20

#: Variables set per replica that are not ``PHALANX_*``: left out of a zygote's
#: environment (see the module docstring) and given to each child.
REPLICA_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                               "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                               "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RUN_ID"})

#: Variables an agent that runs each job as its own user sets per job (its private
#: directories): left out of a zygote's environment too, so one zygote still serves
#: every job of an import environment; the child re-reads what the preload cached of
#: them (``tempfile``'s directory).
JOB_VARIABLES = frozenset({"HOME", "TMPDIR"})

#: Variables no preloaded import reads, whose values a process reads once it runs:
#: OpenTelemetry's (a rank sets its tracing up in its session, after the fork) and
#: pytest's name of the test phase running (set anew at every phase of every test).
#: Left out of a zygote's environment, so that these alone never cost a zygote, and a
#: machine's template, of its own: torch imported again.
NOT_IMPORTED_PREFIXES = ("OTEL_",)
NOT_IMPORTED = frozenset({"PYTEST_CURRENT_TEST"})

_LENGTH = struct.Struct("!I")


class Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a Python command runs: a script or a module (``-m``), with its arguments."""

    argv: tuple[str, ...]
    """``sys.argv`` of the program: the script's path (or the module's name) first."""
    module: bool = False
    """``argv[0]`` is a module (``python -m``), not a script's path."""
    unbuffered: bool = False
    """``-u``: standard output and error unbuffered."""


class Program(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one child runs, and as whom: read by the child alone, from a pipe."""

    command: tuple[str, ...]
    """The command line as the job gave it (what ``/proc/<pid>/cmdline`` shows)."""
    entry: Entry
    env: dict[str, str]
    cwd: str
    uid: int | None = None
    """The user it runs as (its job's, ``agent.job_uids``): the child drops to it, with
    ``gid``, no supplementary groups, umask 077 and no core dumps or ``/proc`` reads by
    others (``PR_SET_DUMPABLE`` 0), before any of the program runs. None: the zygote's."""
    gid: int | None = None
    """The group it runs as, with ``uid``."""


class Fork(msgspec.Struct, frozen=True, tag="fork", forbid_unknown_fields=True):
    """Fork a child, in a session of its own. Attached: the read end of a pipe that holds
    the child's :class:`Program` (the zygote never reads it: a job's variables, its bus
    credentials among them, never enter the zygote that later children are copies of),
    then the child's standard output and error, then, with ``stdin``, its standard input
    (else /dev/null)."""

    request: int
    stdin: bool = False


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """The zygote has imported :data:`PRELOAD` and forks from now on."""

    pid: int
    seconds: float
    """How long the imports took."""


class Forked(msgspec.Struct, frozen=True, tag="forked"):
    """Request ``request`` is child ``pid``, already the leader of its own session."""

    request: int
    pid: int


class ForkFailed(msgspec.Struct, frozen=True, tag="fork_failed"):
    """Request ``request`` (-1: unreadable) forked nothing, and why; the agent starts the
    process cold."""

    request: int
    error: str


class Exited(msgspec.Struct, frozen=True, tag="exited"):
    """A child ended: ``code`` as ``subprocess`` reports it (a signal: its negative)."""

    pid: int
    code: int


Event = Ready | Forked | ForkFailed | Exited


class Spawn(msgspec.Struct, frozen=True, tag="spawn", forbid_unknown_fields=True):
    """Ask a template for a zygote of environment ``env``. Attached: the zygote's request
    socket, its event socket (it sends :class:`Ready` there first, as a zygote started
    cold does) and its log (standard output and error)."""

    env: dict[str, str]


class Spawned(msgspec.Struct, frozen=True, tag="spawned"):
    """The zygote is process ``pid`` (the template's child, leading its own session)."""

    pid: int


class SpawnFailed(msgspec.Struct, frozen=True, tag="spawn_failed"):
    """No zygote was forked, and why; the agent starts one of its own."""

    error: str


TemplateReply = Spawned | SpawnFailed

_encoder = msgspec.json.Encoder()
_requests = msgspec.json.Decoder(Fork)
_programs = msgspec.json.Decoder(Program)
_events: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)
_spawns = msgspec.json.Decoder(Spawn)
_template_replies: msgspec.json.Decoder[TemplateReply] = msgspec.json.Decoder(TemplateReply)


def frame(request: Fork | Spawn) -> bytes:
    """``request`` as one frame of the request socket."""
    body = _encoder.encode(request)
    return _LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The body length a frame's 4-byte header announces.

    Raises:
        ValueError: more than :data:`MAX_FRAME`.
    """
    length: int = _LENGTH.unpack(header)[0]
    if length > MAX_FRAME:
        raise ValueError(f"a zygote request of {length} bytes (at most {MAX_FRAME})")
    return length


HEADER_BYTES = _LENGTH.size


def decode_request(body: bytes) -> Fork:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on a bad frame."""
    return _requests.decode(body)


def decode_spawn(body: bytes) -> Spawn:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on a bad frame."""
    return _spawns.decode(body)


def encode_template_reply(reply: TemplateReply) -> bytes:
    return _encoder.encode(reply) + b"\n"


def decode_template_reply(line: bytes) -> TemplateReply:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on a bad line."""
    return _template_replies.decode(line)


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without what the agent sets per job and per replica: the environment a
    zygote that may fork a process of ``env`` is started in."""
    return {k: v for k, v in env.items()
            if not k.startswith((settings.PREFIX, *NOT_IMPORTED_PREFIXES))
            and k not in REPLICA_VARIABLES and k not in JOB_VARIABLES
            and k not in NOT_IMPORTED}


def with_interpreter_path(env: Mapping[str, str], executable: str) -> dict[str, str]:
    """``env`` with ``executable``'s folder first on its ``PATH``: how a rank runs in its
    agent's environment (as torchrun's workers do), and so a template's environment."""
    return {**env, "PATH": os.pathsep.join([os.path.dirname(executable),
                                            env.get("PATH", "")])}


def encode_program(program: Program) -> bytes:
    return _encoder.encode(program)


def decode_program(data: bytes) -> Program:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on bad data."""
    return _programs.decode(data)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event) + b"\n"


def decode_event(line: bytes) -> Event:
    """Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on a bad line."""
    return _events.decode(line)


def python_entry(command: Sequence[str], env: Mapping[str, str],
                 executable: str) -> Entry | None:
    """What ``command`` runs, if it is ``executable`` running a script or a module; None
    for anything a forked child of ``executable`` cannot run exactly as ``command`` would.

    ``command[0]`` must name ``executable`` itself (found on ``env``'s ``PATH`` when it has
    no slash): the same path, or a name for the same binary in the same directory
    (``python`` beside ``python3`` in a virtual environment). A link to the same binary
    elsewhere is another interpreter: a virtual environment's ``python`` and the
    system's import different things. Its options may only be :data:`OPTIONS`, then a
    script or ``-m`` and a module.
    """
    if not command:
        return None
    program = command[0]
    if os.sep not in program:
        found = which(program, env.get("PATH", ""))
        if found is None:
            return None
        program = found
    if not _same_interpreter(program, executable):
        return None
    rest = list(command[1:])
    unbuffered = False
    while rest and rest[0] in OPTIONS:
        unbuffered = unbuffered or rest.pop(0) == "-u"
    if not rest:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return Entry(argv=tuple(rest[1:]), module=True, unbuffered=unbuffered)
    if rest[0].startswith("-") or rest[0] == "":
        return None  # -c, -X, a stdin script ("-"): run cold, as given
    return Entry(argv=tuple(rest), unbuffered=unbuffered)


def _same_interpreter(program: str, executable: str) -> bool:
    program, executable = os.path.abspath(program), os.path.abspath(executable)
    if program == executable:
        return True
    try:
        return os.path.dirname(program) == os.path.dirname(executable) \
            and os.path.samefile(program, executable)
    except OSError:
        return False


def which(name: str, path: str) -> str | None:
    """The file ``exec`` runs for the bare command ``name`` searched on ``path`` (a
    ``PATH`` value): the first executable file of that name in its folders."""
    for folder in path.split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None

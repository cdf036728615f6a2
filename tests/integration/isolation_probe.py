"""A rank of the isolation tests (test_agent_isolation.py): a victim, or an attacker.

``victim``: says who it runs as, hosts a rendezvous store as a replica does (the job's
secret from its agent), uses it as a member, then writes into its own snapshot buffer
once its agent made it (the test reserves it), and sleeps.

``attacker``: says who it runs as, then tries, on the victim job, each thing one job
must not do to another, and prints what each attempt raised (``ok`` when it worked):
read the agent's keys (``PROBE_FILES``) and mint a bus token with its rank token key
(``PROBE_TOKEN_KEY``), read and write the victim's snapshot buffer
(``PROBE_SNAPSHOT``), read its ``/proc/<pid>/environ`` and signal it (``PROBE_PID``), and
connect to its rendezvous store (``PROBE_STORE``). Every line it prints is one JSON
object.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys
import time
from pathlib import Path

from phalanx.runtime.group import host_store, store_client
from phalanx.schemas import environment
from phalanx.services.auth import rank_token

TIMEOUT = datetime.timedelta(seconds=10)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def who() -> None:
    libc = ctypes.CDLL(None)
    tmp = Path(os.environ["TMPDIR"]) / "mine"
    tmp.write_text("x")  # its own private directory is writable
    say(uid=os.getuid(), gid=os.getgid(), groups=os.getgroups(), dumpable=libc.prctl(3, 0, 0, 0, 0),
        umask=os.umask(0o077), tmpdir=os.environ["TMPDIR"], home=os.environ["HOME"],
        tmp_mode=oct(os.stat(os.environ["TMPDIR"]).st_mode & 0o777),
        secret=bool(environment.store_secret(os.environ)))


def attempt(what: str, action) -> None:  # type: ignore[no-untyped-def]
    try:
        action()
    except Exception as exc:  # what it raised is the result
        say(what=what, raised=type(exc).__name__, permission=isinstance(exc, PermissionError),
            message=str(exc)[:200])
    else:
        say(what=what, raised="ok", permission=False)


def victim() -> None:
    who()
    secret = environment.store_secret(os.environ)
    hosted = host_store(TIMEOUT, secret)
    member = store_client("127.0.0.1", hosted.port, TIMEOUT, secret)
    member.set("weights", "mine")
    say(store=f"127.0.0.1:{hosted.port}", member_read=member.get("weights").decode())
    buffer = Path(os.environ[environment.SNAPSHOT_DIR]) / "w1-s0.0"
    while not buffer.exists():
        time.sleep(0.05)
    with buffer.open("r+b") as f:
        f.write(b"victim's own")
    say(wrote=str(buffer))
    time.sleep(600)


def attacker() -> None:
    who()
    for path in os.environ["PROBE_FILES"].split(os.pathsep):
        attempt(f"read {path}", lambda path=path: Path(path).read_bytes())
    attempt("mint a token", lambda: rank_token.mint(
        bytes.fromhex(Path(os.environ["PROBE_TOKEN_KEY"]).read_text()), "victim",
        now=time.time(), ttl_s=3600, nonce=os.urandom(rank_token.NONCE_BYTES)))
    snapshot = Path(os.environ["PROBE_SNAPSHOT"])
    attempt("read snapshot", lambda: snapshot.read_bytes())
    attempt("write snapshot", lambda: snapshot.open("r+b").write(b"poison"))
    attempt("list snapshots", lambda: os.listdir(snapshot.parent))
    pid = int(os.environ["PROBE_PID"])
    attempt("read environ", lambda: Path(f"/proc/{pid}/environ").read_bytes())
    attempt("signal", lambda: os.kill(pid, 0))
    host, _, port = os.environ["PROBE_STORE"].rpartition(":")
    attempt("connect store", lambda: store_client(host, int(port), TIMEOUT,
                                                  environment.store_secret(os.environ)))
    say(done=True)


if __name__ == "__main__":
    {"victim": victim, "attacker": attacker}[sys.argv[1]]()

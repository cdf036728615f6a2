"""Where an agent makes its ranks' memory cgroups (:mod:`.cgroups`), read from
``/proc/self/mountinfo`` and ``/proc/self/cgroup`` as a v1 and a v2 machine show them,
and what an exit is reported as when the OOM killer ended it."""

from __future__ import annotations

from pathlib import Path

from phalanx.schemas.messages import ExitCause
from phalanx.services.agent.cgroups import MemoryCgroups
from phalanx.services.agent.core import StopReason, exit_cause

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_OWN = "4:memory:/jobs/agent-7\n1:cpu:/\n0::/\n"


def test_on_cgroup_v1_the_memory_hierarchy_is_used_under_the_agents_own(
        tmp_path: Path) -> None:
    found, why = MemoryCgroups.find(V1_MOUNTS.replace("/sys/fs/cgroup", str(tmp_path)),
                                    V1_OWN)
    assert found is None and "not writable" in why  # no such folder here: nothing made
    (tmp_path / "memory" / "jobs" / "agent-7").mkdir(parents=True)
    found, why = MemoryCgroups.find(V1_MOUNTS.replace("/sys/fs/cgroup", str(tmp_path)),
                                    V1_OWN)
    assert found is not None and why == ""
    assert (found.version, found.parent) == (1, tmp_path / "memory" / "jobs" / "agent-7")
    assert found.path("n1", "job/x-12").name == "phalanx-n1-job_x-12"


def test_on_cgroup_v2_the_memory_controller_must_be_delegated(tmp_path: Path) -> None:
    mounts = f"30 1 0:26 / {tmp_path} rw - cgroup2 cgroup2 rw\n"
    own = tmp_path / "agent.scope"
    own.mkdir()
    (own / "cgroup.controllers").write_text("cpu io pids\n")
    found, why = MemoryCgroups.find(mounts, "0::/agent.scope\n")
    assert found is None and "memory controller is not available" in why
    (own / "cgroup.controllers").write_text("cpu io memory pids\n")
    found, _ = MemoryCgroups.find(mounts, "0::/agent.scope\n")
    assert found is not None and (found.version, found.parent) == (2, own)


def test_an_oom_kill_is_read_from_the_cgroup_and_reported_as_the_ranks_own() -> None:
    assert exit_cause(None, oom=True) is ExitCause.OOM
    assert exit_cause(None, status_known=False, oom=True) is ExitCause.OOM
    assert exit_cause(StopReason.JOB, oom=True) is ExitCause.STOPPED  # stopping it: no fault
    assert exit_cause(StopReason.AGENT, oom=True) is ExitCause.LOST


def test_oom_kills_are_counted_from_the_cgroups_own_files(tmp_path: Path) -> None:
    for version, name, text in (
            (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"),
            (2, "memory.events", "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")):
        cgroup = tmp_path / f"v{version}"
        cgroup.mkdir()
        cgroups = MemoryCgroups(tmp_path, version)
        assert not cgroups.oom_killed(cgroup)  # nothing there yet
        (cgroup / name).write_text(text)
        assert cgroups.oom_killed(cgroup)
        (cgroup / name).write_text(text.replace("oom_kill 1", "oom_kill 0"))
        assert not cgroups.oom_killed(cgroup)

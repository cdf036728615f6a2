"""CPU sets: the list format, each slot's share of an agent's CPUs, and pinning a process
with threads of its own (real processes, this machine's CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.schemas.errors import ConfigError
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import rank_cpus
from phalanx.services.agent.cpus import (
    core_of,
    format_cpu_list,
    parse_cpu_list,
    pin,
    run_on,
    shares,
)
from phalanx.services.cluster import LocalCluster


def test_the_list_format_reads_ranges_and_single_cpus_and_writes_them_back() -> None:
    assert parse_cpu_list("0-3,8, 10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("3,1,1-2") == (1, 2, 3)
    assert parse_cpu_list("") == ()
    assert format_cpu_list((11, 0, 1, 2, 3, 8, 10)) == "0-3,8,10-11"
    for bad, why in (("a", "CPU numbers"), ("1-", "CPU numbers"), ("4-2", "backwards"),
                     ("-1", "CPU numbers")):
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad)


@given(st.sets(st.integers(0, 300)))
def test_the_list_format_round_trips(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == tuple(sorted(cpus))


def test_the_agent_config_reads_its_cpus_and_names_a_bad_list() -> None:
    assert AgentConfig.from_env(env={"PHALANX_AGENT_CPUS": "0-2,5"}).cpus == (0, 1, 2, 5)
    assert AgentConfig.from_env(env={}, cpus="1").cpus == (1,)
    assert AgentConfig.from_env(env={}).cpus == ()
    with pytest.raises(ConfigError, match="'x'"):
        AgentConfig.from_env(env={"PHALANX_AGENT_CPUS": "0,x"})


def hyperthreads(count: int):
    """A machine numbering its cores' two hyperthreads ``c`` and ``c + count`` (Intel's)."""
    return lambda cpu: (0, cpu % count)


def test_shares_are_whole_cores_never_one_cores_two_hyperthreads_in_two_shares() -> None:
    assert shares(range(16), 2, hyperthreads(8)) == ((0, 1, 2, 3, 8, 9, 10, 11),
                                                     (4, 5, 6, 7, 12, 13, 14, 15))
    assert shares(range(16), 3, hyperthreads(8)) == ((0, 1, 2, 8, 9, 10), (3, 4, 5, 11, 12, 13),
                                                     (6, 7, 14, 15))
    # Fewer cores than slots: the hyperthreads one by one, then CPUs shared round.
    assert shares((0, 1, 2, 3), 4, hyperthreads(2)) == ((0,), (2,), (1,), (3,))
    assert shares((4, 5), 3, lambda cpu: (0, cpu)) == ((4,), (5,), (4,))
    with pytest.raises(ValueError, match="0 CPU"):
        shares((), 2)


@given(cpus=st.sets(st.integers(0, 127), min_size=1), parts=st.integers(1, 40),
       threads=st.sampled_from([1, 2, 4]))
def test_shares_cover_the_cpus_once_each_whole_cores_and_even(
        cpus: set[int], parts: int, threads: int) -> None:
    def core(cpu: int) -> tuple[int, int]:
        return (cpu // 64, cpu % 64 // threads)

    split = shares(sorted(cpus), parts, core)
    assert len(split) == parts and all(split)
    assert {cpu for share in split for cpu in share} == cpus
    if len(cpus) < parts:
        return
    assert sum(map(len, split)) == len(cpus)  # disjoint
    cores = [{core(cpu) for cpu in share} for share in split]
    if len({core(cpu) for cpu in cpus}) >= parts:
        assert sum(map(len, cores)) == len({core(cpu) for cpu in cpus})  # a core in one share
        assert max(map(len, cores)) - min(map(len, cores)) <= 1
    else:
        assert max(map(len, split)) - min(map(len, split)) <= 1


def test_this_machines_topology_is_read(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    package, core = core_of(cpu)
    assert package >= 0 and core >= 0
    topology = tmp_path / "cpu3" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text("1\n")
    (topology / "core_id").write_text("7\n")
    assert core_of(3, tmp_path) == (1, 7)
    assert core_of(4, tmp_path) == (-1, 4)  # not described: a core of its own


def test_a_cpu_slots_rank_is_pinned_to_its_slots_share() -> None:
    slot_cpus = ((0, 1), (2, 3))
    assert rank_cpus((), [], (1,), slot_cpus) == {2, 3}
    assert rank_cpus((), [], (0, 1), slot_cpus) == {0, 1, 2, 3}
    assert rank_cpus((), [], (0,)) == set()  # no set: not pinned


THREADS = """
import os, sys, threading
stop = threading.Event()
for _ in range(3):
    threading.Thread(target=stop.wait, daemon=True).start()
print(len(os.listdir(f"/proc/{os.getpid()}/task")), flush=True)
sys.stdin.read()
"""


def test_pinning_takes_every_thread_the_process_already_has() -> None:
    """As a warm spare's: its threads were started before it was given a slot."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin to")
    process = subprocess.Popen([sys.executable, "-c", THREADS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and int(process.stdout.readline()) == 4
        pin(process.pid, {allowed[1]})
        tasks = os.listdir(f"/proc/{process.pid}/task")
        assert len(tasks) == 4
        assert all(os.sched_getaffinity(int(tid)) == {allowed[1]} for tid in tasks)
    finally:
        process.kill()
        process.wait()


def test_an_agent_is_refused_cpus_it_may_not_use_naming_them() -> None:
    allowed = os.sched_getaffinity(0)
    beyond = max(allowed) + 1
    with pytest.raises(ConfigError, match=f"CPUs {beyond} that this agent may not use"):
        run_on((beyond,))
    assert os.sched_getaffinity(0) == allowed


def test_a_local_clusters_pinned_agents_split_this_machines_cpus(tmp_path: Path) -> None:
    allowed = os.sched_getaffinity(0)
    cluster = LocalCluster(tmp_path, agents=len(allowed), pin_cpus=True)
    split = [set(parse_cpu_list(cluster._cpus_of(i)["PHALANX_AGENT_CPUS"]))
             for i in range(len(allowed))]
    assert all(len(share) == 1 for share in split) and set().union(*split) == allowed
    assert LocalCluster(tmp_path, agents=2)._cpus_of(0) == {}  # not pinned: no set

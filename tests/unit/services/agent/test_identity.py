"""Job identities on the node: which uid a job gets (:func:`~.core.job_user`), the range
configured, and what an agent lacks to hand them out (:mod:`.identity`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.schemas.errors import ConfigError
from phalanx.services.agent.config import AgentConfig
from phalanx.services.agent.core import JobUidsExhausted, JobUser, job_user
from phalanx.services.agent.identity import JobIdentities, missing_capabilities

UIDS = range(20000, 20004)


def test_a_job_keeps_its_uid_and_two_jobs_never_share_one() -> None:
    held: dict[str, int] = {}
    for job in ("a", "b", "c", "d"):
        held[job] = job_user(job, held, UIDS).uid
    assert sorted(held.values()) == list(UIDS)  # four jobs, four uids
    assert all(job_user(job, held, UIDS) == JobUser(uid, uid) for job, uid in held.items())
    with pytest.raises(JobUidsExhausted, match="all 4 uids"):
        job_user("e", held, UIDS)
    assert isinstance(JobUidsExhausted("x"), OSError)  # a launch failure, not a crash
    del held["b"]
    assert job_user("e", held, UIDS).uid not in held.values()


def test_a_job_first_gets_the_uid_its_id_picks_on_any_node() -> None:
    """Without a mapping (another node, or one lost), the same job picks the same uid."""
    assert job_user("train-7", {}, range(20000, 30000)) == job_user(
        "train-7", {}, range(20000, 30000))


@pytest.mark.parametrize(("raw", "uids"), [
    ("20000-29999", range(20000, 30000)), ("20000", range(20000, 20001)), ("", None)])
def test_the_range_of_job_uids_is_read_from_the_environment(raw: str,
                                                             uids: range | None) -> None:
    config = AgentConfig.from_env({"PHALANX_AGENT_JOB_UIDS": raw}, node_id="n")
    assert config.job_uid_range == uids


@pytest.mark.parametrize("raw", ["abc", "20000-", "30000-20000", "0-10"])
def test_a_bad_range_of_job_uids_is_refused_saying_what_is_allowed(raw: str) -> None:
    with pytest.raises(ConfigError, match="job_uids"):
        AgentConfig.from_env({"PHALANX_AGENT_JOB_UIDS": raw}, node_id="n")


def test_an_agent_without_the_capabilities_is_told_which_it_lacks() -> None:
    root = "Name:\tagent\nCapEff:\t000001ffffffffff\n"
    assert missing_capabilities(root, UIDS, (0, 0)) == []
    setuid_only = "CapEff:\t00000000000000c0\n"  # CAP_SETGID and CAP_SETUID
    missing = missing_capabilities(setuid_only, UIDS, (10001, 10001))
    assert [m.split()[0] for m in missing] == ["CAP_CHOWN", "CAP_DAC_OVERRIDE",
                                               "CAP_FOWNER", "CAP_KILL"]
    assert missing_capabilities(root, UIDS, (20001, 0)) == [
        "the agent's own uid 20001 is in the range"]


def test_a_restarted_agent_gives_each_job_the_uid_it_had(tmp_path: Path) -> None:
    """The uids held are on disk before a process of the job starts: an agent SIGKILLed
    and started again gives its adopted ranks' jobs the same ones, and a uid is given
    back only once nothing of its job is left."""
    first = JobIdentities(tmp_path, UIDS, (tmp_path / "tmp", tmp_path / "shm"))
    given = {job: first.user(job).uid for job in ("a", "b")}
    again = JobIdentities(tmp_path, UIDS, (tmp_path / "tmp", tmp_path / "shm"))
    assert {job: again.user(job).uid for job in ("b", "a")} == given
    assert not again.release("a", still_here={"a"})  # a snapshot of it is left
    assert again.release("a", still_here=set())
    assert JobIdentities(tmp_path, UIDS, (tmp_path / "tmp", tmp_path / "shm")).held == {
        "b": given["b"]}

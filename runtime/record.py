"""Reading the replicas' records back: which step trained on what, and was anything lost.

Every replica of a job run with ``PHALANX_RECORD_DIR`` appends its own record
(see :mod:`.elastic`): a ``batch`` line with the sample indices of each step
it took part in (written before its gradients left the process), a
``commit`` line per committed step (then, when the step was snapshotted, a
``snapshot`` line that :func:`read` folds into it), ``generation`` lines with the time of
each phase of a membership change, and an ``adopt`` line when it received
its state from a peer.

:func:`verify` checks a run against the elastic data order: the step counter
of every replica only moves forward by one (or jumps to the step it adopted),
every step ``0..total-1`` was committed, and the shares of each step, in the
generation whose commit the model kept, cover the step's global batch exactly
once. Over each full epoch that is every sample exactly once. :func:`timeline`
gives per-step commit times and losses for downtime figures and plots.
:class:`Recorder` is the writing side, one per replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from phalanx.runtime.data import ElasticOrder


class Recorder:
    """This replica's append-only record, ``<directory>/<replica_id>.jsonl``.

    Each :meth:`write` is one ``os.write`` of one line, so a line is whole or
    missing (:func:`read` skips a line cut short) even under SIGKILL.
    """

    def __init__(self, directory: str | Path, replica_id: str, admission: int = 0) -> None:
        os.makedirs(directory, exist_ok=True)
        self.fd = os.open(os.path.join(directory, f"{replica_id}.jsonl"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # On every line where known: a replica id, and the generation numbers, start again
        # with each admission of the job, so a line names its generation with it.
        self._admission = {"admission": admission} if admission else {}

    def write(self, **fields: Any) -> None:
        line = {"t": time.time(), **self._admission, **fields}
        os.write(self.fd, (json.dumps(line) + "\n").encode())

    def close(self) -> None:
        """Idempotent."""
        if self.fd < 0:
            return  # closed already: the number may belong to another file by now
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def read(record_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Every replica's record lines (a line cut short by a kill is skipped), a step's
    ``snapshot`` line folded into its ``commit`` line (its fields added there)."""
    records: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(record_dir).glob("*.jsonl")):
        lines: list[dict[str, Any]] = []
        for text in path.read_text().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if line.get("kind") == "snapshot":
                commit = next((c for c in reversed(lines) if c["kind"] == "commit"), None)
                if commit is not None and commit["step"] == line["step"]:
                    commit.update({k: v for k, v in line.items() if k not in ("t", "kind")})
                continue
            lines.append(line)
        records[path.stem] = lines
    return records


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    generation: int  # the generation whose commit the model kept
    world_size: int  # of the generation that ran it
    committed_at: float  # when its last rank committed it
    loss: float  # the global batch's mean loss (sum of the ranks' weighted shares)
    admission: int = 0  # the job's admission that generation was of (0: not recorded)


#: A generation as the records name it: (the job's admission, its number in it).
GenerationKey = tuple[int, int]


def generation_of(line: dict[str, Any]) -> GenerationKey:
    """The generation a record line is of (a job admitted again numbers its generations
    from 0 again; a line without an admission is of admission 0)."""
    return line.get("admission", 0), line["generation"]


def _named(key: GenerationKey) -> str:
    admission, generation = key
    return f"generation {generation}" + (f" of admission {admission}" if admission else "")


def timeline(records: dict[str, list[dict[str, Any]]]) -> list[StepRecord]:
    """One entry per committed step, in step order.

    A step's generation is the highest that committed it (a step committed only
    by a rank that then died is run again by the survivors). Its loss sums the
    shares every rank of that generation recorded before its all-reduce, so a
    step some ranks committed and others abandoned still counts in full.
    """
    commits: dict[int, dict[GenerationKey, list[dict[str, Any]]]] = {}
    losses: dict[tuple[int, GenerationKey], float] = {}
    worlds: dict[tuple[int, GenerationKey], int] = {}
    for lines in records.values():
        for line in lines:
            if line["kind"] == "commit":
                commits.setdefault(line["step"], {}).setdefault(generation_of(line),
                                                                []).append(line)
            elif line["kind"] == "batch":
                key = (line["step"], generation_of(line))
                losses[key] = losses.get(key, 0.0) + (line.get("loss") or 0.0)
                worlds[key] = line["world_size"]
    steps = []
    for step in sorted(commits):
        generation = max(commits[step])
        kept = commits[step][generation]
        steps.append(StepRecord(step, generation[1], worlds.get((step, generation), 0),
                                max(c["t"] for c in kept),
                                losses.get((step, generation), 0.0), generation[0]))
    return steps


def verify(records: dict[str, list[dict[str, Any]]], order: ElasticOrder,
           total_steps: int) -> list[str]:
    """Everything wrong with the run, as sentences; empty when nothing is."""
    problems: list[str] = []
    for replica, lines in records.items():
        expected, admission = None, None
        for line in lines:
            if (admission_of := line.get("admission", 0)) != admission:
                expected, admission = None, admission_of  # another process, the id reused
            if line["kind"] in ("adopt", "restore"):  # the step this replica now holds
                expected = line["step"]
            elif line["kind"] == "commit":
                if expected is not None and line["step"] != expected:
                    problems.append(f"{replica} committed step {line['step']} after "
                                    f"{expected - 1}: the step counter repeated or skipped")
                expected = line["step"] + 1
    problems += _redone(records)
    kept = {s.step: (s.admission, s.generation) for s in timeline(records)}
    missing = sorted(set(range(total_steps)) - set(kept))
    if missing:
        problems.append(f"steps never committed: {missing[:10]}")
    shares: dict[tuple[int, GenerationKey], list[list[int]]] = {}
    for lines in records.values():
        for line in lines:
            if line["kind"] == "batch" and kept.get(line["step"]) == (key := generation_of(line)):
                shares.setdefault((line["step"], key), []).append(line["indices"])
    epochs: dict[int, list[int]] = {}
    for step, generation in sorted(kept.items()):
        epoch, in_epoch = divmod(step, order.steps_per_epoch)
        used = [i for share in shares.get((step, generation), []) for i in share]
        if sorted(used) != sorted(order.batch(epoch, in_epoch)):
            problems.append(f"step {step} ({_named(generation)}) trained on "
                            f"{len(used)} samples that are not exactly its batch")
        epochs.setdefault(epoch, []).extend(used)
    for epoch, used in epochs.items():
        complete = (epoch + 1) * order.steps_per_epoch <= total_steps
        # Every sample once; with drop_last, every sample of the epoch's full batches.
        whole = order.epoch_order(epoch)[:order.steps_per_epoch * order.global_batch]
        if complete and sorted(used) != sorted(whole):
            problems.append(f"epoch {epoch} did not use every sample exactly once")
    return problems


def _redone(records: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Steps a generation trained again although some replica had committed a later step
    before it started. (The step in flight is exempt: a rank that died right after its
    own commit of it took that commit along, and the survivors run it again.)"""
    commits = sorted((line["t"], line["step"], generation_of(line))
                     for lines in records.values() for line in lines
                     if line["kind"] == "commit")
    started: dict[GenerationKey, float] = {}
    for t, _, generation in commits:
        started.setdefault(generation, t)
    problems = []
    for generation, t0 in sorted(started.items(), key=lambda item: item[1]):
        before = max((step for t, step, g in commits if t < t0 and g != generation),
                     default=-1)
        again = sorted({step for _, step, g in commits if g == generation and step < before})
        if again:
            problems.append(f"{_named(generation)} trained {len(again)} step(s) again "
                            f"that were committed before it started (first {again[:5]}, the "
                            f"job had reached step {before})")
    return problems


def downtime(steps: list[StepRecord], at: float,
             until: float | None = None) -> tuple[float, float]:
    """``(longest gap between commits around time at, median gap before it)``.

    The downtime of an event is the first minus the second: how much longer the
    survivors went without committing than a normal step takes. The gaps looked at
    start from the last commit before ``at`` and end within 10 s, or before ``until``
    (the next event, whose own pause is not this one's).
    """
    pairs = list(itertools.pairwise(steps))
    before = [b.committed_at - a.committed_at for a, b in pairs if b.committed_at < at]
    median = statistics.median(before[-20:]) if before else 0.0
    end = at + 10 if until is None else min(at + 10, until)
    gaps = [b.committed_at - a.committed_at for a, b in pairs
            if a.committed_at <= end and b.committed_at >= at
            and (until is None or b.committed_at <= until)]
    return (max(gaps) if gaps else 0.0), median

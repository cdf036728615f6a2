"""The Python client of a phalanx cluster: submit, cancel, list and explain jobs.

Job specs are YAML (or a mapping) validated into :class:`JobSpec` before
anything is sent, so a typo names its field at once. Submitting is safe to
retry: the client picks the job id, and resubmitting the same id and spec is
a no-op on the server, so :meth:`AdmissionClient.submit` retries through an
admission leader election without ever creating a job twice.
"""

from __future__ import annotations

import asyncio
import difflib
import enum
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from phalanx.bus.client import Bus
from phalanx.bus.errors import NoResponders, RemoteError, RequestTimeout
from phalanx.bus.kv import TypedKV
from phalanx.schemas import subjects
from phalanx.schemas.errors import PhalanxError
from phalanx.schemas.messages import (
    Explanation,
    Generation,
    JobHistory,
    JobProgress,
    JobRecord,
    JobRequest,
    JobSpec,
    Message,
    ScaleRequest,
    SubmitRequest,
)

M = TypeVar("M", bound=Message)

RETRYABLE_CODES = {"503", "504"}


class SpecError(PhalanxError, ValueError):
    """A job spec file or mapping is not a valid JobSpec; the message names the field."""


def parse_job_spec(data: Mapping[str, Any], source: str = "job spec") -> JobSpec:
    """Validate a mapping (as read from YAML) into a JobSpec.

    Every error is reported at once: those of the fields given in their order (an
    unknown field with the known one it is closest to), then the required fields
    missing.

    Raises:
        SpecError: naming each field path (``$.replicas.min``) and its problem.
    """
    if not isinstance(data, Mapping):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    fields = {k: v for k, v in data.items() if k != "type"}
    errors = spec_errors(fields, JobSpec)
    if not errors:
        try:
            return msgspec.convert({"type": JobSpec.wire_name(), **fields}, JobSpec)
        except msgspec.ValidationError as exc:  # what spans fields (__post_init__)
            errors = [str(exc)]
    if len(errors) == 1:
        raise SpecError(f"{source}: {errors[0]}")
    raise SpecError(f"{source}: {len(errors)} errors:\n" + "\n".join(f"  {e}" for e in errors))


def spec_errors(data: Mapping[Any, Any], struct: type[msgspec.Struct],
                path: str = "$") -> list[str]:
    """Every error of ``data`` as a ``struct``, in msgspec's words with the field's path:
    each field given, in ``data``'s order (nested structs field by field), then each
    required field missing. Empty when every field is valid on its own (what spans
    fields, a struct's ``__post_init__``, is left to the conversion)."""
    known = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    errors: list[str] = []
    for key, value in data.items():
        field = known.get(key)
        if field is None:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            errors.append(f"Object contains unknown field `{key}`{hint}{_at(path)}")
            continue
        where = f"{path}.{key}"
        nested = field.type if isinstance(field.type, type) \
            and issubclass(field.type, msgspec.Struct) else None
        if nested is not None and isinstance(value, Mapping):
            inner = spec_errors(value, nested, where)
            if inner:
                errors += inner
                continue
        if isinstance(value, Mapping) and not nested:
            # msgspec says `$.env[...]` for a bad value of a mapping: try each entry alone,
            # so the error names its key.
            entries = [_entry_errors(key_, item, field.type, where)
                       for key_, item in value.items()]
            if any(entries):
                errors += [e for entry in entries for e in entry]
                continue
        try:
            msgspec.convert(value, field.type)
        except msgspec.ValidationError as exc:
            message = str(exc)
            pattern = "matching regex" in message
            message = _in_words(message)
            if isinstance(field.type, type) and issubclass(field.type, enum.Enum):
                message += f" (one of {', '.join(str(m.value) for m in field.type)})"
            elif isinstance(value, str) and message.startswith("Expected `array`, got `str`"):
                words = ", ".join(value.split())
                message += f" (a YAML list: did you mean [{words}]?)"
            elif isinstance(value, str) and pattern:
                message += f" (got {value!r})"
            errors.append(message.replace("`$", f"`{where}") if "`$" in message
                          else f"{message}{_at(where)}")
    errors += [f"Object missing required field `{name}`{_at(path)}"
               for name, field in known.items() if field.required and name not in data]
    return errors


def _entry_errors(key: object, item: object, mapping_type: object,
                         where: str) -> list[str]:
    """The error of one entry ``key: item`` of the mapping field at ``where`` (as
    ``mapping_type``), naming its key; empty when it is valid."""
    try:
        msgspec.convert({key: item}, mapping_type)
    except msgspec.ValidationError as exc:
        message = _in_words(str(exc))
        if message.endswith("- at `key` in `$`"):
            return [message.replace("`key` in `$`", f"key `{key}` in `{where}`")]
        return [message.replace("`$[...]`", f"`{where}.{key}`")]
    return []


#: What the spec's string patterns allow, in words (msgspec quotes the regex).
PATTERN_WORDS = {
    r"^[A-Za-z0-9_\-]+\Z": "letters, digits, '_' and '-' only",
    r"^[A-Za-z_][A-Za-z0-9_]*\Z": "an environment variable's name (letters, digits and "
                                  "'_', not starting with a digit)",
    r"^[^\x00]*\Z": "no NUL character",
}


def _in_words(message: str) -> str:
    """msgspec's ``matching regex '...'`` as what the pattern allows."""
    for pattern, words in PATTERN_WORDS.items():
        message = message.replace(f"`str` matching regex {pattern!r}", f"`str` of {words}")
    return message


def _at(path: str) -> str:
    return "" if path == "$" else f" - at `{path}`"


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a YAML job spec file.

    Raises:
        SpecError: unreadable file, bad YAML, or an invalid field (named).
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from None
    return parse_job_spec(data, str(path))


def new_job_id(name: str) -> str:
    """``<name>-<6 hex>``: readable, and unique enough to retry submits safely."""
    return f"{name[:100]}-{secrets.token_hex(3)}"


class AdmissionClient:
    """Talks to the admission service (any instance) and reads job records from KV."""

    def __init__(self, bus: Bus, *, timeout_s: float = 10.0) -> None:
        self.bus = bus
        self.timeout_s = timeout_s

    async def _request(self, verb: str, message: Message, reply_type: type[M],
                       retry_s: float) -> M:
        """Request ``verb``, retrying while no leader answers (503/504/no responders)."""
        deadline = time.monotonic() + retry_s
        delay = 0.05
        while True:
            try:
                return await self.bus.request(subjects.admission(verb), message,
                                              reply_type, timeout_s=self.timeout_s)
            except (NoResponders, RequestTimeout, RemoteError) as exc:
                retryable = not isinstance(exc, RemoteError) or exc.code in RETRYABLE_CODES
                if not retryable or time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)  # back-off between retries, not synchronisation
            delay = min(delay * 2, 1.0)

    async def submit(self, spec: JobSpec, job_id: str | None = None, *,
                     retry_s: float = 30.0) -> JobRecord:
        """Submit ``spec``; returns the stored record (state pending).

        Raises:
            RemoteError: refused (400 invalid, 409 id taken), with the reason.
        """
        request = SubmitRequest(job_id=job_id or new_job_id(spec.name), spec=spec)
        return await self._request("submit", request, JobRecord, retry_s)

    async def cancel(self, job_id: str, *, retry_s: float = 30.0) -> JobRecord:
        return await self._request("cancel", JobRequest(job_id=job_id), JobRecord, retry_s)

    async def explain(self, job_id: str, *, retry_s: float = 10.0) -> Explanation:
        return await self._request("explain", JobRequest(job_id=job_id), Explanation, retry_s)

    async def scale(self, job_id: str, replicas: int | None, *,
                    retry_s: float = 30.0) -> JobRecord:
        """Pin an elastic job to ``replicas`` (one of its allowed sizes), or release the
        pin (None); returns its record with the pin. Growth to the pin waits for free
        slots; a shrink is graceful (the leavers finish their step).

        Raises:
            RemoteError: refused (400 not an allowed size or a rigid job, 404 no such
                job, 409 it has ended), with the reason.
        """
        return await self._request("scale", ScaleRequest(job_id=job_id, replicas=replicas),
                                   JobRecord, retry_s)

    async def _jobs_kv(self) -> TypedKV[JobRecord]:
        return await TypedKV.open(self.bus.js, subjects.JOBS_BUCKET, JobRecord)

    async def job(self, job_id: str) -> JobRecord | None:
        entry = await (await self._jobs_kv()).get(job_id)
        return entry.value if entry else None

    async def generation(self, job_id: str) -> Generation | None:
        """The running job's current generation (its members, world size, resume step);
        None when it has none (not running under the runtime, or ended)."""
        kv = await TypedKV.open(self.bus.js, subjects.GENERATIONS_BUCKET, Generation)
        current, _ = await kv.current(job_id)
        return current

    async def progress(self, job_id: str) -> JobProgress | None:
        """How far the job has trained (step, rate, restarts), as health last stored it;
        None before its ranks reported anything."""
        return await _value(self.bus, subjects.PROGRESS_BUCKET, JobProgress, job_id)

    async def history(self, job_id: str) -> JobHistory | None:
        """The job's generations and their pauses, as elasticity last stored them; None
        for a job that never ran under the runtime."""
        return await _value(self.bus, subjects.HISTORY_BUCKET, JobHistory, job_id)

    async def all_progress(self) -> dict[str, JobProgress]:
        """Every stored job progress, by job id."""
        kv = await TypedKV.open(self.bus.js, subjects.PROGRESS_BUCKET, JobProgress)
        entries, _ = await kv.entries()
        return {e.key: e.value for e in entries}

    async def generations(self) -> dict[str, Generation]:
        """Every running job's current generation, by job id."""
        kv = await TypedKV.open(self.bus.js, subjects.GENERATIONS_BUCKET, Generation)
        entries, _ = await kv.entries()
        return {e.key: e.value for e in entries}

    async def jobs(self) -> list[JobRecord]:
        """Every job record, oldest submission first."""
        entries, _ = await (await self._jobs_kv()).entries()
        return sorted((e.value for e in entries), key=lambda r: (r.submitted_at, r.job_id))


async def _value(bus: Bus, bucket: str, message_type: type[M], key: str) -> M | None:
    entry = await (await TypedKV.open(bus.js, bucket, message_type)).get(key)
    return None if entry is None else entry.value

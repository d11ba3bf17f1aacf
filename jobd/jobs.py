"""Jobs as the Python side sees them: a job to enqueue (:class:`JobSpec`), a claimed job as
its handler gets it (:class:`Job`) and the proof of a claim (:class:`Lease`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from jobd import validation


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to enqueue; the arguments of :func:`enqueue` as a value.

    ``payload`` is any JSON value and reaches the handler exactly as given (``None`` is a
    JSON null); leaving it out gives ``{}``. ``priority`` None is the default, 0, as SQL's
    ``jobd.enqueue(..., priority => NULL)`` takes it.
    """

    handler: str
    payload: Any = field(default_factory=dict)
    lane: str = "default"
    run_at: datetime | None = None
    priority: int | None = 0  # None is taken as 0 (__post_init__)
    idempotency_key: str | None = None
    max_attempts: int | None = None
    fairness_key: str | None = None

    def __post_init__(self) -> None:
        if self.priority is None:
            object.__setattr__(self, "priority", 0)

    def validated(self) -> JobSpec:
        """This spec, or ValueError naming the first rule it breaks (jobd.validation)."""
        self.encoded_payload()
        return self

    def encoded_payload(self) -> str:
        """Check every rule; return the payload as the JSON text to store."""
        validation.handler(self.handler)
        validation.name("lane", self.lane)
        if self.run_at is not None:
            validation.run_at(self.run_at)
        # bool is an int to isinstance; True is not a priority.
        if (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                or not -(2**31) <= self.priority < 2**31):
            raise ValueError(f"priority must be a 32-bit integer, not {self.priority!r}")
        if self.max_attempts is not None and (
            not isinstance(self.max_attempts, int) or isinstance(self.max_attempts, bool)
            or not 1 <= self.max_attempts < 2**31
        ):
            raise ValueError(f"max_attempts must be a positive integer, not {self.max_attempts!r}")
        if self.idempotency_key is not None:
            validation.idempotency_key(self.idempotency_key)
        if self.fairness_key is not None:
            validation.fairness_key(self.fairness_key)
        return validation.encode_payload(self.payload)


class Lease(NamedTuple):
    """Proof that a worker holds a claimed job: its id and the token of that claim."""

    id: int
    token: int


_UNDECODED = object()

# The columns of a claimed job, in the order the claim query returns them.
_JOB_FIELDS = ("id", "lease_token", "lane", "handler", "payload_json", "priority", "run_at",
               "attempt", "max_attempts", "idempotency_key", "created_at", "lease_until",
               "fairness_key")


class Job:
    """A claimed job, as a handler sees it. Read-only. Its times are aware datetimes, in UTC
    on a worker's direct connection (``db.worker_session``).

    A job wraps the claim's result row as it came from the database (``from_row``); its fields
    are views of that row. A worker claims tens of thousands of jobs a second, and copying each
    row field by field into a frozen dataclass cost it more CPU than the claim's parsing did.
    """

    __slots__ = ("_cancelled", "_payload", "_row")

    id: int
    lease_token: int
    lane: str
    handler: str
    payload_json: str  # the payload as the database sent it; see ``payload``
    priority: int
    run_at: datetime
    attempt: int
    max_attempts: int | None
    idempotency_key: str | None
    created_at: datetime
    lease_until: datetime
    fairness_key: str | None  # set at enqueue; the fair share's key is this, else the handler

    def __init__(self, id: int, lease_token: int, lane: str, handler: str,
                 payload_json: str, priority: int, run_at: datetime, attempt: int,
                 max_attempts: int | None, idempotency_key: str | None,
                 created_at: datetime, lease_until: datetime,
                 fairness_key: str | None = None) -> None:
        self._row = (id, lease_token, lane, handler, payload_json, priority, run_at, attempt,
                     max_attempts, idempotency_key, created_at, lease_until, fairness_key)
        self._payload = _UNDECODED
        self._cancelled = False

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        """A job from a row in the claim query's column order (``_JOB_FIELDS``)."""
        job = cls.__new__(cls)
        job._row = row
        job._payload = _UNDECODED
        job._cancelled = False
        return job

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its row: a copy decodes its payload itself when asked.
        return (Job.from_row, (self._row,))

    @property
    def payload(self) -> Any:
        """The decoded payload. Decoded on first use, in the handler's thread, so the worker
        loop that claims batches does not spend its time parsing JSON."""
        payload = self._payload
        if payload is _UNDECODED:
            try:
                payload = self._payload = decode_stored_payload(self._row[4])
            except UndecodablePayload as exc:
                self._payload = exc  # remembered: the worker dead-letters such a job
                raise
        if isinstance(payload, UndecodablePayload):
            raise payload
        return payload

    @property
    def undecodable(self) -> bool:
        """Whether reading ``payload`` failed: retrying cannot help such a job (whatever
        exception its handler turned the failure into)."""
        return isinstance(self._payload, UndecodablePayload)

    @property
    def cancelled(self) -> bool:
        """Whether the job was asked to stop (``jobd jobs cancel``, ``jobd.cancel``). A sync
        handler that runs long can poll it and return early; an async handler is cancelled
        (it gets ``asyncio.CancelledError``). Either way the job is recorded as cancelled
        when the run ends, whatever the handler returns. The worker learns of the request
        at once when it hears the cancel's notification, else at its next lease renewal
        (the lane's ``heartbeat``)."""
        return self._cancelled

    def request_cancel(self) -> None:
        """Set :attr:`cancelled` (the worker does, when the job was asked to stop)."""
        self._cancelled = True

    @property
    def lease(self) -> Lease:
        return Lease(self._row[0], self._row[1])

    @property
    def effect_key(self) -> str:
        """A stable key for this job's effect: its idempotency key, else one from its id.

        Pass it to external APIs that accept idempotency keys; transactional handlers record
        it in the dedup store.
        """
        key = self._row[9]
        return key if key is not None else f"{validation.RESERVED_KEY_PREFIX}job:{self._row[0]}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Job) and self._row == other._row

    def __hash__(self) -> int:
        return hash(self._row)

    def __repr__(self) -> str:
        fields = zip(_JOB_FIELDS, self._row, strict=True)
        return "Job(" + ", ".join(f"{name}={value!r}" for name, value in fields) + ")"


def _row_field(index: int) -> property:
    return property(lambda job: job._row[index])


for _index, _name in enumerate(_JOB_FIELDS):
    # Annotated in the class for readers and type checkers; a read-only property reads the row.
    setattr(Job, _name, _row_field(_index))
del _index, _name


def payload_chars(claimed: list[Job]) -> int:
    """The characters of payload text the jobs ``claimed`` hold, all told (the claim's
    memory: jobd.prefetch bounds the buffer by it). Read off the rows, once per claim."""
    return sum([len(job._row[4]) for job in claimed])


class UndecodablePayload(ValueError):
    """A stored payload the worker cannot decode (written past jobd's entry rules)."""


def decode_stored_payload(text: str) -> Any:
    """A claimed job's payload from its JSON text, or UndecodablePayload."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UndecodablePayload(
            f"the payload cannot be decoded ({type(exc).__name__}: {exc})") from None


_PRIORITY = _JOB_FIELDS.index("priority")


def in_priority_order(claimed: list[Job]) -> list[Job]:
    """A claim's jobs highest priority first. Its UPDATE returns the rows in the order it
    finds them by id, so a claim that spans priorities would start a job enqueued before the
    higher ones first: the worker starts its buffer in order. Sorted only then (otherwise
    one pass over the rows): within a priority, id order is the claim's but for jobs due in
    the past (retries, scheduled ones), which one claim's worth of work bounds. A fair or
    age-promoting lane's claim is put in order by :func:`in_ordered_claim_order`."""
    first = claimed[0]._row[_PRIORITY]
    if all([job._row[_PRIORITY] == first for job in claimed]):
        return claimed
    return sorted(claimed, key=lambda job: -job.priority)  # stable: id order within one


# Sorts after every overdue job's key: (0, 0, run_at, id) < (1, -priority, _ANY, 0).
_ANY = datetime.min


def in_ordered_claim_order(claimed: list[Job], max_wait: float | None,
                           visibility_timeout: float) -> list[Job]:
    """A rate-limited fair or age-promoting lane's claim (claim_jobs_limited picks with
    claim_order()) in the order its jobs are to start: the overdue ones (due for
    ``max_wait`` or longer at the claim) oldest first, as claim_order took them ahead of
    every priority, then the others highest priority first. The UPDATE returns the rows in
    the order it finds them by id, and the worker starts its buffer in that order: an
    overdue job enqueued after younger high-priority ones started behind them, and a
    priority-0 job enqueued first started ahead of priority-5 ones. Within a priority the
    rows keep their order. (claim_jobs_ordered returns its rows in claim order.)"""
    overdue_before = None
    if max_wait is not None:
        # Every job of one claim has the same lease, set from the claim's clock.
        claimed_at = claimed[0].lease_until - timedelta(seconds=visibility_timeout)
        overdue_before = claimed_at - timedelta(seconds=max_wait)
    first = claimed[0]._row[_PRIORITY]
    if overdue_before is None and all([job._row[_PRIORITY] == first for job in claimed]):
        return claimed

    def start_key(job: Job) -> tuple[int, int, datetime, int]:
        if overdue_before is not None and job.run_at <= overdue_before:
            return (0, 0, job.run_at, job.id)
        return (1, -job.priority, _ANY, 0)  # stable: the rows' order within a priority

    return sorted(claimed, key=start_key)


def in_claim_order(claimed: list[Job]) -> list[Job]:
    """A plain claim's jobs in the order it picked them: highest priority first, then
    oldest ``run_at``, then id."""
    return sorted(claimed, key=lambda job: (-job.priority, job.run_at, job.id))

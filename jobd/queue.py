"""The queue operations: plain functions over a psycopg 3 connection.

The supervisor, the workers and the CLI call these; none of them holds state. Functions that
finish jobs take leases, the (id, lease_token) pairs handed out by :func:`claim`; a write whose
lease is no longer current changes nothing and is reported back as ``lease_lost``.

Time: every comparison happens in the database with ``now()``. Tests may pass ``now`` to move
the clock without sleeping; production code passes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

from jobd import fastpath, validation
from jobd.backoff import RetryPolicy
from jobd.db import DEFAULT_SCHEMA
from jobd.queries import qualified, query


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job to enqueue; the arguments of :func:`enqueue` as a value.

    ``payload`` is any JSON value and reaches the handler exactly as given (``None`` is a
    JSON null); leaving it out gives ``{}``.
    """

    handler: str
    payload: Any = field(default_factory=dict)
    lane: str = "default"
    run_at: datetime | None = None
    priority: int = 0
    idempotency_key: str | None = None
    max_attempts: int | None = None

    def validated(self) -> JobSpec:
        """This spec, or ValueError naming the first rule it breaks (jobd.validation)."""
        self.encoded_payload()
        return self

    def encoded_payload(self) -> str:
        """Check every rule; return the payload as the JSON text to store."""
        validation.name("handler", self.handler)
        validation.name("lane", self.lane)
        if self.run_at is not None:
            validation.run_at(self.run_at)
        if not isinstance(self.priority, int) or not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer, not {self.priority!r}")
        if self.max_attempts is not None and (
            not isinstance(self.max_attempts, int) or not 1 <= self.max_attempts < 2**31
        ):
            raise ValueError(f"max_attempts must be a positive integer, not {self.max_attempts!r}")
        if self.idempotency_key is not None:
            validation.idempotency_key(self.idempotency_key)
        return validation.encode_payload(self.payload)


def _stored_json(text: str) -> Jsonb:
    """Already-encoded JSON text as a jsonb parameter (it is not encoded a second time)."""
    return Jsonb(text, dumps=str)


class Lease(NamedTuple):
    """Proof that a worker holds a claimed job: its id and the token of that claim."""

    id: int
    token: int


_UNDECODED = object()

# The columns of a claimed job, in the order the claim query returns them.
_JOB_FIELDS = ("id", "lease_token", "lane", "handler", "payload_json", "priority", "run_at",
               "attempt", "max_attempts", "idempotency_key", "created_at", "lease_until")


class Job:
    """A claimed job, as a handler sees it. Read-only.

    A job wraps the claim's result row as it came from the database (``from_row``); its fields
    are views of that row. A worker claims tens of thousands of jobs a second, and copying each
    row field by field into a frozen dataclass cost it more CPU than the claim's parsing did.
    """

    __slots__ = ("_payload", "_row")

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

    def __init__(self, id: int, lease_token: int, lane: str, handler: str,
                 payload_json: str, priority: int, run_at: datetime, attempt: int,
                 max_attempts: int | None, idempotency_key: str | None,
                 created_at: datetime, lease_until: datetime) -> None:
        self._row = (id, lease_token, lane, handler, payload_json, priority, run_at, attempt,
                     max_attempts, idempotency_key, created_at, lease_until)
        self._payload = _UNDECODED

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Job:
        """A job from a row in the claim query's column order (``_JOB_FIELDS``)."""
        job = cls.__new__(cls)
        job._row = row
        job._payload = _UNDECODED
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


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed attempt to record: whose, why, and when to retry."""

    lease: Lease
    error: str
    retry_delay: float
    default_max_attempts: int
    final: bool = False  # dead at once: retrying cannot help


@dataclass(slots=True)
class FailOutcome:
    retried: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    lease_lost: list[int] = field(default_factory=list)
    # When each retried job becomes due again (database clock), so callers can wake for it.
    retry_at: dict[int, datetime] = field(default_factory=dict)
    # Filled by the sweeps that know the jobs' lanes: the earliest retry per lane.
    next_retry_by_lane: dict[str, datetime] = field(default_factory=dict)


@dataclass(slots=True)
class WriteOutcome:
    """Result of a fenced batch write: the jobs it applied to, and those whose lease was
    lost (expired and swept, or claimed again) that it skipped."""

    applied: list[int]
    lease_lost: list[int]


def _fenced_outcome(leases: Sequence[Lease], applied_ids: Iterable[int]) -> WriteOutcome:
    applied = set(applied_ids)
    return WriteOutcome(
        applied=[lease.id for lease in leases if lease.id in applied],
        lease_lost=[lease.id for lease in leases if lease.id not in applied],
    )


def _bigint_array(values: Iterable[int]) -> str:
    """A ``bigint[]`` parameter as its text literal, for ids and tokens (integers from the
    database). psycopg's generic list adapter inspects every element; for the id and token
    arrays of a 100-job batch that cost more client CPU than the rest of the round trip."""
    return "{" + ",".join(map("%d".__mod__, values)) + "}"


def _bool_array(values: Iterable[bool]) -> str:
    """A ``bool[]`` parameter as its text literal (see _bigint_array)."""
    return "{" + ",".join("t" if value else "f" for value in values) + "}"


def _lease_arrays(leases: Sequence[Lease]) -> dict[str, str]:
    return {"ids": _bigint_array(lease.id for lease in leases),
            "tokens": _bigint_array(lease.token for lease in leases)}


# --- enqueue -------------------------------------------------------------------------------


_NO_PAYLOAD: Any = object()


def enqueue(
    conn: psycopg.Connection,
    handler: str,
    payload: Any = _NO_PAYLOAD,
    *,
    lane: str = "default",
    run_at: datetime | None = None,
    delay: float | None = None,
    priority: int = 0,
    idempotency_key: str | None = None,
    max_attempts: int | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Enqueue one job with a single INSERT and return its id.

    The job is due at ``run_at``, or ``delay`` seconds from now by the database clock, or now.
    It is durable when the caller's transaction commits (at once on an autocommit
    connection). With an ``idempotency_key`` already used, the first job's id is returned and
    nothing is inserted.

    ``payload`` is any JSON value (``None`` is a JSON null); left out, it is ``{}``. A job
    that breaks one of jobd's rules (jobd.validation) raises ValueError before anything is
    sent; the payload size limit is the database's, and a larger payload is refused by the
    server (psycopg.errors.InvalidParameterValue).
    """
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    if delay is not None and not 0 <= delay < 10**9:
        raise ValueError(f"delay must be a non-negative number of seconds, not {delay!r}")
    spec = JobSpec(
        handler, {} if payload is _NO_PAYLOAD else payload, lane, run_at, priority,
        idempotency_key, max_attempts,
    )
    encoded = spec.encoded_payload()
    row = conn.execute(
        qualified("enqueue_qualified", schema),
        {
            "handler": spec.handler,
            "payload": _stored_json(encoded),
            "lane": spec.lane,
            "run_at": spec.run_at,
            "delay": float(delay or 0),
            "priority": spec.priority,
            "idempotency_key": spec.idempotency_key,
            "max_attempts": spec.max_attempts,
        },
    ).fetchone()
    assert row is not None
    return int(row[0])


_COPY_TYPES = ["int8", "text", "text", "jsonb", "int4", "timestamptz", "text", "int4"]


def enqueue_many(
    conn: psycopg.Connection, specs: Sequence[JobSpec], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Enqueue many jobs in one transaction (a savepoint inside the caller's); ids in order.

    Ids are reserved in one round trip and the rows go in with one binary COPY, so a batch of
    thousands costs a few round trips. Jobs with an idempotency key go through the key ledger
    first; a key already taken (or repeated within the batch) yields the existing job's id.
    """
    encoded = [spec.encoded_payload() for spec in specs]
    if not specs:
        return []
    largest = max(len(text.encode("utf-8", "surrogatepass")) for text in encoded)
    ids: list[int | None] = [None] * len(specs)
    to_insert: list[tuple[int, int]] = []  # (job id, position in specs)
    with conn.transaction():
        keyed = [i for i, spec in enumerate(specs) if spec.idempotency_key is not None]
        unkeyed = [i for i, spec in enumerate(specs) if spec.idempotency_key is None]
        # COPY cannot evaluate now(), so the database clock is read here: within a
        # transaction now() is fixed, the same value the column default would give.
        row = conn.execute(
            qualified("reserve_ids_qualified", schema),
            {"count": len(unkeyed), "largest_payload": largest},
        ).fetchone()
        assert row is not None
        db_now, fresh, _checked = row
        for position, job_id in zip(unkeyed, fresh, strict=True):
            ids[position] = job_id
            to_insert.append((job_id, position))
        if keyed:
            _resolve_keys(conn, schema, specs, keyed, ids, to_insert)
        with conn.cursor().copy(qualified("copy_jobs_qualified", schema)) as copy:
            copy.set_types(_COPY_TYPES)
            for job_id, position in to_insert:
                spec = specs[position]
                copy.write_row((
                    job_id, spec.lane, spec.handler, _stored_json(encoded[position]),
                    spec.priority, spec.run_at or db_now, spec.idempotency_key,
                    spec.max_attempts,
                ))
    return [int(job_id) for job_id in ids if job_id is not None]


def _resolve_keys(
    conn: psycopg.Connection,
    schema: str,
    specs: Sequence[JobSpec],
    keyed: Sequence[int],
    ids: list[int | None],
    to_insert: list[tuple[int, int]],
) -> None:
    keys = list(dict.fromkeys(specs[i].idempotency_key for i in keyed))
    reserved = dict(
        conn.execute(qualified("reserve_keys_qualified", schema), {"keys": keys})
    )
    # A separate statement takes a fresh snapshot and sees keys that concurrent transactions
    # committed while the INSERT ... ON CONFLICT waited for them.
    taken = [key for key in keys if key not in reserved]
    existing = (
        dict(conn.execute(qualified("lookup_keys_qualified", schema), {"keys": taken}))
        if taken
        else {}
    )
    for position in keyed:
        key = specs[position].idempotency_key
        if key in reserved:
            ids[position] = reserved.pop(key)
            existing[key] = ids[position]
            to_insert.append((ids[position], position))
        else:
            ids[position] = existing[key]


# --- claim and the fenced writes -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """What :func:`claim` takes, as a value (for :func:`settle_and_claim`)."""

    lane: str
    worker: str
    limit: int
    visibility_timeout: float
    # The worker holds nothing: try the lane's oldest due suspect first (claim_suspect);
    # with one claimed, the claim of other jobs in the same transaction takes none.
    suspect_first: bool = False


@dataclass(frozen=True, slots=True)
class Claimed:
    """What one claim took: jobs to run side by side, or a suspect to run alone."""

    jobs: list[Job]
    suspect: Job | None = None


def _claim_params(request: ClaimRequest, now: datetime | None) -> dict[str, Any]:
    return {"lane": request.lane, "worker": request.worker, "limit": request.limit,
            "visibility_timeout": float(request.visibility_timeout), "now": now}


def _jobs(rows: Iterable[tuple[Any, ...]]) -> list[Job]:
    return [Job.from_row(row) for row in rows]


def claim(
    conn: psycopg.Connection,
    lane: str,
    worker: str,
    limit: int,
    visibility_timeout: float,
    now: datetime | None = None,
) -> list[Job]:
    """Claim up to ``limit`` due jobs of ``lane`` for ``worker`` in one statement."""
    params = _claim_params(ClaimRequest(lane, worker, limit, visibility_timeout), now)
    with conn.cursor(binary=True) as cursor:  # binary: see _BINARY_RESULTS
        return _jobs(cursor.execute(query("claim_jobs"), params).fetchall())


# Claimed rows come back in binary: their three timestamps are cheaper to send and to parse as
# 8-byte integers than as text, on both sides of the connection.
_BINARY_RESULTS = frozenset({"claim_jobs", "claim_suspect"})


def heartbeat(
    conn: psycopg.Connection,
    leases: Sequence[Lease],
    visibility_timeout: float,
    now: datetime | None = None,
) -> WriteOutcome:
    """Extend all ``leases`` in one statement; ``stale`` lists the ones already lost."""
    if not leases:
        return WriteOutcome([], [])
    rows = conn.execute(
        query("heartbeat"),
        {**_lease_arrays(leases), "visibility_timeout": float(visibility_timeout), "now": now},
    ).fetchall()
    return _fenced_outcome(leases, (row[0] for row in rows))


def complete(
    conn: psycopg.Connection, leases: Sequence[Lease], now: datetime | None = None,
    *, schema: str | None = None,
) -> WriteOutcome:
    """Mark a batch done: the rows move to the archive in one statement. With ``schema``,
    the statement names jobd's tables itself (a connection with the user's search_path)."""
    if not leases:
        return WriteOutcome([], [])
    statement = query("complete_jobs") if schema is None else qualified("complete_jobs", schema)
    rows = conn.execute(statement, {**_lease_arrays(leases), "now": now}).fetchall()
    return _fenced_outcome(leases, (row[0] for row in rows))


def _fail_params(failures: Sequence[Failure], now: datetime | None,
                 expired_only: bool) -> dict[str, Any]:
    return {
        **_lease_arrays([f.lease for f in failures]),
        "errors": [f.error for f in failures],
        "delays": [float(f.retry_delay) for f in failures],
        "default_max_attempts": [f.default_max_attempts for f in failures],
        "final": _bool_array(f.final for f in failures),
        "expired_only": expired_only,
        "now": now,
    }


def _fail_outcome(failures: Sequence[Failure], rows: Iterable[tuple[Any, ...]]) -> FailOutcome:
    outcome = FailOutcome()
    results = {}
    for job_id, kind, run_at in rows:
        results[job_id] = kind
        if run_at is not None:
            outcome.retry_at[job_id] = run_at
    for f in failures:
        kind = results.get(f.lease.id)
        if kind == "failed":
            outcome.retried.append(f.lease.id)
        elif kind == "dead":
            outcome.dead.append(f.lease.id)
        else:
            outcome.lease_lost.append(f.lease.id)
    return outcome


def fail(
    conn: psycopg.Connection,
    failures: Sequence[Failure],
    now: datetime | None = None,
    *,
    expired_only: bool = False,
) -> FailOutcome:
    """Record failed attempts: retry later, or move to the dead-letter queue when spent."""
    if not failures:
        return FailOutcome()
    rows = conn.execute(query("fail_jobs"), _fail_params(failures, now, expired_only)).fetchall()
    return _fail_outcome(failures, rows)


def settle_and_claim(
    conn: psycopg.Connection,
    completions: Sequence[Lease],
    failures: Sequence[Failure],
    request: ClaimRequest | None,
    now: datetime | None = None,
) -> tuple[WriteOutcome, FailOutcome, Claimed]:
    """:func:`complete`, :func:`fail` and :func:`claim` in one network round trip.

    This is the worker's hot path: the results of finished jobs go out with the request for
    more work (``jobd.fastpath``). The outcomes are written in their own explicit transaction
    and the claim runs in the next one, so a claim that fails cannot undo the outcomes, and an
    outcome that fails skips the claim. On an error the connection is left idle and the error
    raised; the leases decide what a retry still applies. Needs an autocommit connection.
    """
    steps: list[fastpath.Step] = []
    if completions or failures:
        steps.append((fastpath.BEGIN, None))
        if completions:
            steps.append(("complete_jobs", {**_lease_arrays(completions), "now": now}))
        if failures:
            steps.append(("fail_jobs", _fail_params(failures, now, False)))
        steps.append((fastpath.COMMIT, None))
    if request is not None:
        if request.suspect_first:
            steps.append(("claim_suspect", _claim_params(request, now)))
        steps.append(("claim_jobs", _claim_params(request, now)))
    if not steps:
        return WriteOutcome([], []), FailOutcome(), Claimed([])
    results = iter(fastpath.run(conn, steps, binary=_BINARY_RESULTS))
    if completions or failures:
        next(results)  # BEGIN
    completed = (_fenced_outcome(completions, (row[0] for row in next(results)))
                 if completions else WriteOutcome([], []))
    failed = _fail_outcome(failures, next(results)) if failures else FailOutcome()
    if completions or failures:
        next(results)  # COMMIT
    if request is None:
        return completed, failed, Claimed([])
    suspects = _jobs(next(results)) if request.suspect_first else []
    return completed, failed, Claimed(_jobs(next(results)), suspects[0] if suspects else None)


def release(
    conn: psycopg.Connection, leases: Sequence[Lease], now: datetime | None = None
) -> WriteOutcome:
    """Give claimed jobs back unharmed (their attempt is not counted): claimable at once."""
    if not leases:
        return WriteOutcome([], [])
    rows = conn.execute(query("release_jobs"), _lease_arrays(leases)).fetchall()
    return _fenced_outcome(leases, (row[0] for row in rows))


PolicyLookup = Callable[[str], RetryPolicy]


def _fail_rows(
    conn: psycopg.Connection,
    rows: Sequence[tuple[int, int, str, int, str]],
    reason: Callable[[str], str],
    policy_for: PolicyLookup,
    now: datetime | None,
    expired_only: bool,
) -> FailOutcome:
    failures = []
    lanes = {row[0]: row[2] for row in rows}
    for job_id, token, lane, attempts, claimed_by in rows:
        policy = policy_for(lane)
        failures.append(
            Failure(
                lease=Lease(job_id, token),
                error=reason(claimed_by),
                retry_delay=policy.backoff.delay(attempts),
                default_max_attempts=policy.max_attempts,
            )
        )
    outcome = fail(conn, failures, now, expired_only=expired_only)
    for job_id, run_at in outcome.retry_at.items():
        lane = lanes[job_id]
        current = outcome.next_retry_by_lane.get(lane)
        if current is None or run_at < current:
            outcome.next_retry_by_lane[lane] = run_at
    return outcome


def expire_leases(
    conn: psycopg.Connection,
    policy_for: PolicyLookup,
    now: datetime | None = None,
    limit: int = 1000,
) -> FailOutcome:
    """The lease-expiry sweep: a job whose lease ran out counts as a failed attempt.

    It becomes claimable again after its backoff, or dead when its budget is spent. A worker
    that renews its lease between the scan and the write keeps its job.
    """
    rows = conn.execute(query("expired_leases"), {"now": now, "limit": limit}).fetchall()
    outcome = _fail_rows(
        conn, rows, lambda worker: f"lease expired (held by {worker})", policy_for, now, True
    )
    swept = set(outcome.retried) | set(outcome.dead)
    stale = [Lease(row[0], row[1]) for row in rows if row[0] in swept]
    if stale:
        # The holder of an expired lease is stale by definition. If it is a transactional
        # handler frozen with its transaction open, it still holds the locks the job's next
        # run needs (its effect key, its writes): end that transaction now.
        conn.execute(query("terminate_stale_handlers"),
                     {"names": [handler_application_name(lease) for lease in stale]})
    return outcome


def handler_application_name(lease: Lease) -> str:
    """What a transactional handler's backend is called while it runs the leased job."""
    return f"jobd job {lease.id}:{lease.token}"


@dataclass(slots=True)
class CrashOutcome:
    """What crash attribution did with a dead worker's jobs."""

    failed: FailOutcome  # the job that killed its worker alone: an attempt spent
    suspects: list[int]  # several jobs held: each gets its attempt back and runs alone


def settle_crashed_worker(
    conn: psycopg.Connection,
    worker: str,
    error: str,
    policy_for: PolicyLookup,
    now: datetime | None = None,
) -> CrashOutcome:
    """Crash attribution for a worker process that died, in one transaction.

    Alone, the job it held killed it: that job spends an attempt (retried after its backoff,
    dead when its budget is spent) and stays a suspect, so its retries run alone. Holding
    several, nothing says which one killed it: all of them get their attempt back and
    become suspects, each run alone by an idle worker (claim_suspect) until the one that
    kills its worker is found. So only the poison spends its budget, never its neighbours.
    """
    with conn.transaction():
        rows = conn.execute(query("jobs_held_by"), {"worker": worker}).fetchall()
        if len(rows) > 1:
            leases = [Lease(row[0], row[1]) for row in rows]
            released = conn.execute(query("release_as_suspects"),
                                    _lease_arrays(leases)).fetchall()
            return CrashOutcome(FailOutcome(), sorted(row[0] for row in released))
        failed = _fail_rows(conn, rows, lambda _worker: error, policy_for, now, False)
        if failed.retried:
            conn.execute(query("mark_suspect"), {"ids": _bigint_array(failed.retried)})
        return CrashOutcome(failed, [])


def fail_claims_not_held(conn: psycopg.Connection, worker: str, held: Iterable[Lease],
                         error: str, policy_for: PolicyLookup,
                         now: datetime | None = None) -> FailOutcome:
    """Fail the jobs claimed under ``worker``'s name except the ``held`` leases: claims whose
    rows never reached the worker (its connection broke while the claim ran, or the rows
    could not be loaded). They are retried after their backoff, or dead when their budget is
    spent: the attempt was counted at claim, and a claim that fails the same way every time
    must end in the dead-letter queue rather than loop."""
    held_leases = set(held)
    rows = conn.execute(query("jobs_held_by"), {"worker": worker}).fetchall()
    orphans = [row for row in rows if Lease(row[0], row[1]) not in held_leases]
    if not orphans:
        return FailOutcome()
    return _fail_rows(conn, orphans, lambda _worker: error, policy_for, now, False)


class UndecodablePayload(ValueError):
    """A stored payload the worker cannot decode (written past jobd's entry rules)."""


def decode_stored_payload(text: str) -> Any:
    """A claimed job's payload from its JSON text, or UndecodablePayload."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise UndecodablePayload(
            f"the payload cannot be decoded ({type(exc).__name__}: {exc})") from None

"""Claiming jobs and the fenced writes that finish them: plain functions over a psycopg 3
connection. (Enqueueing is :mod:`jobd.producer`; recovering the jobs of dead or frozen
holders :mod:`jobd.recovery`; the job types :mod:`jobd.jobs`.)

The supervisor, the workers and the CLI call these; none of them holds state. Functions that
finish jobs take leases, the (id, lease_token) pairs handed out by :func:`claim`; a write whose
lease is no longer current changes nothing and is reported back as ``lease_lost``.

Time: every comparison happens in the database with ``now()``. Tests may pass ``now`` to move
the clock without sleeping; production code passes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from jobd import claim_floors, fastpath
from jobd.jobs import Job, Lease, in_claim_order, in_ordered_claim_order, in_priority_order
from jobd.queries import qualified, query


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
    # Asked to stop (jobd.cancel) before they failed: archived as cancelled, not retried.
    cancelled: list[int] = field(default_factory=list)
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
    # Among the applied ones, the jobs that were asked to stop (jobd.cancel): a completion
    # archived them as cancelled; a heartbeat tells their worker to stop them.
    cancelled: list[int] = field(default_factory=list)


def _fenced_outcome(leases: Sequence[Lease], applied_ids: Iterable[int]) -> WriteOutcome:
    applied = set(applied_ids)
    return WriteOutcome(
        applied=[lease.id for lease in leases if lease.id in applied],
        lease_lost=[lease.id for lease in leases if lease.id not in applied],
    )


def _flagged_outcome(leases: Sequence[Lease], rows: Iterable[tuple[Any, ...]],
                     is_cancelled: Any) -> WriteOutcome:
    """A fenced write whose rows are (id, flag): ``cancelled`` lists the ids whose flag
    equals ``is_cancelled``."""
    flags = {row[0]: row[1] for row in rows}
    outcome = _fenced_outcome(leases, flags)
    outcome.cancelled = [job_id for job_id in outcome.applied
                         if flags[job_id] == is_cancelled]
    return outcome


def _completed(leases: Sequence[Lease], rows: Iterable[tuple[Any, ...]]) -> WriteOutcome:
    """complete_jobs' rows are (id, the state it was archived in)."""
    return _flagged_outcome(leases, rows, "cancelled")


def bigint_array(values: Iterable[int]) -> str:
    """A ``bigint[]`` parameter as its text literal, for ids and tokens (integers from the
    database). psycopg's generic list adapter inspects every element; for the id and token
    arrays of a 100-job batch that cost more client CPU than the rest of the round trip."""
    return "{" + ",".join(map("%d".__mod__, values)) + "}"


def bool_array(values: Iterable[bool]) -> str:
    """A ``bool[]`` parameter as its text literal (see bigint_array)."""
    return "{" + ",".join("t" if value else "f" for value in values) + "}"


def lease_arrays(leases: Sequence[Lease]) -> dict[str, str]:
    return {"ids": bigint_array(lease.id for lease in leases),
            "tokens": bigint_array(lease.token for lease in leases)}


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
    # Where the scan starts (jobd.claim_floors); None scans from the head of the lane.
    floors: Mapping[str, Any] | None = None
    # The worker is armed for wake-ups (lane_waiters); the claim transaction disarms it.
    disarm: bool = False
    # The lane's limits across nodes (LaneConfig.budget()): the claim takes its turn under
    # the lane's budget lock and is capped by it (claim_jobs_limited). None: no limits.
    budget: dict[str, Any] | None = None
    # The lane's fairness (LaneConfig.claim_order()): overdue jobs first and shares across
    # keys (claim_jobs_ordered). None: strict priority, then age.
    order: dict[str, Any] | None = None
    # Handlers the worker's node does not have: their jobs are left for nodes that do.
    lacking_handlers: tuple[str, ...] = ()
    # The most payload (bytes as stored) a claim takes in all, unless its first ``least``
    # jobs hold more (claim_jobs and claim_jobs_limited, "the byte bound"). None: no bound.
    payload_bytes: int | None = None
    least: int = 1
    # The jobs that start at once, in free slots: a job on its last attempt is taken only
    # among them, as it would spend that attempt unrun if the whole node died while it
    # waited (claim_jobs, "the last attempts"). None: every job may be held.
    starting: int | None = None
    # The lane's max_attempts, for jobs that do not set their own (the last attempts' cut).
    lane_max_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """What one claim took: jobs to run side by side, or a suspect to run alone."""

    jobs: list[Job]
    suspect: Job | None = None
    # Seconds a limited lane's claim waited for the budget lock (other claims' turns).
    budget_wait: float = 0.0
    # The byte bound (ClaimRequest.payload_bytes) or the last attempts' cut
    # (ClaimRequest.starting) left due jobs the claim had locked: the claim is short, not dry.
    bounded: bool = False
    # The byte bound ended the claim (no last attempt before it did): the jobs taken hold
    # about the bound in all.
    bytes_bounded: bool = False


# claim_suspect takes the limits' parameters whether or not the lane has limits.
NO_LIMITS = {"max_running": None, "rate_limit": None, "rate_per": None}
# claim_jobs_limited takes the fairness parameters whether or not the lane is fair.
UNORDERED = {"ordered": False, "max_wait": None, "fair": False, "key_cursor": None}


def _claim_params(request: ClaimRequest, now: datetime | None) -> dict[str, Any]:
    floors = claim_floors.full_scan_params() if request.floors is None else request.floors
    order = request.order if request.order is not None else UNORDERED
    return {"lane": request.lane, "worker": request.worker, "limit": request.limit,
            "visibility_timeout": float(request.visibility_timeout), "now": now, **floors,
            **(request.budget or {}), **order,
            "lacking_handlers": list(request.lacking_handlers),
            "payload_bytes": request.payload_bytes, "least": request.least,
            "starting": request.starting, "lane_max_attempts": request.lane_max_attempts}


def _claim_query(request: ClaimRequest) -> str:
    if request.budget is not None:
        return "claim_jobs_limited"
    ordered = request.order is not None and request.order["ordered"]
    return "claim_jobs_ordered" if ordered else "claim_jobs"


def _claim_steps(request: ClaimRequest, now: datetime | None) -> list[fastpath.Step]:
    """The statements of a claim: the suspect first for a worker that holds nothing, and
    all of it under the lane's budget lock for a lane with limits (a suspect is budgeted
    as any claimed job: it counts against max_running and spends a rate token)."""
    params = _claim_params(request, now)
    steps: list[fastpath.Step] = []
    if request.budget is not None:
        steps.append(("lock_lane_budget", {"lane": request.lane}))
    if request.suspect_first:
        steps.append(("claim_suspect", {**NO_LIMITS, **params}))
    steps.append((_claim_query(request), params))
    return steps


def _jobs(rows: Iterable[tuple[Any, ...]]) -> list[Job]:
    return [Job.from_row(row) for row in rows]


# The claims that apply the last attempts' cut (and, but for claim_jobs_ordered, the byte
# bound): each of their rows ends with one number for the statement: 4 x the count of jobs
# the claim locked before the cuts, + 2 if the byte bound ended the claim, + 1 if a job on
# its last attempt was locked.
_BOUNDED_CLAIMS = frozenset({"claim_jobs", "claim_jobs_limited", "claim_jobs_ordered"})


def _claimed(rows: list[tuple[Any, ...]], request: ClaimRequest, suspect: Job | None = None,
             budget_wait: float = 0.0) -> Claimed:
    """A claim's rows as Claimed, its jobs in the order they are to start."""
    name = _claim_query(request)
    if name not in _BOUNDED_CLAIMS or not rows:
        return Claimed(_jobs(rows), suspect, budget_wait)
    claimed = [Job.from_row(row[:-1]) for row in rows]
    summary = rows[0][-1]  # see _BOUNDED_CLAIMS
    bounded = summary >> 2 > len(rows)
    if name == "claim_jobs_ordered":
        pass  # its rows come in claim order
    elif summary & 1:
        # The ones on their last attempt are among the first, which start at once.
        claimed = in_claim_order(claimed)
    elif request.order is not None and request.order["ordered"]:
        # A limited lane's claim_order() pick, returned in id order.
        claimed = _in_ordered_claim_order(claimed, request)
    else:
        claimed = in_priority_order(claimed)
    return Claimed(claimed, suspect, budget_wait, bounded=bounded,
                   bytes_bounded=bounded and bool(summary & 2))


def _in_ordered_claim_order(claimed: list[Job], request: ClaimRequest) -> list[Job]:
    assert request.order is not None
    return in_ordered_claim_order(claimed, request.order["max_wait"],
                                  request.visibility_timeout)


def claim(
    conn: psycopg.Connection,
    lane: str,
    worker: str,
    limit: int,
    visibility_timeout: float,
    now: datetime | None = None,
    budget: dict[str, Any] | None = None,
    order: dict[str, Any] | None = None,
) -> list[Job]:
    """Claim up to ``limit`` due jobs of ``lane`` for ``worker`` in one statement (in one
    transaction with the lane's budget lock, given the lane's ``budget``; overdue first and
    shared across keys, given the lane's fairness ``order``, LaneConfig.claim_order())."""
    request = ClaimRequest(lane, worker, limit, visibility_timeout, budget=budget, order=order)
    params = _claim_params(request, now)
    with conn.cursor(binary=True) as cursor:  # binary: see _BINARY_RESULTS
        if budget is None:
            rows = cursor.execute(query(_claim_query(request)), params).fetchall()
            return _claimed(rows, request).jobs
        with conn.transaction():
            cursor.execute(query("claim_commits_async"))
            cursor.execute(query("lock_lane_budget"), {"lane": lane})
            rows = cursor.execute(query("claim_jobs_limited"), params).fetchall()
            return _claimed(rows, request).jobs


# Outcomes written in a transaction of their own, fewer than this many, run their statements'
# generic plans (queries.sql, outcomes_plans_generic): PostgreSQL otherwise planned
# complete_jobs afresh for most small batches, and the planning cost more than the generic
# plan's bitmap scan. bench/outcome_plans.py, generic over custom per job: 0.58 for a batch of
# one, 0.81-0.88 at 50-100, 0.91-0.96 at 200; from 500 the two are within the spread (0.83-
# 1.03), so larger batches are left to PostgreSQL's choice (docs/performance.md).
GENERIC_PLANS_BELOW = 256

# Claimed rows come back in binary: their three timestamps are cheaper to send and to parse as
# 8-byte integers than as text, on both sides of the connection.
_BINARY_RESULTS = frozenset({"claim_jobs", "claim_jobs_ordered", "claim_jobs_limited",
                             "claim_suspect"})


def heartbeat(
    conn: psycopg.Connection,
    leases: Sequence[Lease],
    visibility_timeout: float,
    now: datetime | None = None,
) -> WriteOutcome:
    """Extend all ``leases`` in one statement; ``lease_lost`` lists the ones already lost,
    ``cancelled`` those that were asked to stop (jobd.cancel)."""
    if not leases:
        return WriteOutcome([], [])
    rows = conn.execute(
        query("heartbeat"),
        {**lease_arrays(leases), "visibility_timeout": float(visibility_timeout), "now": now},
    ).fetchall()
    return _flagged_outcome(leases, rows, True)


def complete(
    conn: psycopg.Connection, leases: Sequence[Lease], now: datetime | None = None,
    *, schema: str | None = None,
) -> WriteOutcome:
    """Mark a batch done: the rows move to the archive in one statement (``cancelled``: the
    jobs archived as cancelled, having been asked to stop). With ``schema``, the statement
    names jobd's tables itself (a connection with the user's search_path)."""
    if not leases:
        return WriteOutcome([], [])
    statement = query("complete_jobs") if schema is None else qualified("complete_jobs", schema)
    # Tuples: a connection with the user's search_path is the user's, and may read dicts.
    rows = conn.cursor(row_factory=tuple_row).execute(
        statement, {**lease_arrays(leases), "now": now}).fetchall()
    return _completed(leases, rows)


def _fail_params(failures: Sequence[Failure], now: datetime | None,
                 expired_only: bool) -> dict[str, Any]:
    return {
        **lease_arrays([f.lease for f in failures]),
        "errors": [f.error for f in failures],
        "delays": [float(f.retry_delay) for f in failures],
        "default_max_attempts": [f.default_max_attempts for f in failures],
        "final": bool_array(f.final for f in failures),
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
        elif kind == "cancelled":
            outcome.cancelled.append(f.lease.id)
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
    *,
    separate: bool = False,
    while_waiting: fastpath.WhileWaiting | None = None,
    settled_before_failure: list[tuple[WriteOutcome, FailOutcome]] | None = None,
) -> tuple[WriteOutcome, FailOutcome, Claimed]:
    """:func:`complete`, :func:`fail` and :func:`claim` in one network round trip.

    This is the worker's hot path: the results of finished jobs go out with the request for
    more work (``jobd.fastpath``), and commit with the claim in one transaction. With
    ``separate`` the outcomes commit in a transaction of their own first, so a claim that
    fails cannot undo them (the worker asks for that after a failed exchange). On an error
    the connection is left idle and the error raised; the leases decide what a retry still
    applies. Needs an autocommit connection. ``while_waiting``: the caller's other work
    while the server answers (``fastpath.run``). ``settled_before_failure``: when the
    outcomes committed in their own transaction and what came after failed (a limited
    lane's claim waiting past lock_timeout, say), their results are appended to it before
    the error is raised, so the caller counts them written; retried, the fence would report
    them as leases lost.
    """
    outcomes = bool(completions or failures)
    # One commit for the outcomes and the claim: half the WAL flushes per cycle. Apart (the
    # claim in a transaction of its own after the outcomes' COMMIT) a failing claim cannot
    # undo the outcomes; the worker asks for that after a failed exchange. A claim apart
    # commits asynchronously (claim_commits_async), the outcomes never do. A limited lane's
    # claim is always apart: its turn under the budget lock ends at its commit.
    together = (outcomes and request is not None and not separate
                and request.budget is None)
    generic = not together and len(completions) + len(failures) < GENERIC_PLANS_BELOW
    steps: list[fastpath.Step] = []
    if outcomes:
        steps.append((fastpath.BEGIN, None))
        if generic:
            steps.append(("outcomes_plans_generic", {}))
        if completions:
            steps.append(("complete_jobs", {**lease_arrays(completions), "now": now}))
        if failures:
            steps.append(("fail_jobs", _fail_params(failures, now, False)))
        if not together:
            steps.append((fastpath.COMMIT, None))
    if request is not None:
        if not together:
            steps.append(("claim_commits_async", {}))
        if request.disarm:
            steps.append(("disarm_waiter", {"worker": request.worker}))
        steps.extend(_claim_steps(request, now))
        if together:
            steps.append((fastpath.COMMIT, None))
    if not steps:
        return WriteOutcome([], []), FailOutcome(), Claimed([])
    try:
        results = iter(fastpath.run(conn, steps, binary=_BINARY_RESULTS,
                                     while_waiting=while_waiting))
    except psycopg.Error as exc:
        done = fastpath.steps_done(exc)
        # The outcomes' own transaction is the first steps; with its COMMIT among the steps
        # run, they are written whatever failed after.
        own_transaction = 2 + int(generic) + int(bool(completions)) + int(bool(failures))
        if (settled_before_failure is not None and outcomes and not together
                and done is not None and len(done) >= own_transaction):
            settled_before_failure.append(_outcomes(iter(done), completions, failures, generic))
        raise
    completed, failed = _outcomes(results, completions, failures, generic)
    if outcomes and not together:
        next(results)  # COMMIT
    if request is None:
        return completed, failed, Claimed([])
    if not together:
        next(results)  # claim_commits_async
    if request.disarm:
        next(results)
    budget_wait = float(next(results)[0][1]) if request.budget is not None else 0.0
    suspects = _jobs(next(results)) if request.suspect_first else []
    return completed, failed, _claimed(next(results), request,
                                       suspects[0] if suspects else None, budget_wait)


def _outcomes(results: Iterator[list[tuple[Any, ...]]], completions: Sequence[Lease],
              failures: Sequence[Failure], generic: bool) -> tuple[WriteOutcome, FailOutcome]:
    """The outcomes' results from settle_and_claim's steps, up to (not including) their
    COMMIT when they commit apart."""
    if completions or failures:
        next(results)  # BEGIN
        if generic:
            next(results)  # outcomes_plans_generic
    completed = (_completed(completions, next(results)) if completions
                 else WriteOutcome([], []))
    failed = _fail_outcome(failures, next(results)) if failures else FailOutcome()
    return completed, failed


def arm(conn: psycopg.Connection, lane: str, worker: str, floors: Mapping[str, Any],
        lacking_handlers: Sequence[str] = ()) -> str:
    """Arm ``worker`` for wake-ups of ``lane`` unless work may have come since its last
    claim: 'armed', 'work' (claim again now), 'contended' (an enqueue is committing: claim
    again shortly) or 'paused' (the lane is paused: wait, unarmed, for its resume). Jobs of
    ``lacking_handlers`` (the node has no such handler) are not work for this worker.

    Two transactions in one round trip (migrations/0020_arming_apart.sql): the worker's row
    is registered under the lane's lock and committed, then the probe for work runs without
    it, so no enqueue waits for the probe. The probe runs whatever the registration said
    (one round trip); its answer counts only after 'registered'. Needs an autocommit
    connection."""
    params = {"lane": lane, "worker": worker}
    rows = fastpath.run(conn, [(fastpath.BEGIN, None), ("arm_waiter_register", params),
                               (fastpath.COMMIT, None),
                               ("arm_waiter_probe", {**params, **floors,
                                                     "lacking_handlers": list(lacking_handlers)})])
    registered, probed = str(rows[1][0][0]), str(rows[3][0][0])
    return probed if registered == "registered" else registered


def disarm(conn: psycopg.Connection, worker: str) -> None:
    conn.execute(query("disarm_waiter"), {"worker": worker})


def release(conn: psycopg.Connection, leases: Sequence[Lease]) -> WriteOutcome:
    """Give claimed jobs back unharmed (their attempt is not counted): claimable at once."""
    if not leases:
        return WriteOutcome([], [])
    rows = conn.execute(query("release_jobs"), lease_arrays(leases)).fetchall()
    return _fenced_outcome(leases, (row[0] for row in rows))


def asked_to_stop(conn: psycopg.Connection, leases: Sequence[Lease]) -> list[int]:
    """The jobs still held under ``leases`` that were asked to stop (jobd.cancel): after a
    release, the ones it left to their worker to finish as cancelled, told apart from the
    ones whose lease was gone. A read of its own, after the release: a cancel that
    committed while the release ran made it skip the job, and only a later snapshot sees
    it."""
    if not leases:
        return []
    rows = conn.execute(query("held_asked_to_stop"), lease_arrays(leases)).fetchall()
    return [row[0] for row in rows]


def end_backends(conn: psycopg.Connection, pids: Sequence[int], wait_ms: int) -> list[int]:
    """End the server backends ``pids`` of this connection's lost predecessors (those named
    as it is), waiting up to ``wait_ms`` for each to exit; returns those not known to have
    exited. Once one has, nothing it was sent can still commit."""
    rows = conn.execute(query("end_lost_backends"),
                        {"pids": list(pids), "wait_ms": wait_ms}).fetchall()
    return [row[0] for row in rows]

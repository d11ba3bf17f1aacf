"""Recovering jobs whose holder is gone: the lease-expiry sweep, crash attribution, and the
claims a worker made but never received. Each decides what a job's attempt counts for."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from jobd.backoff import RetryPolicy
from jobd.jobs import Lease
from jobd.protocol import backend_prefix
from jobd.queries import query
from jobd.queue import FailOutcome, Failure, bigint_array, fail, lease_arrays, release
from jobd.run_board import Running
from jobd.views import NODE_GONE_GRACE, NODE_GONE_MISSES, NODE_GONE_UNKNOWN

PolicyLookup = Callable[[str], RetryPolicy]


def _fail_rows(
    conn: psycopg.Connection,
    rows: Sequence[tuple[Any, ...]],
    reason: Callable[[str], str],
    policy_for: PolicyLookup,
    now: datetime | None,
    expired_only: bool,
    poison: Mapping[int, str] | None = None,
) -> FailOutcome:
    """Fails ``rows`` as attempts; those in ``poison`` are dead-lettered whatever their
    budget, the note given there added to their error."""
    failures = []
    lanes = {row[0]: row[2] for row in rows}
    poison = poison or {}
    # (id, lease_token, lane, attempts, claimed_by), and from jobs_held_by a cancel flag that
    # fail_jobs reads for itself, the handler and the crashes counted.
    for job_id, token, lane, attempts, claimed_by, *_flags in rows:
        policy = policy_for(lane)
        note = poison.get(job_id)
        failures.append(
            Failure(
                lease=Lease(job_id, token),
                error=reason(claimed_by) if note is None else f"{reason(claimed_by)}; {note}",
                retry_delay=policy.backoff.delay(attempts),
                default_max_attempts=policy.max_attempts,
                final=note is not None,
            )
        )
    outcome = fail(conn, failures, now, expired_only=expired_only)
    for job_id, run_at in outcome.retry_at.items():
        lane = lanes[job_id]
        current = outcome.next_retry_by_lane.get(lane)
        if current is None or run_at < current:
            outcome.next_retry_by_lane[lane] = run_at
    return outcome


@dataclass(slots=True)
class Sweep:
    """What a lease-expiry sweep did: the failed attempts, and per lane how many jobs it
    took from their expired leases."""

    failed: FailOutcome
    expired_by_lane: dict[str, int]
    # The workers whose leases were taken (their ids name their node), with how many each.
    holders: dict[str, int] = field(default_factory=dict)
    # False when the scan stopped at its row limit: more may have run out.
    complete: bool = True
    scan_seconds: float = 0.0  # what the scan for expired leases took


def expire_leases(
    conn: psycopg.Connection,
    policy_for: PolicyLookup,
    now: datetime | None = None,
    limit: int = 1000,
) -> FailOutcome:
    """The lease-expiry sweep (:func:`sweep_expired_leases`), its failed attempts only."""
    return sweep_expired_leases(conn, policy_for, now, limit).failed


def sweep_expired_leases(
    conn: psycopg.Connection,
    policy_for: PolicyLookup,
    now: datetime | None = None,
    limit: int = 1000,
    look_back: float | None = None,
    lanes: Sequence[str] | None = None,
) -> Sweep:
    """The lease-expiry sweep: a job whose lease ran out counts as a failed attempt.

    It becomes claimable again after its backoff, or dead when its budget is spent. A worker
    that renews its lease between the scan and the write keeps its job. With ``look_back``
    (seconds), only leases that ran out since the database's ``now`` less that are read
    (``jobd.head_scans``). With ``lanes`` (the lanes the sweeping node configures), the
    leases of other lanes are left to a live node that configures them, whose retry policy
    (``policy_for``) is the lane's.
    """
    started = time.perf_counter()
    found = conn.execute(query("expired_leases"),
                         expired_leases_params(now, limit, look_back, lanes)).fetchall()
    scan_seconds = time.perf_counter() - started
    locked = {row[0] for row in conn.execute(query("lock_expired"), {
        "ids": bigint_array(row[0] for row in found)})} if found else set()
    # The rows another session holds are left for a later sweep (lock_expired).
    rows = [row for row in found if row[0] in locked]
    outcome = _fail_rows(
        conn, rows, lambda worker: f"lease expired (held by {worker})", policy_for, now, True
    )
    swept = set(outcome.retried) | set(outcome.dead)
    stale = [Lease(row[0], row[1]) for row in found if row[0] in swept or row[0] not in locked]
    if stale:
        # The holder of an expired lease is stale by definition. If it is a transactional
        # handler frozen with its transaction open, it still holds the locks the job's next
        # run needs (its effect key, its writes; the job's own row, if it got as far as its
        # completion): end that transaction now, and the next sweep takes the row.
        conn.execute(query("terminate_stale_handlers"),
                     {"names": [handler_application_name(lease) for lease in stale]})
    expired: dict[str, int] = {}
    holders: dict[str, int] = {}
    for row in rows:
        if row[0] in swept:
            expired[row[2]] = expired.get(row[2], 0) + 1
            holders[row[4]] = holders.get(row[4], 0) + 1
    return Sweep(outcome, expired, holders, complete=len(found) < limit,
                 scan_seconds=scan_seconds)


def expired_leases_params(now: datetime | None = None, limit: int = 1000,
                          look_back: float | None = None,
                          lanes: Sequence[str] | None = None) -> dict[str, Any]:
    """The parameters of the expired_leases query (see sweep_expired_leases); a node is
    judged gone as ``jobd status`` judges it."""
    return {"now": now, "limit": limit, "look_back": look_back,
            "lanes": None if lanes is None else list(lanes), "misses": NODE_GONE_MISSES,
            "grace": NODE_GONE_GRACE, "unknown": NODE_GONE_UNKNOWN}


def handler_application_name(lease: Lease) -> str:
    """What a transactional handler's backend is called while it runs the leased job."""
    return f"jobd job {lease.id}:{lease.token}"


@dataclass(slots=True)
class CrashOutcome:
    """What crash attribution did with a dead worker's jobs."""

    failed: FailOutcome  # the job that killed its worker alone: an attempt spent
    suspects: list[int]  # several jobs running: each gets its attempt back and runs alone
    given_back: list[int] = field(default_factory=list)  # held, never started: unharmed
    # The handlers of the jobs that were running (failed or suspects), for the log.
    handlers: list[str] = field(default_factory=list)
    # Job id -> handler, of every job the worker held: the outcomes of ``failed`` per
    # handler, for the node's counters (jobd.duties.crash_attribution).
    handler_of: dict[int, str] = field(default_factory=dict)


def settle_crashed_worker(
    conn: psycopg.Connection,
    worker: str,
    error: str,
    policy_for: PolicyLookup,
    now: datetime | None = None,
    running: Running | None = None,
    given_back_before: Collection[int] = (),
) -> CrashOutcome:
    """Crash attribution for a worker process that died, in one transaction.

    Only a job whose handler was running can have killed it: ``running``, the worker's run
    board (jobd.run_board), says which; the jobs it held unstarted (claimed ahead, on deck)
    are given back unharmed. Without a board, or when the board missed a run or shows none
    of the jobs held, every job held counts as running; and when the worker held a job that
    an earlier crash gave back as unstarted (``given_back_before``): a handler that kills its
    process by a signal to itself may return, and leave the board, before the signal ends
    the process, so a board can clear the job that killed it once, not twice.

    Alone, the job running killed it: that job spends an attempt (retried after its backoff,
    dead when its budget is spent) and stays a suspect, so its retries run alone; the
    ``max_crashes``-th time it kills its worker so, it is dead-lettered whatever attempts it
    has left (each retry would kill a worker again, and a poison arriving steadily kept the
    lane's slots restarting). Several
    running, nothing says which one killed it: all of them get their attempt back and
    become suspects, each run alone by an idle worker (claim_suspect) until the one that
    kills its worker is found. So only the poison spends its budget, never its neighbours.
    Jobs that were asked to stop (jobd.cancel) are failed either way, which archives them as
    cancelled: they are not run again.
    """
    # A statement the worker sent before it died may still be running on its backend (a
    # claim, say), which has not noticed yet that its client is gone; if it committed after
    # the look below, its jobs would wait for their lease. End the backend first.
    conn.execute(query("terminate_worker_backends"), {"prefix": backend_prefix(worker)})
    with conn.transaction():
        conn.execute(query("disarm_waiter"), {"worker": worker})
        rows = conn.execute(query("jobs_held_by"), {"worker": worker}).fetchall()
        rows, unstarted = _split_by_board(rows, running, given_back_before)
        handlers = sorted({row[6] for row in rows})
        handler_of = {row[0]: row[6] for row in (*rows, *unstarted)}
        given_back = release(conn, [Lease(row[0], row[1]) for row in unstarted if not row[5]])
        # Asked to stop and never started: ended as cancelled, like the running ones.
        stop_unstarted = [row for row in unstarted if row[5]]
        if len(rows) > 1:
            cancelled = [row for row in rows if row[5]] + stop_unstarted
            leases = [Lease(row[0], row[1]) for row in rows if not row[5]]
            released = conn.execute(query("release_as_suspects"),
                                    lease_arrays(leases)).fetchall()
            stopped = _fail_rows(conn, cancelled, lambda _worker: error, policy_for, now, False)
            return CrashOutcome(stopped, sorted(row[0] for row in released),
                                sorted(given_back.applied), handlers, handler_of)
        failed = _fail_rows(conn, rows + stop_unstarted, lambda _worker: error, policy_for,
                            now, False, _poison(rows, policy_for))
        if failed.retried:
            conn.execute(query("mark_suspect"), {"ids": bigint_array(failed.retried)})
        if failed.dead:  # the running job alone: a job asked to stop ends cancelled
            conn.execute(query("mark_killed_worker_dead"), {"ids": bigint_array(failed.dead)})
        return CrashOutcome(failed, [], sorted(given_back.applied), handlers, handler_of)


def _poison(rows: Sequence[tuple[Any, ...]], policy_for: PolicyLookup) -> dict[int, str]:
    """Of the rows (jobs_held_by) of a job that killed its worker alone, those that have now
    done so ``max_crashes`` times: job id -> the note on their dead-lettering. A job asked to
    stop is archived as cancelled either way."""
    poison = {}
    for row in rows:
        job_id, lane, cancelled, crashes_before = row[0], row[2], row[5], row[7]
        limit = policy_for(lane).max_crashes
        if not cancelled and crashes_before + 1 >= limit:
            poison[job_id] = (f"dead-lettered: it killed its worker {crashes_before + 1} "
                              f"{'time' if crashes_before == 0 else 'times'} running alone "
                              f"(lanes.{lane}.max_crashes: {limit})")
    return poison


def _split_by_board(rows: list[Any], running: Running | None,
                    given_back_before: Collection[int]) -> tuple[list[Any], list[Any]]:
    """The rows of jobs held (``jobs_held_by``): (those that were running, those that never
    started), by the run board. A board that is incomplete, or names none of the jobs held,
    proves nothing (the worker died outside any handler, say while decoding a claim), nor
    does one of a worker that held a job an earlier board cleared: then every job held
    counts as running."""
    if (running is None or not running.complete
            or any(row[0] in given_back_before for row in rows)):
        return rows, []
    started = [row for row in rows if row[0] in running.job_ids]
    if not started:
        return rows, []
    return started, [row for row in rows if row[0] not in running.job_ids]


@dataclass(slots=True)
class LostClaims:
    """What the repair after a lost claim did: jobs given back unspent, and jobs failed."""

    given_back: list[int] = field(default_factory=list)
    failed: FailOutcome = field(default_factory=FailOutcome)


def repair_claims_not_held(conn: psycopg.Connection, worker: str, held: Iterable[Lease],
                           give_back: Callable[[int], bool], error: str,
                           policy_for: PolicyLookup, now: datetime | None = None
                           ) -> LostClaims:
    """The jobs claimed under ``worker``'s name except the ``held`` leases: claims whose rows
    never reached the worker (its connection broke while the claim ran, or the rows could
    not be loaded), so none of them started. Those for which ``give_back(id)`` holds go back
    to the queue with their attempt unspent, as a dead worker's unstarted jobs do; the
    others fail as an attempt (retried after their backoff, dead when their budget is
    spent), so that a claim that fails the same way every time ends in the dead-letter
    queue rather than loops. A job asked to stop is never given back (release_jobs): it
    fails, archived as cancelled. One transaction."""
    held_leases = set(held)
    with conn.transaction():
        rows = conn.execute(query("jobs_held_by"), {"worker": worker}).fetchall()
        orphans = [row for row in rows if Lease(row[0], row[1]) not in held_leases]
        if not orphans:
            return LostClaims()
        back = [Lease(row[0], row[1]) for row in orphans if give_back(row[0])]
        given_back = release(conn, back).applied
        kept = set(given_back)
        failing = [row for row in orphans if row[0] not in kept]
        failed = (_fail_rows(conn, failing, lambda _worker: error, policy_for, now, False)
                  if failing else FailOutcome())
    return LostClaims(given_back, failed)


def finish_cancelled(conn: psycopg.Connection, worker: str, error: str,
                     policy_for: PolicyLookup, now: datetime | None = None) -> FailOutcome:
    """The jobs that ``worker`` still holds and that were asked to stop (jobd.cancel),
    archived as cancelled with ``error``: for a worker that is gone, after its other jobs
    were given back (release_jobs leaves these, so that they do not run again)."""
    rows = conn.execute(query("jobs_held_by"), {"worker": worker}).fetchall()
    return _fail_rows(conn, [row for row in rows if row[5]], lambda _worker: error,
                      policy_for, now, False)

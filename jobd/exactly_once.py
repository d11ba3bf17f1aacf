"""Transactional handlers: the effect, the dedup record and the completion commit together.

Delivery stays at-least-once (a worker can die, a lease can expire); the *effect* is made
exactly-once. In one transaction on the worker's handler connection:

1. the job's effect key goes into ``processed_keys`` (``ON CONFLICT DO NOTHING``): no row back
   means the effect already committed, so the handler is skipped (a replay is a no-op);
   a concurrent transaction holding the key makes this statement wait for its outcome;
2. the handler runs with the connection: its writes join the transaction;
3. the job is completed with its lease token (fencing): if the lease was lost — the job was
   re-claimed by another worker — nothing matches and everything above rolls back.

The commit is the single point at which effect, key and completion become true together.
See docs/design/exactly-once.md for the crash analysis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

from jobd import forks
from jobd.db import DEFAULT_SCHEMA
from jobd.handlers import check_ran
from jobd.jobs import Job
from jobd.queries import qualified, query
from jobd.queue import complete
from jobd.recovery import handler_application_name


class LeaseLost(Exception):
    """The job's lease is no longer this worker's; the transaction was rolled back."""


class TransactionEnded(RuntimeError):
    """The handler ended the job's transaction itself (a ``COMMIT`` or ``ROLLBACK``
    statement): what it wrote no longer commits with the job's completion."""


class TransactionAborted(RuntimeError):
    """A statement of the handler failed and the handler returned all the same: the job's
    transaction is aborted, and nothing of it can commit."""


class TransactionRolledBack(RuntimeError):
    """The handler raised ``psycopg.Rollback`` outside a ``with conn.transaction():`` block
    of its own: the job's transaction is rolled back, and the attempt fails."""


class ConnectionGone(Exception):
    """The connection was dead before the transaction began (the server closed it while it
    sat idle in the pool: a restart, a failover, an idle timeout): nothing of the run
    happened, and it may run on another connection."""


def run_transactional(
    conn: psycopg.Connection, job: Job, handler: Callable[[Job, psycopg.Connection], Any],
    schema: str = DEFAULT_SCHEMA, timeout: float | None = None,
) -> Literal["done", "replayed", "cancelled"]:
    """Run ``handler(job, conn)`` exactly-once-in-effect; raises LeaseLost or the handler's
    exception (after rolling back). "cancelled": the job was asked to stop (jobd.cancel) and
    is archived as cancelled, its effect committed all the same.

    ``conn`` keeps the search_path of its role and database, so the handler's statements
    resolve as the user writes them; jobd's own statements here name ``schema`` themselves.
    The transaction carries the job's lease in its ``application_name`` (a lease sweep that
    finds the lease expired terminates it) and, with a ``timeout``, is bounded by the server
    too: no statement and no idle spell inside it may last longer (a tighter bound of the
    role's or database's own stands).

    It starts at READ COMMITTED whatever the role's or database's default: the worker renews
    the job's lease (an UPDATE of its row) while the handler runs, and at REPEATABLE READ or
    SERIALIZABLE the completion's fenced DELETE of that row would then fail every run that
    outlasts a heartbeat.
    """
    callers_autocommit = conn.autocommit
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        # Inside a caller's transaction (jobd.testing) the caller's level stands.
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        # Not autocommit while the handler runs: a statement it sends after ending the job's
        # transaction itself (a ROLLBACK, then a write) opens a transaction that is rolled
        # back below, instead of committing on its own; after a ROLLBACK the key is gone too,
        # and every retry would have made that write again.
        conn.autocommit = False
    # jobd's statements read tuples; the handler gets the connection's own row factory, and
    # whatever it sets (dict_row, say) ends with its run.
    callers_rows = conn.row_factory
    begun = False
    try:
        with conn.transaction():
            begun = True
            conn.row_factory = tuple_row
            first = conn.execute(qualified("record_effect_key", schema), {
                "key": job.effect_key, "job_id": job.id,
                "application_name": handler_application_name(job.lease),
                "timeout_ms": round(timeout * 1000) if timeout else None,
            }).fetchone()
            if first is not None:
                conn.row_factory = callers_rows
                check_ran(job.handler, _call(handler, job, conn))
                conn.row_factory = tuple_row
                _check_transaction_open(conn, job)
            completed = complete(conn, [job.lease], schema=schema)
            if not completed.applied:
                raise LeaseLost(f"job {job.id}: lease lost before commit; effect rolled back")
    except psycopg.OperationalError as exc:
        if not begun and conn.broken:
            raise ConnectionGone(str(exc).strip()) from exc
        raise
    finally:
        conn.row_factory = callers_rows
        _restore_autocommit(conn, callers_autocommit)
    if completed.cancelled:
        return "cancelled"
    return "done" if first is not None else "replayed"


def _call(handler: Callable[[Job, psycopg.Connection], Any], job: Job,
          conn: psycopg.Connection) -> Any:
    """``handler(job, conn)``. A ``psycopg.Rollback`` it raises ends the innermost
    ``conn.transaction()`` block quietly: out of the handler, that block is the job's own, which
    would then end as if the handler had returned, with nothing to complete. It fails the
    attempt instead, as any exception the handler raises does."""
    try:
        return forks.call(handler, job, conn)
    except psycopg.Rollback as exc:
        raise TransactionRolledBack(
            f"handler {job.handler!r} raised psycopg.Rollback outside a transaction block of "
            f"its own: the job's transaction is rolled back and the attempt fails (to undo a "
            f"part of the work, raise it inside `with conn.transaction():`)") from exc


def _check_transaction_open(conn: psycopg.Connection, job: Job) -> None:
    """A handler that sent ``ROLLBACK`` undid its writes and the effect key, and the
    completion that follows would then commit alone: the job done, its effect never made.
    One that sent ``COMMIT`` made its effect without the completion. Either fails the job
    (after a COMMIT, its retry finds the key and completes it without running again), and so
    does one that went on in a transaction begun after it ended the job's (its next statement
    opened one, or its own ``BEGIN`` did), which the server tells (effect_key_held).

    A handler that caught the error of a failed statement and returned left the transaction
    aborted: that is said as such, not as a transaction it ended; one that closed the
    connection (``conn.close()``) is told that, not of a statement it never sent."""
    if conn.closed and not conn.broken:  # closed by the client, not lost
        raise TransactionEnded(
            f"handler {job.handler!r} closed the job's connection (conn.close()), which ended "
            f"the job's transaction; leave the connection open, and raise an exception to "
            f"roll its work back instead")
    status = conn.info.transaction_status
    if status == psycopg.pq.TransactionStatus.INERROR:
        raise TransactionAborted(
            f"a statement of handler {job.handler!r} failed and the handler went on: the "
            f"job's transaction is aborted; to go on after a statement that may fail, run "
            f"it in a savepoint (with conn.transaction(): ...)")
    if status != psycopg.pq.TransactionStatus.INTRANS or not _holds_effect_key(conn, job):
        raise TransactionEnded(
            f"handler {job.handler!r} ended the job's transaction itself (a COMMIT or "
            f"ROLLBACK statement); raise an exception to roll its work back instead")


def _holds_effect_key(conn: psycopg.Connection, job: Job) -> bool:
    row = conn.execute(query("effect_key_held"), {"key": job.effect_key}).fetchone()
    return bool(row and row[0])


def _restore_autocommit(conn: psycopg.Connection, autocommit: bool) -> None:
    """Put back the connection's autocommit once the run's transaction is over (a closed or
    broken connection is dropped by its pool, as it is)."""
    if (conn.autocommit != autocommit and not conn.closed
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE):
        conn.autocommit = autocommit


def end_abandoned(conn: psycopg.Connection, job: Job) -> int:
    """End the server side of ``job``'s transaction whose connection was lost (the client
    gone, the backend perhaps still idle in it, holding the job's row and effect key):
    otherwise the worker's write of the failure waits on those locks until the lease sweep
    ends it. Returns how many ended."""
    return end_transactions(conn, [job])


def end_transactions(conn: psycopg.Connection, abandoned: Sequence[Job]) -> int:
    """End the transactions still open for these jobs' runs, whose outcomes the worker has
    given up on (a lost connection, a timeout). Their backends are known by their names
    (record_effect_key), which carry the leases: a later run's is never touched. Returns
    how many ended."""
    names = [handler_application_name(job.lease) for job in abandoned]
    row = conn.execute(query("terminate_stale_handlers"), {"names": names}).fetchone()
    return int(row[0]) if row else 0

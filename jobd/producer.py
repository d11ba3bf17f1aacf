"""Enqueueing: one job with a single INSERT (through the SQL function ``jobd.enqueue``, so
every entry point meets the same rules), or many with one binary COPY. On the caller's own
connection: a job is durable when the caller's transaction commits."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from jobd import caller_connection, validation
from jobd.db import DEFAULT_SCHEMA
from jobd.jobs import JobSpec
from jobd.queries import qualified, query


def _stored_json(text: str) -> Jsonb:
    """Already-encoded JSON text as a jsonb parameter (it is not encoded a second time)."""
    return Jsonb(text, dumps=str)


_NO_PAYLOAD: Any = object()

def _tuples(conn: psycopg.Connection) -> psycopg.Cursor[tuple[Any, ...]]:
    """A cursor of plain tuples, whatever row factory the caller's connection has."""
    return conn.cursor(row_factory=tuple_row)


def enqueue(
    conn: psycopg.Connection,
    handler: str,
    payload: Any = _NO_PAYLOAD,
    *,
    lane: str = "default",
    run_at: datetime | None = None,
    delay: float | None = None,
    priority: int | None = 0,
    idempotency_key: str | None = None,
    max_attempts: int | None = None,
    fairness_key: str | None = None,
    schema: str = DEFAULT_SCHEMA,
) -> int:
    """Enqueue one job with a single INSERT and return its id.

    The job is due at ``run_at``, or ``delay`` seconds from now by the database clock, or now.
    It is durable when the caller's transaction commits (at once on an autocommit
    connection). With an ``idempotency_key`` already used, the first job's id is returned and
    nothing is inserted. ``fairness_key`` (a tenant, a customer) is the job's key in a fair
    lane's shares (``fair_by``); without one, the job shares by its handler.

    ``payload`` is any JSON value (``None`` is a JSON null); left out, it is ``{}``. A job
    that breaks one of jobd's rules (jobd.validation) raises ValueError before anything is
    sent; the payload size limit is the database's, and a larger payload is refused by the
    server (psycopg.errors.InvalidParameterValue).
    """
    conn = caller_connection.checked(conn, "jobd.enqueue")
    if run_at is not None and delay is not None:
        raise ValueError("give run_at or delay, not both")
    if delay is not None:
        validation.delay(delay)
    spec = JobSpec(
        handler, {} if payload is _NO_PAYLOAD else payload, lane, run_at, priority,
        idempotency_key, max_attempts, fairness_key,
    )
    encoded = spec.encoded_payload()
    statement = ("enqueue_qualified" if spec.fairness_key is None
                 else "enqueue_with_fairness_key_qualified")
    with caller_connection.schema_hint(schema):
        row = _tuples(conn).execute(
            qualified(statement, schema),
            {
                "handler": spec.handler,
                "payload": _stored_json(encoded),
                "lane": spec.lane,
                "run_at": spec.run_at,
                "delay": float(delay or 0),
                "priority": spec.priority,
                "idempotency_key": spec.idempotency_key,
                "max_attempts": spec.max_attempts,
                "fairness_key": spec.fairness_key,
            },
        ).fetchone()
    assert row is not None
    return int(row[0])


_COPY_TYPES = ["int8", "text", "text", "jsonb", "int4", "timestamptz", "text", "int4", "text"]


def enqueue_many(
    conn: psycopg.Connection, specs: Sequence[JobSpec], *, schema: str = DEFAULT_SCHEMA
) -> list[int]:
    """Enqueue many jobs in one transaction (a savepoint inside the caller's); ids in order.

    Ids are reserved in one round trip and the rows go in with one binary COPY, so a batch of
    thousands costs a few round trips. Jobs with an idempotency key go through the key ledger
    first; a key already taken (or repeated within the batch) yields the existing job's id.
    """
    conn = caller_connection.checked(conn, "jobd.enqueue_many")
    encoded = [spec.encoded_payload() for spec in specs]
    if not specs:
        return []
    largest = max(len(text.encode("utf-8")) for text in encoded)  # valid UTF-8: checked
    ids: list[int | None] = [None] * len(specs)
    to_insert: list[tuple[int, int]] = []  # (job id, position in specs)
    with caller_connection.schema_hint(schema), _savepoint_in_callers_transaction(conn):
        keyed = [i for i, spec in enumerate(specs) if spec.idempotency_key is not None]
        unkeyed = [i for i, spec in enumerate(specs) if spec.idempotency_key is None]
        # COPY cannot evaluate now(), so the database clock is read here: within a
        # transaction now() is fixed, the same value the column default would give.
        row = _tuples(conn).execute(
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
        keyed_rows = any(spec.fairness_key is not None for spec in specs)
        statement = ("copy_jobs_with_fairness_keys_qualified" if keyed_rows
                     else "copy_jobs_qualified")
        with conn.cursor().copy(qualified(statement, schema)) as copy:
            copy.set_types(_COPY_TYPES if keyed_rows else _COPY_TYPES[:-1])
            for job_id, position in to_insert:
                spec = specs[position]
                row = (job_id, spec.lane, spec.handler, _stored_json(encoded[position]),
                       spec.priority, spec.run_at or db_now, spec.idempotency_key,
                       spec.max_attempts)
                copy.write_row((*row, spec.fairness_key) if keyed_rows else row)
    return [int(job_id) for job_id in ids if job_id is not None]


def _savepoint_in_callers_transaction(
    conn: psycopg.Connection,
) -> AbstractContextManager[psycopg.Transaction]:
    """``conn.transaction()``, a savepoint of the caller's transaction. Without autocommit and
    before the caller's first statement, psycopg's transaction() would begin a transaction of
    its own and commit it at the block's end, so the jobs would outlive the caller's
    rollback; a first statement begins the caller's transaction instead, as the INSERT of a
    single enqueue does. (With autocommit, the block is the transaction: the batch commits
    whole or not at all.)"""
    if not conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
        _tuples(conn).execute(query("open_transaction"))
    return conn.transaction()


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
        _tuples(conn).execute(qualified("reserve_keys_qualified", schema), {"keys": keys})
    )
    # A separate statement takes a fresh snapshot and sees keys that concurrent transactions
    # committed while the INSERT ... ON CONFLICT waited for them.
    taken = [key for key in keys if key not in reserved]
    existing = (
        dict(_tuples(conn).execute(qualified("lookup_keys_qualified", schema), {"keys": taken}))
        if taken
        else {}
    )
    for position in keyed:
        key = specs[position].idempotency_key
        if key in reserved:
            job_id: int = reserved.pop(key)
            ids[position] = existing[key] = job_id
            to_insert.append((job_id, position))
        else:
            ids[position] = existing[key]

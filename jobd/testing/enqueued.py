"""Asserting what a test's code enqueued: ``enqueued_jobs``, ``assert_enqueued`` and
``refute_enqueued``.

They read ``jobd.jobs`` on the connection they are given, so they see the jobs that the
test's open transaction inserted and no other connection can see yet. "Enqueued" means live:
pending, failed and waiting for its retry, or claimed; a job that finished (done, dead,
cancelled) is no longer enqueued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb

from jobd.db import DEFAULT_SCHEMA, validate_schema
from jobd.queries import qualified
from jobd.testing.session import schema_checked

_ANY: Any = object()


@dataclass(frozen=True, slots=True)
class EnqueuedJob:
    """A live job as ``jobd.jobs`` holds it."""

    id: int
    handler: str
    lane: str
    payload: Any
    state: str
    priority: int
    run_at: datetime
    attempts: int
    max_attempts: int | None
    idempotency_key: str | None
    created_at: datetime

    def describe(self) -> str:
        return (f"job {self.id} {self.handler!r} lane {self.lane!r} {self.state} "
                f"payload {json.dumps(self.payload, sort_keys=True)}")


def enqueued_jobs(conn: psycopg.Connection, handler: str | None = None, *,
                  payload: Any = _ANY, lane: str | None = None,
                  schema: str = DEFAULT_SCHEMA) -> list[EnqueuedJob]:
    """The live jobs (oldest first) of ``handler`` in ``lane`` whose payload contains
    ``payload`` (JSON containment, PostgreSQL's ``@>``: every key and value given is in the
    job's payload, which may hold more); each filter left out matches every job."""
    # Tuples, whatever row factory the test's connection has: EnqueuedJob takes them in order.
    with schema_checked(validate_schema(schema)):
        rows = conn.cursor(row_factory=tuple_row).execute(
            qualified("testing_enqueued_jobs_qualified", schema), {
                "handler": handler, "lane": lane,
                "payload": None if payload is _ANY else Jsonb(payload)}).fetchall()
    return [EnqueuedJob(*row) for row in rows]


def _wanted(handler: str | None, payload: Any, lane: str | None) -> str:
    parts = [f"handler {handler!r}" if handler is not None else "any handler"]
    if payload is not _ANY:
        parts.append(f"payload containing {json.dumps(payload, sort_keys=True)}")
    if lane is not None:
        parts.append(f"lane {lane!r}")
    return ", ".join(parts)


def _listing(jobs: list[EnqueuedJob]) -> str:
    if not jobs:
        return "no job is enqueued"
    shown = "\n".join(f"  {job.describe()}" for job in jobs[:20])
    more = f"\n  ... and {len(jobs) - 20} more" if len(jobs) > 20 else ""
    return f"enqueued:\n{shown}{more}"


def assert_enqueued(conn: psycopg.Connection, handler: str | None = None, *,
                    payload: Any = _ANY, lane: str | None = None, count: int | None = None,
                    schema: str = DEFAULT_SCHEMA) -> list[EnqueuedJob]:
    """Fail (AssertionError) unless a live job matches (see :func:`enqueued_jobs`), or
    exactly ``count`` of them do; returns the matching jobs. The message lists every
    enqueued job, to show what the code under test did enqueue."""
    matching = enqueued_jobs(conn, handler, payload=payload, lane=lane, schema=schema)
    if (not matching if count is None else len(matching) != count):
        expected = "a job" if count is None else f"{count} job(s)"
        raise AssertionError(
            f"expected {expected} with {_wanted(handler, payload, lane)}, found "
            f"{len(matching)}; {_listing(enqueued_jobs(conn, schema=schema))}")
    return matching


def refute_enqueued(conn: psycopg.Connection, handler: str | None = None, *,
                    payload: Any = _ANY, lane: str | None = None,
                    schema: str = DEFAULT_SCHEMA) -> None:
    """Fail (AssertionError) if any live job matches (see :func:`enqueued_jobs`)."""
    matching = enqueued_jobs(conn, handler, payload=payload, lane=lane, schema=schema)
    if matching:
        raise AssertionError(
            f"expected no job with {_wanted(handler, payload, lane)}; {_listing(matching)}")

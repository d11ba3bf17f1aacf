"""Cancelling jobs by id (``jobd jobs cancel``, ``jobd.cancel(conn, ids)``, SQL
``jobd.cancel(ids)``).

A pending or failed job is archived as ``cancelled`` at once. A running (claimed) job is
asked to stop: its worker learns it at its next lease renewal, which the cancel's
notification brings forward, and tells the handler (``job.cancelled``; an async handler
gets CancelledError). However that run ends, the job is archived as ``cancelled``. A job
that had finished (done, dead, cancelled) is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from jobd import caller_connection
from jobd.db import DEFAULT_SCHEMA
from jobd.queries import qualified


@dataclass(slots=True)
class CancelResult:
    cancelled: list[int] = field(default_factory=list)  # pending or failed: cancelled now
    requested: list[int] = field(default_factory=list)  # running: asked to stop
    finished: dict[int, str] = field(default_factory=dict)  # already over: id -> state
    unknown: list[int] = field(default_factory=list)  # no such job

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cancel(conn: psycopg.Connection, ids: Sequence[int], *,
           schema: str = DEFAULT_SCHEMA) -> CancelResult:
    """Cancel the jobs ``ids``: see the module. Takes effect when the caller's transaction
    commits; ids that name no job are listed in ``unknown``, the others are cancelled
    regardless (roll back to undo)."""
    conn = caller_connection.checked(conn, "jobd.cancel")
    result = CancelResult()
    with caller_connection.schema_hint(schema):
        rows = conn.cursor(row_factory=tuple_row).execute(
            qualified("cancel_jobs_qualified", schema), {"ids": list(ids)}).fetchall()
    for job_id, outcome, state in rows:
        if outcome == "cancelled":
            result.cancelled.append(job_id)
        elif outcome == "requested":
            result.requested.append(job_id)
        elif outcome == "finished":
            result.finished[job_id] = state
        else:
            result.unknown.append(job_id)
    return result

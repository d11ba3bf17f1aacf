"""Read-only views of the queue for operators: per-lane status, single jobs, listings."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from jobd.queries import query

JOB_STATES = ("pending", "claimed", "done", "failed", "dead")


@dataclass(frozen=True, slots=True)
class LaneStatus:
    lane: str
    pending: int
    claimed: int
    failed: int
    dead: int
    oldest_unclaimed_age: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lane_status(conn: psycopg.Connection, now: datetime | None = None) -> list[LaneStatus]:
    """Counts of live jobs by state, the oldest due unclaimed job's age (s), DLQ depth."""
    rows = conn.execute(query("lane_stats"), {"now": now}).fetchall()
    return [LaneStatus(*row) for row in rows]


def get_job(conn: psycopg.Connection, job_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("get_job"), {"id": job_id}).fetchone()


def list_jobs(
    conn: psycopg.Connection, state: str | None = None, lane: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            query("list_jobs"), {"state": state, "lane": lane, "limit": limit}
        ).fetchall()


def list_dead(
    conn: psycopg.Connection, lane: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("list_dead"), {"lane": lane, "limit": limit}).fetchall()

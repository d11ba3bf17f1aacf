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


@dataclass(frozen=True, slots=True)
class NodeStatus:
    instance: str
    node: str
    pid: int
    seen_at: datetime
    workers: dict[str, int]
    # Per lane: {"claimed": per second, "completed": ..., "failed": ..., "dead": ...} over the
    # node's last two heartbeats; empty until it has sent two.
    rates: dict[str, dict[str, float]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_status(conn: psycopg.Connection, within_seconds: float = 60.0) -> list[NodeStatus]:
    """Supervisors seen in the last ``within_seconds``, with their workers and rates."""
    rows = conn.execute(query("live_nodes"), {"within": within_seconds}).fetchall()
    return [
        NodeStatus(instance, node, pid, seen_at, workers,
                   _rates(counters, previous, sample_seconds))
        for instance, node, pid, _started, seen_at, workers, counters, previous, sample_seconds
        in rows
    ]


def _rates(counters: dict[str, dict[str, int]], previous: dict[str, dict[str, int]],
           seconds: float | None) -> dict[str, dict[str, float]]:
    if not seconds or seconds <= 0:
        return {}
    rates: dict[str, dict[str, float]] = {}
    for lane, values in counters.items():
        before = previous.get(lane, {})
        rates[lane] = {key: max(0, value - before.get(key, 0)) / seconds
                       for key, value in values.items()}
    return rates


def lane_rates(nodes: list[NodeStatus]) -> dict[str, dict[str, float]]:
    """Rates per lane summed over all live nodes."""
    total: dict[str, dict[str, float]] = {}
    for node in nodes:
        for lane, values in node.rates.items():
            lane_total = total.setdefault(lane, {})
            for key, value in values.items():
                lane_total[key] = lane_total.get(key, 0.0) + value
    return total


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

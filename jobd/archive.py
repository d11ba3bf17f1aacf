"""Retention of finished jobs: daily archive partitions, created ahead and dropped whole."""

from __future__ import annotations

from datetime import datetime

import psycopg

from jobd.queries import query


def ensure_partitions(conn: psycopg.Connection, days_ahead: int = 7) -> int:
    """Create missing daily partitions up to ``days_ahead``; returns how many were created."""
    row = conn.execute(query("ensure_archive_partitions"), {"days_ahead": days_ahead}).fetchone()
    assert row is not None
    return int(row[0])


def drop_before(conn: psycopg.Connection, cutoff: datetime) -> int:
    """Drop the partitions that end at or before ``cutoff``; returns how many were dropped."""
    row = conn.execute(query("drop_archive_partitions"), {"cutoff": cutoff}).fetchone()
    assert row is not None
    return int(row[0])

"""Retention of finished jobs: daily archive partitions, created ahead and dropped whole, and
the records that live exactly as long as the jobs they belong to."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

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


@dataclass(frozen=True, slots=True)
class Retention:
    """What one retention pass did."""

    partitions_created: int
    partitions_dropped: int
    effect_keys_pruned: int
    outbox_entries_pruned: int


def apply_retention(conn: psycopg.Connection, retention: timedelta) -> Retention:
    """Create the coming days' partitions, then forget what is older than ``retention``
    (database clock): archive partitions, effect keys of transactional handlers, and
    delivered outbox entries. Effect keys and outbox entries are the deduplication records
    of jobs that can be replayed, so they live as long as those jobs' history; pending and
    dead outbox entries are kept (they still need delivering or an operator's decision)."""
    created = ensure_partitions(conn)
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    cutoff = row[0] - retention
    dropped = drop_before(conn, cutoff)
    keys = conn.execute(query("prune_processed_keys"), {"cutoff": cutoff}).rowcount
    entries = conn.execute(query("prune_outbox"), {"cutoff": cutoff}).rowcount
    return Retention(created, dropped, keys, entries)

"""Retention of finished jobs: daily archive partitions, created ahead and dropped whole, and
the records that live exactly as long as the jobs they belong to."""

from __future__ import annotations

import time
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


# Rows a prune deletes in one statement (and one commit), and how long one retention pass
# prunes before it leaves the rest to the next (the other duties wait meanwhile).
PRUNE_BATCH = 10_000
PRUNE_BUDGET = 0.25

# What the prunes forget, in order: the Retention field each counts into, and its query.
_PRUNES = (("idempotency_keys_pruned", "prune_job_keys"),
           ("effect_keys_pruned", "prune_processed_keys"),
           ("outbox_entries_pruned", "prune_outbox"))


@dataclass(frozen=True, slots=True)
class Retention:
    """What one retention pass did."""

    partitions_created: int
    partitions_dropped: int
    idempotency_keys_pruned: int
    effect_keys_pruned: int
    outbox_entries_pruned: int
    # The pass ran out of its budget with more to forget: run the next one soon.
    more: bool = False


def apply_retention(conn: psycopg.Connection, retention: timedelta,
                    budget: float | None = None, batch: int | None = None) -> Retention:
    """Create the coming days' partitions, then forget what is older than ``retention``,
    or than a longer retention another node states in its heartbeat (a node configured to
    keep less must not forget what another keeps; database clock): archive partitions,
    idempotency keys of jobs no longer in the queue or the dead-letter queue, effect keys
    of transactional handlers, and delivered outbox entries. Effect keys and outbox entries
    are the deduplication records of jobs that can be replayed, so they live as long as
    those jobs' history; pending and dead outbox entries are kept (they still need
    delivering or an operator's decision). Needs an autocommit connection: each drop and
    each batch of ``batch`` rows (PRUNE_BATCH) commits on its own, for ``budget`` seconds
    (PRUNE_BUDGET) at most."""
    created = ensure_partitions(conn)
    row = conn.execute(query("archive_cutoff"),
                       {"retention": retention.total_seconds()}).fetchone()
    assert row is not None
    cutoff = row[0]
    dropped = drop_before(conn, cutoff)
    pruned, more = prune_before(conn, cutoff, budget, batch)
    return Retention(created, dropped, **pruned, more=more)


def prune_before(conn: psycopg.Connection, cutoff: datetime, budget: float | None = None,
                 batch: int | None = None) -> tuple[dict[str, int], bool]:
    """Forget the records older than ``cutoff`` (see apply_retention) in batches, for
    ``budget`` seconds at most; returns the counts and whether some were left."""
    batch = PRUNE_BATCH if batch is None else batch
    deadline = time.monotonic() + (PRUNE_BUDGET if budget is None else budget)
    pruned = dict.fromkeys((field for field, _query in _PRUNES), 0)
    for field, name in _PRUNES:
        while True:
            deleted, finished = _prune_batch(conn, name, cutoff, batch)
            pruned[field] += deleted
            if finished:
                break
            if time.monotonic() >= deadline:
                return pruned, True
    return pruned, False


def _prune_batch(conn: psycopg.Connection, name: str, cutoff: datetime,
                 batch: int) -> tuple[int, bool]:
    """One batch of the prune ``name``: the rows it deleted, and whether none are left.
    The idempotency keys' sweep says itself when it has reached the cutoff: a batch of keys
    that must all be kept deletes nothing, yet the sweep goes on past them."""
    cursor = conn.execute(query(name), {"cutoff": cutoff, "batch": batch})
    if name == "prune_job_keys":
        row = cursor.fetchone()
        assert row is not None
        return int(row[0]), bool(row[1])
    return cursor.rowcount, cursor.rowcount < batch

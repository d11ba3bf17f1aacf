"""Archive maintenance, hourly: tops up archive partitions and drops those past retention
(with effect keys and delivered outbox entries), prunes nodes gone for an hour, waiters
left by workers gone without a trace, the priorities lanes no longer use, and the fire
ledger (``jobd.archive``, ``jobd.schedules``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, astuple
from datetime import timedelta

import psycopg
import structlog

from jobd import archive, schedules
from jobd.duties import Periodic
from jobd.queries import query

log = structlog.get_logger("jobd.duties.retention")

MAINTENANCE_INTERVAL = 3600.0
BACKLOG_INTERVAL = 5.0  # seconds between passes while a retention backlog lasts
NODE_STALE_AFTER = 3600.0  # seconds without a heartbeat before a node's row is pruned
WAITER_STALE_AFTER = 3600.0  # seconds since an armed worker last refreshed its row


class Retention(Periodic):
    name = "archive maintenance"
    alone = True

    def __init__(self, retention: Callable[[], float]) -> None:
        super().__init__(lambda: MAINTENANCE_INTERVAL)
        self.retention = retention

    def work(self, conn: psycopg.Connection, now: float) -> None:
        done = archive.apply_retention(conn, timedelta(seconds=self.retention()))
        if done.more:
            # A backlog to forget: the next batches soon, not in an hour.
            self.next_at = now + BACKLOG_INTERVAL
        conn.execute(query("prune_nodes"), {"older_than": NODE_STALE_AFTER})
        conn.execute(query("prune_waiters"), {"older_than": WAITER_STALE_AFTER})
        conn.execute(query("forget_unused_priorities"))
        schedules.prune_ledger(conn)
        if any(astuple(done)):
            log.info("archive maintenance", **asdict(done))

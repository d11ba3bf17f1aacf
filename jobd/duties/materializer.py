"""The cron materializer as a duty: declares this node's schedules (at start and after a
reload), refreshes the declarations every ``duty_interval``, and enqueues due occurrences
when they fall due (``jobd.schedules``). Every node runs it; the fire ledger makes that
harmless."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import psycopg
import structlog

from jobd import schedules
from jobd.config import Config
from jobd.duties import NEVER, Duty, Router

log = structlog.get_logger("jobd.duties.materializer")

TIMER_FLOOR = 0.05  # seconds: a slightly early timer (clock offset error) must not spin
RETRY_AFTER = 1.0  # seconds before a failed turn is tried again


class Materializer(Duty):
    name = "schedules"

    def __init__(self, instance: str, config: Callable[[], Config], router: Router) -> None:
        super().__init__()
        self.instance = instance
        self.config = config
        self.router = router
        self.synced = False
        self.changed_at: float | None = None  # monotonic: when a reload read its config
        self.next_refresh = 0.0
        self.next_tick = NEVER

    def resync(self, changed_at: float | None = None) -> None:
        """The config changed (read at ``changed_at``, on the monotonic clock): declare its
        schedules on the next turn."""
        self.synced = False
        self.changed_at = changed_at
        self.next_at = 0.0

    def run(self, conn: psycopg.Connection, now: float) -> None:
        config = self.config()
        ttl = schedules.declaration_ttl(config.duty_interval)
        if not self.synced:
            synced = schedules.sync(conn, config.schedules, self.instance, ttl,
                                    self._change_instant(ttl))
            schedules.report_sync(synced)
            _warn_of_lanes_not_served(config)
            if synced.owed.enqueued:
                self.router.due_everywhere(config.lanes)
            self.synced = True
            self.changed_at = None
            # The tick waits for the next turn, a transaction of its own. The sync holds the
            # locks of this node's schedules, taken in id order; a tick after it would lock
            # the schedules only other nodes declare after them, out of the order every tick
            # locks in, and close a lock cycle with another node's tick.
            self.next_tick = now
            self.next_at = now
            return
        if now >= self.next_refresh:
            self.next_refresh = now + config.duty_interval
            self._tick(conn, now)
            # After the tick: the refresh never waits for a schedule lock, so it cannot
            # close a lock cycle with the locks the tick took.
            owed = schedules.TickResult()
            if schedules.refresh(conn, self.instance, config.schedules, ttl, owed=owed):
                self._tick(conn, now)  # the adopted expressions' next fire
            if owed.enqueued:
                self.router.due_everywhere(config.lanes)
        elif now >= self.next_tick:
            self._tick(conn, now)
        self.next_at = min(self.next_refresh, self.next_tick)

    def _change_instant(self, ttl: float) -> datetime | None:
        """The database's time when the reloaded config was read. A changed expression (or a
        new schedule) starts there rather than at this sync, which waits for the reload's
        import check (about a second): an occurrence falling due in between belongs to the
        config the operator had already saved. None (the sync's own ``now()``) at start, and
        for a change read so long ago (a sync that failed and is tried again) that
        declarations made at it would be close to expiry."""
        if self.changed_at is None or time.monotonic() - self.changed_at > ttl / 2:
            return None
        return datetime.fromtimestamp(self.router.db_epoch(self.changed_at), UTC)

    def _tick(self, conn: psycopg.Connection, now: float) -> None:
        result = schedules.tick(conn)
        if result.enqueued:
            self.router.due_everywhere(self.config().lanes)
        if result.next_fire_at is None:
            self.next_tick = NEVER
            return
        delay = result.next_fire_at.timestamp() - self.router.db_epoch()
        # On the clock the duty runs on (``now``), as next_refresh is.
        self.next_tick = now + max(TIMER_FLOOR, delay)

    def rolled_back(self) -> None:
        # A sync in the transaction that failed did not happen; try again shortly.
        self.synced = False
        self.next_at = time.monotonic() + RETRY_AFTER

    def stop(self, conn: psycopg.Connection) -> None:
        # Its schedules stop counting as declared by it at once, not after the expiry.
        schedules.withdraw(conn, self.instance)


def _warn_of_lanes_not_served(config: Config) -> None:
    """A schedule may fill a lane only another node serves; a typo in its lane looks the
    same, and its jobs would wait there unseen: say so when the schedules are declared."""
    for schedule in config.schedules:
        if schedule.lane not in config.lanes:
            log.warning("a schedule enqueues into a lane this node does not serve: its jobs "
                        "wait for a node that does", schedule=schedule.id, lane=schedule.lane,
                        lanes=sorted(config.lanes))

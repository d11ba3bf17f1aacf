"""The supervisor's LISTEN connection: turns enqueue notifications into lane wake-ups.

Notifications are a hint, never the only path: if the connection dies the listener
reconnects with backoff and the supervisor's fallback poll covers the gap. A payload is
``lane#<n>`` (n jobs due now) or ``lane@<epoch seconds>`` (the earliest job the statement
scheduled for later), which the supervisor turns into a timer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import structlog
from psycopg import sql

from jobd.db import connect, first_line
from jobd.errors import DatabaseUnavailable

log = structlog.get_logger("jobd.wakeup")


@dataclass(frozen=True, slots=True)
class Wakeup:
    lane: str
    at_epoch: float | None  # None: now
    due: int = 1  # how many jobs became due (when at_epoch is None)


def parse_payload(payload: str) -> Wakeup | None:
    """``lane#<due count>``, ``lane@<epoch>``, or a bare ``lane`` (one due job)."""
    if "@" in payload:
        lane, _, at = payload.partition("@")
        try:
            return Wakeup(lane, float(at)) if lane else None
        except ValueError:
            return None
    lane, sep, count = payload.partition("#")
    if not lane:
        return None
    if not sep:
        return Wakeup(lane, None)
    try:
        return Wakeup(lane, None, max(1, int(count)))
    except ValueError:
        return None


def channel_name(schema: str) -> str:
    return f"{schema}_wakeup"


class Listener:
    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.conn: psycopg.Connection | None = None
        self.retry_at = 0.0
        self.retry_delay = 0.5
        self.connected_once = False

    def fileno(self) -> int | None:
        return self.conn.fileno() if self.conn is not None else None

    def ensure(self) -> bool:
        """Connect and LISTEN if not connected and the backoff allows; True on a new connection."""
        if self.conn is not None or time.monotonic() < self.retry_at:
            return False
        try:
            conn = connect(self.url, self.schema, application_name="jobd listener")
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(self.schema))))
        except (DatabaseUnavailable, psycopg.Error) as exc:
            message = str(exc) if isinstance(exc, DatabaseUnavailable) else first_line(exc)
            log.warning("listen connection failed", error=message,
                        retry_in=round(self.retry_delay, 1))
            self.retry_at = time.monotonic() + self.retry_delay
            self.retry_delay = min(self.retry_delay * 2, 30.0)
            return False
        self.conn = conn
        self.retry_delay = 0.5
        if self.connected_once:
            log.info("listen connection restored")
        self.connected_once = True
        return True

    def receive(self) -> Iterator[Wakeup]:
        """The notifications that have arrived, without blocking."""
        if self.conn is None:
            return
        try:
            for notify in self.conn.notifies(timeout=0, stop_after=None):
                wakeup = parse_payload(notify.payload)
                if wakeup is not None:
                    yield wakeup
        except psycopg.OperationalError as exc:
            log.warning("listen connection lost", error=first_line(exc))
            self.close()
            self.retry_at = time.monotonic() + self.retry_delay

    def check(self) -> None:
        """Probe a quiet connection, so a dead one is noticed and replaced."""
        if self.conn is None:
            return
        try:
            self.conn.execute("SELECT 1")
        except psycopg.OperationalError as exc:
            log.warning("listen connection lost", error=first_line(exc))
            self.close()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None

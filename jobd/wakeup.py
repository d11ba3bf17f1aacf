"""The supervisor's LISTEN connection: turns enqueue notifications into lane wake-ups.

Notifications are a hint, never the only path: if the connection dies the listener
reconnects with backoff and the supervisor's fallback poll covers the gap. A pooler in
transaction mode cannot hold a LISTEN (the server session it was issued on goes to other
clients), so the listener connects to ``database.listen_url`` when set, and treats a
connection that turns out to be pooled as unavailable. While it is unavailable the node runs
on the fallback poll: one warning when that starts, one notice when LISTEN is back,
``jobd_listener_connected`` and `jobd status` in between. A payload is
``lane#<n>`` (n jobs due now), ``lane@<epoch seconds>`` (the earliest job the statement
scheduled for later), which the supervisor turns into a timer, or ``lane!<control>``: the
lane's pauses changed (``pause``), some of its running jobs were asked to stop
(``cancel``), or jobs due for a while were enqueued (``behind``: they may be below the
workers' claim floors; it comes with the ``#<n>`` that wakes them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import psycopg
import structlog
from psycopg import sql

from jobd.db import (
    DEFAULT_SESSION,
    ManagedConnection,
    SessionSettings,
    application_name,
    is_pooled,
    redact,
)
from jobd.errors import DatabaseUnavailable

log = structlog.get_logger("jobd.wakeup")

CONTROLS = ("pause", "cancel", "behind")


@dataclass(frozen=True, slots=True)
class Wakeup:
    lane: str
    at_epoch: float | None  # None: now
    due: int = 1  # how many jobs became due (when at_epoch is None)
    control: str | None = None  # one of CONTROLS: not work, news for the lane's workers


def parse_payload(payload: str) -> Wakeup | None:
    """``lane#<due count>``, ``lane@<epoch>``, ``lane!<control>``, or a bare ``lane`` (one
    due job)."""
    if "!" in payload:
        lane, _, control = payload.partition("!")
        return Wakeup(lane, None, 0, control) if lane and control in CONTROLS else None
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
    """The LISTEN connection (``jobd.db.ManagedConnection``: reconnects with backoff)."""

    def __init__(self, url: str, schema: str, *, listen_url: str | None = None,
                 session: SessionSettings = DEFAULT_SESSION, node: str | None = None) -> None:
        self.schema = schema
        self.url = listen_url or url
        # listen_url is meant to be direct whatever database.pooler says of url; `auto`
        # still notices a pooler there (and _listen refuses it).
        listen_session = replace(session, pooler="auto") if listen_url else session
        self.link = ManagedConnection(self.url, schema, application_name("listener", node=node),
                                      on_connect=self._listen,
                                      on_failed_attempt=self._unavailable,
                                      label="listen connection", session=listen_session)
        self.said_unavailable = False

    def _listen(self, conn: psycopg.Connection) -> None:
        if is_pooled(conn):
            raise DatabaseUnavailable(
                "LISTEN cannot work through a transaction-mode pooler; set "
                "database.listen_url to a direct connection")
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(self.schema))))

    def _unavailable(self, error: str) -> None:
        """A failed attempt to connect and LISTEN: said once per outage, then quietly
        retried with the connection's backoff."""
        if self.said_unavailable:
            log.debug("LISTEN still unavailable", error=error)
            return
        self.said_unavailable = True
        log.warning("LISTEN unavailable; waking workers on the fallback poll",
                    url=redact(self.url), error=error)

    @property
    def connected(self) -> bool:
        return self.link.conn is not None

    @property
    def conn(self) -> psycopg.Connection | None:
        return self.link.conn

    def fileno(self) -> int | None:
        return self.conn.fileno() if self.conn is not None else None

    def ensure(self) -> bool:
        """Connect and LISTEN if not connected and the backoff allows; True on a new connection."""
        opened = self.link.ensure()
        if opened and self.said_unavailable:
            self.said_unavailable = False
            log.info("LISTEN available again; notifications wake workers", url=redact(self.url))
        return opened

    def receive(self) -> Iterator[Wakeup]:
        """The notifications that have arrived, without blocking."""
        if self.conn is None:
            return
        try:
            for notify in self.conn.notifies(timeout=0, stop_after=None):
                wakeup = parse_payload(notify.payload)
                if wakeup is not None:
                    yield wakeup
        except psycopg.Error as exc:
            self.link.lost("listen", exc)

    def check(self) -> None:
        """Probe a quiet connection, so a dead one is noticed and replaced."""
        self.link.run("listen probe", lambda conn: conn.execute("SELECT 1"))

    def close(self) -> None:
        self.link.close()

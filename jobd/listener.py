"""The supervisor's LISTEN connection, on a thread of its own: turns enqueue notifications
(jobd.wakeup) into lane wake-ups for the supervisor's loop.

Everything that can wait on the network happens on this thread: the connection attempt (up
to the 5 s connect timeout, then backoff), the LISTEN, and the probe that notices a silent
connection (a statement that waits up to the 30 s of ``tcp_user_timeout`` on a partition).
The loop only takes what arrived, told by a byte on a pipe its ``select`` watches, so a
listen host that does not answer cannot hold up its relays, reaping or signals.

Notifications are a hint, never the only path: while the connection is down the
supervisor's fallback poll covers the gap, and each new connection asks it to look at every
lane (what was sent before the LISTEN was not heard). A pooler in transaction mode cannot
hold a LISTEN (the server session it was issued on goes to other clients), so the listener
connects to ``database.listen_url`` when set, and treats a connection that turns out to be
pooled as unavailable. While it is unavailable the node runs on the fallback poll: one
warning when that starts, one notice when LISTEN is back, ``jobd_listener_connected`` and
`jobd status` in between.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Final

import psycopg
import structlog
from psycopg import sql

from jobd import pipes
from jobd.db import (
    DEFAULT_SESSION,
    ManagedConnection,
    SessionSettings,
    application_name,
    is_pooled,
    redact,
)
from jobd.errors import DatabaseUnavailable
from jobd.eventloop import SelectLoop
from jobd.wakeup import Wakeup, channel_name, parse_payload

log = structlog.get_logger("jobd.wakeup")

PROBE_INTERVAL = 60.0  # seconds a quiet connection goes unprobed
CLOSE_WAIT = 2.0  # on exit, how long to wait for the thread (a connection attempt: up to 5 s)
LISTENING: Final = "listening"  # handed over when a LISTEN starts: what came before was missed


class Listener:
    """The LISTEN connection (``jobd.db.ManagedConnection``: reconnects with backoff), served
    by a thread; :meth:`take` hands the loop what arrived."""

    def __init__(self, url: str, schema: str, *, listen_url: str | None = None,
                 session: SessionSettings = DEFAULT_SESSION, node: str | None = None,
                 probe_interval: float = PROBE_INTERVAL) -> None:
        self.schema = schema
        self.url = listen_url or url
        self.probe_interval = probe_interval
        # listen_url is meant to be direct whatever database.pooler says of url; `auto`
        # still notices a pooler there (and _listen refuses it).
        listen_session = replace(session, pooler="auto") if listen_url else session
        self.link = ManagedConnection(self.url, schema, application_name("listener", node=node),
                                      on_connect=self._listen,
                                      on_failed_attempt=self._unavailable,
                                      label="listen connection", session=listen_session)
        self.said_unavailable = False
        # From the thread to the loop: deque's append and popleft are atomic.
        self._arrived: deque[Wakeup | str] = deque()
        self._failure: BaseException | None = None
        self._news_r, self._news_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        for fd in (self._news_r, self._news_w, self._stop_r, self._stop_w):
            os.set_blocking(fd, False)
        self._thread: threading.Thread | None = None

    # --- on the loop ----------------------------------------------------------------------

    def start(self, loop: SelectLoop) -> None:
        loop.register(self._news_r, pipes.drain)
        self._thread = threading.Thread(target=self._serve, name="jobd-listener", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self.link.conn is not None

    def take(self) -> tuple[list[Wakeup], bool]:
        """What arrived since the last call: the wake-ups, and whether a LISTEN started
        meanwhile (the notifications sent before it were not heard)."""
        if self._failure is not None:
            # A defect, not a database error (the link handles those): end the supervisor.
            raise self._failure
        wakeups: list[Wakeup] = []
        listening = False
        while self._arrived:
            item = self._arrived.popleft()
            if isinstance(item, Wakeup):
                wakeups.append(item)
            else:
                listening = True
        return wakeups, listening

    def close(self) -> None:
        """End the thread and its connection. A thread inside a connection attempt is not
        waited for beyond ``CLOSE_WAIT``: it dies with the process."""
        if self._thread is None:
            self.link.close()
            return
        pipes.poke(self._stop_w)
        self._thread.join(CLOSE_WAIT)

    # --- on the thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._stop_r, selectors.EVENT_READ)
                self._listen_until_stopped(selector)
        except BaseException as exc:  # carried to the loop, raised there
            self._failure = exc
            pipes.poke(self._news_w)
        finally:
            self.link.close()

    def _listen_until_stopped(self, selector: selectors.BaseSelector) -> None:
        next_probe = 0.0
        while True:
            conn = self.link.conn
            if conn is None:
                if self._ensure():
                    self._hand_over(LISTENING)
                    next_probe = time.monotonic() + self.probe_interval
                    continue
                if selector.select(max(0.0, self.link.ready_at() - time.monotonic())):
                    return
                continue
            fd = conn.fileno()
            selector.register(fd, selectors.EVENT_READ)
            try:
                ready = selector.select(max(0.0, next_probe - time.monotonic()))
            finally:
                selector.unregister(fd)
            if any(key.fd == self._stop_r for key, _ in ready):
                return
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.probe_interval
                self._probe()
            # After a probe too: what arrived during its statement waits in psycopg.
            self._receive()

    def _ensure(self) -> bool:
        """Connect and LISTEN if the backoff allows; True on a new connection."""
        opened = self.link.ensure()
        if opened and self.said_unavailable:
            self.said_unavailable = False
            log.info("LISTEN available again; notifications wake workers", url=redact(self.url))
        return opened

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

    def _receive(self) -> None:
        """The notifications that have arrived, without blocking."""
        conn = self.link.conn
        if conn is None:
            return
        heard = False
        try:
            for notify in conn.notifies(timeout=0, stop_after=None):
                wakeup = parse_payload(notify.payload)
                if wakeup is not None:
                    self._arrived.append(wakeup)
                    heard = True
        except psycopg.Error as exc:
            self.link.lost("listen", exc)
        if heard:
            pipes.poke(self._news_w)

    def _probe(self) -> None:
        """Probe a quiet connection, so a dead one is noticed and replaced."""
        self.link.run("listen probe", lambda conn: conn.execute("SELECT 1"))

    def _hand_over(self, item: Wakeup | str) -> None:
        self._arrived.append(item)
        pipes.poke(self._news_w)

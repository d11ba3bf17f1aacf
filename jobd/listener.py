"""The supervisor's LISTEN connection: turns enqueue notifications (jobd.wakeup) into lane
wake-ups for the supervisor's loop.

The loop reads what arrived, without blocking, whenever its ``select`` finds the connection
readable. Everything that can wait on the network happens on a thread of its own: the
connection attempts (each up to the 5 s connect timeout, then backoff), the LISTEN, and the
probe that notices a connection gone quiet (a statement, which waits up to the 30 s of
``tcp_user_timeout`` behind a partition). The connection belongs to one side at a time: the
loop hands it to the thread to be opened or probed and takes it back when the thread pokes its
pipe, so a listen host that does not answer cannot hold up the loop's relays, reaping or
signals, and the path of a notification is the loop's alone.

Notifications are a hint, never the only path: while the connection is away the supervisor's
fallback poll covers the gap, and each new connection asks it to look at every lane (what was
sent before the LISTEN was not heard). A pooler in transaction mode cannot hold a LISTEN (the
server session it was issued on goes to other clients), so the listener connects to
``database.listen_url`` when set, and treats a connection that turns out to be pooled as
unavailable. While it is unavailable the node runs on the fallback poll: one warning when that
starts, one notice when LISTEN is back, ``jobd_listener_connected`` and `jobd status` in
between.
"""

from __future__ import annotations

import math
import os
import queue
import select
import threading
import time
from dataclasses import replace

import psycopg
import structlog

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
from jobd.queries import query, with_identifiers
from jobd.wakeup import Wakeup, channel_name, parse_payload

log = structlog.get_logger("jobd.wakeup")

PROBE_INTERVAL = 60.0  # seconds a quiet connection goes unprobed
CLOSE_WAIT = 2.0  # on exit, how long to wait for the thread (a connection attempt: up to 5 s)


class Listener:
    """The LISTEN connection (``jobd.db.ManagedConnection``: reconnects with backoff), read on
    the loop, opened and probed on a thread."""

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
        self._loop: SelectLoop | None = None
        self._with_loop = False  # whose the connection is: the loop's or the thread's
        self._fd: int | None = None  # the connection's, while the loop's select watches it
        self._next_probe = math.inf
        # Counted on the thread, compared on the loop: each side writes its own.
        self._opened = 0
        self._opened_seen = 0
        self._failure: BaseException | None = None
        self._errands: queue.SimpleQueue[bool] = queue.SimpleQueue()  # False: end the thread
        self._back_r, self._back_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        for fd in (self._back_r, self._back_w, self._stop_r, self._stop_w):
            os.set_blocking(fd, False)
        self._thread: threading.Thread | None = None

    # --- on the loop ----------------------------------------------------------------------

    def start(self, loop: SelectLoop) -> None:
        self._loop = loop
        loop.register(self._back_r, self._came_back)
        self._thread = threading.Thread(target=self._serve, name="jobd-listener", daemon=True)
        self._thread.start()
        self._hand_to_thread()

    @property
    def connected(self) -> bool:
        return self.link.conn is not None

    def take(self) -> tuple[list[Wakeup], bool]:
        """The wake-ups that have arrived, without blocking, and whether a LISTEN started
        since the last call (the notifications sent before it were not heard)."""
        if self._failure is not None:
            # A defect, not a database error (the link handles those): end the supervisor.
            raise self._failure
        opened = self._opened
        listening, self._opened_seen = opened != self._opened_seen, opened
        conn = self.link.conn
        if not self._with_loop or conn is None:
            return [], listening
        wakeups = []
        try:
            for notify in conn.notifies(timeout=0, stop_after=None):
                wakeup = parse_payload(notify.payload)
                # None: a payload this version cannot read (a newer jobd's control, anyone's
                # NOTIFY on the channel). Dropped without a log line per notification: a
                # wake-up is a hint, and the lanes' fallback poll finds the work all the same.
                if wakeup is not None:
                    wakeups.append(wakeup)
        except psycopg.Error as exc:
            self.link.lost("listen", exc)
            self._hand_to_thread()
            return wakeups, listening
        if time.monotonic() >= self._next_probe:
            self._hand_to_thread()
        return wakeups, listening

    def close(self) -> None:
        """End the thread and close the connection. A thread inside a connection attempt is
        not waited for beyond ``CLOSE_WAIT``: it ends with the process."""
        if self._thread is not None:
            self._errands.put(False)
            pipes.poke(self._stop_w)
            self._thread.join(CLOSE_WAIT)
            if self._thread.is_alive():
                return
        self.link.close()

    def _hand_to_thread(self) -> None:
        """To be opened (again) or probed."""
        if self._fd is not None and self._loop is not None:
            self._loop.unregister(self._fd)
        self._fd = None
        self._with_loop = False
        self._errands.put(True)

    def _came_back(self, fd: int) -> None:
        pipes.drain(fd)
        conn = self.link.conn
        if self._with_loop or conn is None or self._loop is None:
            return  # the thread's failure (raised by take) or its exit
        self._with_loop = True
        self._fd = conn.fileno()
        self._loop.register(self._fd, lambda _fd: None)  # take() reads, every loop turn
        self._next_probe = time.monotonic() + self.probe_interval

    # --- on the thread --------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while self._errands.get():
                if self._open_or_probe():
                    pipes.poke(self._back_w)
        except BaseException as exc:  # carried to the loop, raised there
            self._failure = exc
            pipes.poke(self._back_w)

    def _open_or_probe(self) -> bool:
        """Probe the connection, then open one if there is none, retrying with backoff
        until one opens (True) or the listener is closed (False)."""
        if self.link.conn is not None:
            self.link.run("listen probe", lambda conn: conn.execute(query("connection_probe")))
        while self.link.conn is None:
            if self._ensure():
                self._opened += 1
                return True
            stop, _, _ = select.select([self._stop_r], [], [],
                                       max(0.0, self.link.ready_at() - time.monotonic()))
            if stop:
                return False
        return True

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
        conn.execute(with_identifiers("listen_qualified", channel=channel_name(self.schema)))

    def _unavailable(self, error: str) -> None:
        """A failed attempt to connect and LISTEN: said once per outage, then quietly
        retried with the connection's backoff."""
        if self.said_unavailable:
            log.debug("LISTEN still unavailable", error=error)
            return
        self.said_unavailable = True
        log.warning("LISTEN unavailable; waking workers on the fallback poll",
                    url=redact(self.url), error=error)

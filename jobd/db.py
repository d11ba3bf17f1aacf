"""Opening connections to the jobd schema.

jobd's own connections set ``search_path`` to the jobd schema at connect time, so the named
queries in ``jobd/sql/queries.sql`` use unqualified names and work for any schema name.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobd.errors import DatabaseUnavailable, UsageError
from jobd.queries import query

T = TypeVar("T")
log = structlog.get_logger("jobd.db")
RECONNECT_DELAY = 0.5  # seconds before the second attempt after a loss; doubles per failure
RECONNECT_DELAY_CAP = 30.0
_OPEN_TRANSACTION = (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.INERROR)

DEFAULT_SCHEMA = "jobd"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
CONNECT_TIMEOUT_SECONDS = 5
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
             "keepalives_count": 3, "tcp_user_timeout": 30_000}

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def validate_schema(schema: str) -> str:
    if not _SCHEMA_NAME.fullmatch(schema):
        raise UsageError(
            f"invalid schema name {schema!r}: use lower-case letters, digits and _ "
            "(at most 63, not starting with a digit)"
        )
    return schema


def resolve_url(cli_url: str | None, config_url: str | None) -> str:
    """``--database-url``, else ``JOBD_DATABASE_URL``, else the config's ``database.url``."""
    return cli_url or os.environ.get("JOBD_DATABASE_URL") or config_url or DEFAULT_URL


def conninfo(url: str, schema: str | None, application_name: str = "jobd") -> str:
    """Connection parameters for ``url``. With a ``schema``, the connection's search_path is
    that schema alone (jobd's own connections: they see only jobd's objects and pg_catalog);
    with None it is left to the server, database and role defaults (handlers' connections)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise UsageError(f"invalid database URL: {first_line(exc)}") from None
    params.setdefault("application_name", application_name)
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
    # A peer that vanished without closing (a partition, a frozen host) must not hold a
    # blocking call for the kernel's default of hours: keepalives notice it in about 25 s,
    # and unacknowledged writes give up after 30 s.
    for key, value in KEEPALIVE.items():
        params.setdefault(key, value)
    if schema is not None:
        options = params.get("options", "")
        params["options"] = f"{options} -c search_path={validate_schema(schema)}".strip()
    return make_conninfo(**params)


def connection_lost(conn: psycopg.Connection) -> bool:
    """Whether a failed statement took ``conn`` with it. A deadlock, a serialization
    failure or a timeout is an OperationalError too, but leaves the connection usable."""
    return conn.closed or conn.broken


def connect(
    url: str,
    schema: str = DEFAULT_SCHEMA,
    *,
    autocommit: bool = True,
    application_name: str = "jobd",
) -> psycopg.Connection:
    """A connection whose search_path is ``schema``; autocommit unless asked otherwise."""
    try:
        return psycopg.connect(
            conninfo(url, schema, application_name), autocommit=autocommit
        )
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to the database ({redact(url)}): {first_line(exc)}"
        ) from None


def redact(url: str) -> str:
    """The URL with any password replaced, fit for an error message or a log."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparseable URL>"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**params)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# The supervisor's statements are bounded, so no duty can hold up its loop (and with it every
# lane of the node) for long.
SUPERVISOR_STATEMENT_TIMEOUT_MS = 10_000
SUPERVISOR_LOCK_TIMEOUT_MS = 2_000


def bound_session(conn: psycopg.Connection) -> None:
    """Session settings of the supervisor's connection (``on_connect``)."""
    conn.execute(query("supervisor_session"), {
        "statement_timeout": str(SUPERVISOR_STATEMENT_TIMEOUT_MS),
        "lock_timeout": str(SUPERVISOR_LOCK_TIMEOUT_MS)})


class ManagedConnection:
    """One of jobd's long-lived connections (the supervisor's, a worker's, the listener's):
    opened on demand, reopened with backoff, and the one place that tells a statement that
    failed from a connection that was lost.

    After a loss the next attempt is immediate; each failed attempt doubles the wait, from
    ``RECONNECT_DELAY`` up to ``RECONNECT_DELAY_CAP``, until one succeeds. ``on_connect`` runs
    on each new connection (session settings, LISTEN); if it fails the connection counts as
    failed. ``pause_after_failure`` keeps a caller that would retry a failed statement at
    once (a worker's loop) from spinning on it.
    """

    def __init__(self, url: str, schema: str, application_name: str, *,
                 on_connect: Callable[[psycopg.Connection], object] | None = None,
                 on_lost: Callable[[], object] | None = None,
                 pause_after_failure: float = 0.0, label: str = "database connection") -> None:
        self.url = url
        self.schema = schema
        self.application_name = application_name
        self.on_connect = on_connect
        self.on_lost = on_lost
        self.pause_after_failure = pause_after_failure
        self.label = label  # names its log events: "<label> lost", "<label> restored"
        self.conn: psycopg.Connection | None = None
        self.retry_at = 0.0  # monotonic: no connection attempt before
        self.usable_at = 0.0  # monotonic: no statement before (after a failed one)
        self.delay = RECONNECT_DELAY
        self.connected_once = False

    def ensure(self) -> bool:
        """Connect if there is no connection and the backoff allows; True when this call
        opened a new one."""
        if self.conn is not None or time.monotonic() < self.retry_at:
            return False
        try:
            conn = connect(self.url, self.schema, application_name=self.application_name)
        except DatabaseUnavailable as exc:
            self._failed_attempt(str(exc))
            return False
        try:
            if self.on_connect is not None:
                self.on_connect(conn)
        except psycopg.Error as exc:
            conn.close()
            self._failed_attempt(first_line(exc))
            return False
        self.conn = conn
        self.delay = RECONNECT_DELAY
        if self.connected_once:
            log.info(f"{self.label} restored", connection=self.application_name)
        self.connected_once = True
        return True

    def _failed_attempt(self, error: str) -> None:
        log.warning("database unavailable", connection=self.application_name, error=error,
                    retry_in=round(self.delay, 1))
        self.retry_at = time.monotonic() + self.delay
        self.delay = min(self.delay * 2, RECONNECT_DELAY_CAP)

    def ready_at(self) -> float:
        """When the connection may next be used (monotonic): a connection attempt or, after
        a failed statement, the end of its pause. Callers wait at least until then."""
        return self.retry_at if self.conn is None else self.usable_at

    def run(self, what: str, operation: Callable[[psycopg.Connection], T]) -> T | None:
        """``operation(conn)``, or None when there is no connection or it failed (logged)."""
        if self.conn is None or time.monotonic() < self.usable_at:
            return None
        try:
            return operation(self.conn)
        except psycopg.Error as exc:
            self.failed(what, exc)
            return None

    def failed(self, what: str, exc: psycopg.Error) -> None:
        """Account for a statement of ``what`` that raised ``exc``."""
        assert self.conn is not None
        if connection_lost(self.conn):
            self.lost(what, exc)
            return
        # A deadlock, a serialization failure, a timeout: the statement failed, the
        # connection did not. What the caller retries decides what still applies.
        log.error("database statement failed", connection=self.application_name,
                  during=what, error=first_line(exc))
        self.usable_at = time.monotonic() + self.pause_after_failure
        if self.conn.info.transaction_status in _OPEN_TRANSACTION:
            try:
                self.conn.rollback()
            except psycopg.Error as rollback_failed:
                self.lost(what, rollback_failed)

    def lost(self, what: str, exc: BaseException) -> None:
        log.warning(f"{self.label} lost", connection=self.application_name,
                    during=what, error=first_line(exc))
        self.close()
        self.retry_at = time.monotonic()
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None

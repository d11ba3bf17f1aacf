"""Where jobd.testing's helpers run jobd's statements: on the test's own connection, or on
connections of their own to a database URL.

On the test's connection they see, and write into, the test's open transaction: jobs its
code enqueued without committing are there to assert on and to run, and the test's rollback
undoes everything the helpers did. jobd's queue statements are written for connections whose
search_path is the jobd schema (jobd/queries.py); on a test's connection the helpers switch
the search_path for those statements alone and put the test's own back before any handler
runs, so handler code resolves names exactly as the test's code does. Both switches are local
to a transaction, so the test's own setting, local or session-level, is what the
transaction's end leaves; on an autocommit connection between transactions, jobd's
statements run in a transaction of their own, so nothing is left on the server session (a
transaction-mode pooler lends it to other clients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from jobd.db import (
    DEFAULT_SCHEMA,
    SERVER_DEFAULTS,
    connect,
    conninfo,
    users_connection_reset,
    users_connection_setup,
    validate_schema,
)
from jobd.errors import JobdError
from jobd.outcomes import first_line_of
from jobd.queries import query

Target = psycopg.Connection | str


@dataclass
class Session:
    """The connection jobd's statements run on, and how handlers get theirs."""

    conn: psycopg.Connection
    schema: str
    # The database URL when the helpers opened their own connections; None on a test's.
    url: str | None
    # The test connection's own search_path, read once (see jobd_statements).
    callers_path: str | None = None
    # With a URL: the transactional handlers' connection, opened on first use.
    handler_conn: psycopg.Connection | None = None

    @property
    def on_callers_connection(self) -> bool:
        return self.url is None

    @contextlib.contextmanager
    def jobd_statements(self) -> Iterator[psycopg.Connection]:
        """``conn`` with the jobd schema as its search_path, reading rows as tuples, for
        jobd's own statements."""
        with schema_checked(self.schema):
            if not self.on_callers_connection:
                yield self.conn
                return
            with self._switched() as conn:
                yield conn

    @contextlib.contextmanager
    def _switched(self) -> Iterator[psycopg.Connection]:
        if not _in_transaction_block(self.conn):
            # An autocommit connection between transactions: the switch and the statements
            # go in one transaction of their own, the switch local to it. As three
            # transactions (a session-level switch, the statements, the switch back), a
            # transaction-mode pooler ran them on whichever server sessions it lent: the
            # statements met a session without the jobd schema ("jobd's schema is
            # missing"), and other clients got sessions whose search_path was jobd's.
            with _reading_tuples(self.conn), self.conn.transaction():
                self.conn.execute(query("testing_set_search_path"),
                                  {"path": self.schema, "local": True})
                yield self.conn
            return
        with _reading_tuples(self.conn):
            if self.callers_path is None:
                row = self.conn.execute(query("testing_session_settings")).fetchone()
                assert row is not None
                self.callers_path = str(row[0])
            self.conn.execute(query("testing_set_search_path"),
                              {"path": self.schema, "local": True})
            try:
                yield self.conn
            finally:
                # An aborted transaction refuses every statement; its rollback restores the
                # search_path by itself.
                if self.conn.info.transaction_status != pq.TransactionStatus.INERROR:
                    self.conn.execute(query("testing_set_search_path"),
                                      {"path": self.callers_path, "local": True})

    @contextlib.contextmanager
    def handler_connection(self) -> Iterator[psycopg.Connection]:
        """The connection a transactional handler runs on: the test's own (its transaction
        becomes a savepoint in the test's), else one with the role's search_path, as the
        worker's handler pool opens them, kept for the session and reset after each job as
        the pool resets them (db.users_connection_reset)."""
        if self.on_callers_connection:
            with _settings_kept(self.conn):
                yield self.conn
            return
        assert self.url is not None
        if self.handler_conn is None or self.handler_conn.closed or self.handler_conn.broken:
            self.handler_conn = psycopg.connect(
                conninfo(self.url, None, "jobd.testing handler"), autocommit=True)
            # Through a pooler, no automatic prepared statements, as in the worker's pool.
            users_connection_setup(self.url, SERVER_DEFAULTS)(self.handler_conn)
        try:
            yield self.handler_conn
        finally:
            if not self.handler_conn.closed and not self.handler_conn.broken:
                users_connection_reset(self.url, SERVER_DEFAULTS)(self.handler_conn)

    def handler_savepoint(self) -> HandlerSavepoint:
        """A savepoint for a handler's call, on the test's connection inside its open
        transaction; none elsewhere (a URL's connections are not the handler's, and outside
        a transaction each of the handler's statements stands alone). Around a
        transactional run it marks the test's transaction, so that a handler that ends it
        is told from one that failed inside its own savepoint."""
        if (not self.on_callers_connection
                or self.conn.info.transaction_status != pq.TransactionStatus.INTRANS):
            return HandlerSavepoint(None)
        self.conn.execute(query("testing_handler_savepoint"), prepare=False)
        return HandlerSavepoint(self.conn)

    def close(self) -> None:
        if self.handler_conn is not None:
            self.handler_conn.close()


@dataclass
class HandlerSavepoint:
    """What a handler run on the test's connection left of the test's transaction.

    On a worker such a handler writes through the application's own connections: a statement
    of its that fails aborts the application's transaction, never the one jobd records the
    job's outcome in. On the test's connection both are the test's transaction, so the
    handler runs in a savepoint of it, and :meth:`close` rolls back to the savepoint when the
    handler left the transaction aborted: the outcome can then be recorded as a worker
    records it."""

    conn: psycopg.Connection | None
    # The handler's statement had aborted the transaction: rolled back to the savepoint,
    # which undid the handler's writes on the test's connection.
    rolled_back: bool = False
    # The handler ended the test's transaction itself (a COMMIT or ROLLBACK on the test's
    # connection); the savepoint ended with it.
    ended: bool = False
    # ... and went on in another transaction: what the missing savepoint's release said.
    missing: psycopg.Error | None = None
    # The handler closed the test's connection (``conn.close()``, or ``with conn:`` around
    # its work, which commits and closes): the transaction went with it.
    closed: bool = False

    def close(self) -> None:
        """Release the savepoint, or roll back to it if the transaction is aborted."""
        if self.conn is None:
            return
        if self.conn.closed:
            self.ended = self.closed = True
            return
        status = self.conn.info.transaction_status
        if status == pq.TransactionStatus.IDLE:
            self.ended = True
            return
        aborted = status == pq.TransactionStatus.INERROR
        try:
            self.conn.execute(query("testing_rollback_to_handler_savepoint" if aborted
                                    else "testing_release_handler_savepoint"), prepare=False)
        except psycopg.errors.InvalidSavepointSpecification as exc:
            self.ended, self.missing = True, exc
            return
        self.rolled_back = aborted


@contextlib.contextmanager
def schema_checked(schema: str) -> Iterator[None]:
    """jobd's statements in a database where ``schema`` holds none of jobd's tables (not
    migrated, or another schema) fail with what that means, not with the first table name
    the statement happened to reach (``relation "lane_pauses" does not exist``)."""
    try:
        yield
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction) as exc:
        raise JobdError(
            f"jobd's schema {schema!r} is missing or incomplete in this database "
            f"({first_line_of(str(exc))}): run `jobd migrate` on it first (or "
            f"jobd.migrate.migrate(conn, {schema!r})), or give the schema it uses (schema=, "
            f"or database.schema in the config)") from exc


def _in_transaction_block(conn: psycopg.Connection) -> bool:
    """Whether the next statement runs in a transaction that outlasts it: the caller's open
    one, or the one a connection that is not autocommit begins with it. There jobd sets the
    search_path locally (SET LOCAL), so the transaction's end brings back the caller's
    setting as the caller made it, local or session-level; a session-level change would
    turn a caller's SET LOCAL into a session setting at the commit."""
    return not conn.autocommit or conn.info.transaction_status == pq.TransactionStatus.INTRANS


@contextlib.contextmanager
def _reading_tuples(conn: psycopg.Connection) -> Iterator[None]:
    """The test's connection reading rows as tuples, then its own row factory again: jobd's
    statements read their rows by position, a test's may be dicts (``dict_row``), and its
    handlers get the connection as the test configured it."""
    row_factory = conn.row_factory
    conn.row_factory = tuple_row
    try:
        yield
    finally:
        conn.row_factory = row_factory


@contextlib.contextmanager
def _settings_kept(conn: psycopg.Connection) -> Iterator[None]:
    """Inside an open transaction, what a transactional run sets for the rest of it
    (record_effect_key: application_name and two timeouts, all local) is put back after."""
    if conn.info.transaction_status != pq.TransactionStatus.INTRANS:
        yield  # the run's own transaction ends its local settings
        return
    row = conn.cursor(row_factory=tuple_row).execute(query("testing_session_settings")).fetchone()
    assert row is not None
    try:
        yield
    finally:
        if conn.info.transaction_status == pq.TransactionStatus.INTRANS:
            conn.execute(query("testing_restore_session_settings"), {
                "application_name": row[1], "idle_timeout": row[2],
                "statement_timeout": row[3]})


@contextlib.contextmanager
def open_session(target: Target, schema: str | None = None) -> Iterator[Session]:
    """A session on ``target``: a psycopg connection (used as it is, in whatever
    transaction it has open) or a database URL (an autocommit connection of its own)."""
    schema = validate_schema(schema or DEFAULT_SCHEMA)
    if isinstance(target, psycopg.Connection):
        yield Session(target, schema, None)
        return
    if not isinstance(target, str):
        raise TypeError(f"expected a psycopg connection or a database URL, not {target!r}")
    with connect(target, schema, autocommit=True) as conn:
        session = Session(conn, schema, target)
        try:
            yield session
        finally:
            session.close()

"""jobd's named queries as prepared statements, pipelined over libpq: the worker's hot path.

psycopg's pipeline mode spends about 15 us of client CPU per statement (a cursor, query
conversion, a send attempt and result bookkeeping per statement). A worker that settles and
claims one job at a time runs four statements per job, and on a small machine that CPU is taken
from the database server it shares the cores with. Here the statements go through psycopg's
libpq wrapper (``psycopg.pq``) directly: prepared once per connection, sent together, with one
Sync at the end. Parameters and results are adapted by psycopg's own ``Transformer``, so values
come out exactly as they do from a cursor.

Transactions: the connection must be in autocommit mode and idle. Everything sent in one call
is one implicit transaction unless it contains explicit ``BEGIN``/``COMMIT`` commands; the first
statement that fails makes the server skip the rest, an explicit transaction left open by the
failure is rolled back, and the error is raised. Parameters are converted before anything is
sent, so a value the server cannot take fails without touching the connection. If the exchange
is cut short, the connection is closed; whatever the server had already received still runs,
so a claim sent with outcomes may have claimed jobs nobody was told about (the worker fails
those as an attempt when it reconnects, see ``worker.py``; otherwise their leases expire).

Through a transaction-mode pooler (a :class:`jobd.db.PooledConnection`) nothing may outlive
the exchange on the server session, which the pooler lends to other clients between
transactions: statements go unnamed (Parse, Bind, Execute each time, so no prepared statement
is left behind nor expected), and each transaction of the exchange starts with the
connection's settings (``session_local``: search_path, timeouts) as transaction-local ones.
One Sync ends the exchange, so the pooler keeps it on one server session throughout.

Plans age: a session's prepared statements are dropped and prepared again once they are
:data:`PLAN_LIFETIME` old, in the next exchange. PostgreSQL keeps a prepared statement's
generic plan until something invalidates it (autovacuum or ANALYZE of a table it reads,
DDL), and a plan made while the jobs table was small and clean (reading the heap whole for
the rows of a batch of ids) went on being used while a held xmin horizon bloated the table,
until autovacuum next processed it a minute or more later: every claim and completion read
the whole heap (docs/design/queue.md, "Plans that age").
"""

from __future__ import annotations

import functools
import re
import select
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import adapt, errors, pq
from psycopg.abc import Buffer, Transformer
from psycopg.adapt import PyFormat

from jobd.db import NoAnswer, PooledConnection
from jobd.queries import query

ExecStatus = pq.ExecStatus

# Transaction commands that may appear between statements.
BEGIN = "BEGIN"
COMMIT = "COMMIT"
_COMMANDS = {BEGIN: b"BEGIN", COMMIT: b"COMMIT"}

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_STATEMENT_PREFIX = "jobd_"
# Seconds a session keeps the statements it prepared before preparing them again (above): a
# plan then reflects the table's size of at most this long ago. Each renewal costs a few
# plannings per statement (PostgreSQL plans the first executions for their parameters).
PLAN_LIFETIME = 10.0


@dataclass(frozen=True, slots=True)
class Statement:
    """A named query in the form the protocol wants: ``$n`` placeholders, names in order."""

    name: bytes
    text: bytes
    params: tuple[str, ...]


@functools.cache
def statement(name: str) -> Statement:
    """The named query ``name`` (from ``jobd/sql/queries.sql``) as a prepared statement."""
    params: list[str] = []

    def positional(match: re.Match[str]) -> str:
        if match[1] not in params:
            params.append(match[1])
        return f"${params.index(match[1]) + 1}"

    text = _PLACEHOLDER.sub(positional, query(name))
    if "%" in _PLACEHOLDER.sub("", query(name)).replace("%%", ""):
        raise ValueError(f"query {name!r} has a placeholder other than %(name)s")
    return Statement((_STATEMENT_PREFIX + name).encode(), text.replace("%%", "%").encode(),
                     tuple(params))


@dataclass(slots=True)
class _Session:
    """The statements prepared on one server session, and since when (monotonic)."""

    names: set[bytes]
    since: float

    def aged(self, now: float) -> list[bytes]:
        """The names to deallocate now, forgotten here, if they are PLAN_LIFETIME old."""
        if now - self.since < PLAN_LIFETIME:
            return []
        names, self.names, self.since = sorted(self.names), set(), now
        return names


# Each server session's prepared statements, by the libpq connection that holds it.
_sessions: weakref.WeakKeyDictionary[pq.abc.PGconn, _Session] = weakref.WeakKeyDictionary()

Step = tuple[str, Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class WhileWaiting:
    """Other work for the caller's thread while the server answers: ``act`` runs each time
    ``fd`` is readable before the answer is. It must not use the connection, and it must
    not raise for anything but a bug (the exchange is then cut short, as by a signal)."""

    fd: int
    act: Callable[[], None]


def run(conn: psycopg.Connection, steps: Sequence[Step],
        binary: frozenset[str] = frozenset(),
        while_waiting: WhileWaiting | None = None) -> list[list[tuple[Any, ...]]]:
    """Run ``steps`` in one round trip and return each step's rows (empty for commands).

    A step is a query name with its parameters, or ``(BEGIN, None)`` / ``(COMMIT, None)``.
    Queries named in ``binary`` return their results in binary format. If the exchange is cut
    short (the network fails, a signal interrupts it), the connection is closed: its protocol
    state is unknown, and the caller's reconnect logic takes it from there. With
    ``while_waiting``, the wait for the server (mostly its commit's flush) also watches that
    descriptor and does its work, instead of blocking the thread.
    """
    with conn.lock:
        pgconn = conn.pgconn
        _check_ready(conn, pgconn)
        transformer = adapt.Transformer(conn)
        # Parameters are converted before anything is sent: a value PostgreSQL cannot take
        # (a NUL byte in a string, say) fails here and leaves the connection as it was.
        if isinstance(conn, PooledConnection):
            prepared: set[bytes] = set()  # nothing is prepared on a borrowed session
            messages = _pooled_messages(transformer, steps, conn.session_gucs, binary)
        else:
            now = time.monotonic()
            session = _sessions.setdefault(pgconn, _Session(set(), now))
            messages = [_Message(b"DEALLOCATE " + name, command=True, internal=True)
                        for name in session.aged(now)]
            prepared = session.names
            messages += _messages(transformer, steps, prepared, binary)
        waiter = _Waiter(pgconn, while_waiting, getattr(conn, "reply_timeout", None))
        try:
            pgconn.enter_pipeline_mode()
            _send(pgconn, messages)
            pgconn.pipeline_sync()
            _flush(pgconn, waiter)
            results = [_result_of(pgconn, waiter) for _ in messages]
            _read_sync(pgconn, waiter)
            pgconn.exit_pipeline_mode()
        except BaseException:
            pgconn.finish()
            raise
        _dispatch_notifications(pgconn)
        error = _first_error(conn, messages, results, prepared)
        if pgconn.transaction_status == pq.TransactionStatus.INERROR:
            _rollback(conn, pgconn)
        if error is not None:
            setattr(error, _STEPS_DONE, _rows(transformer, messages, results))
            raise error
        return _rows(transformer, messages, results)


# The attribute of a statement's error that holds the rows of the steps run before it.
_STEPS_DONE = "_jobd_steps_done"


def steps_done(error: psycopg.Error) -> list[list[tuple[Any, ...]]] | None:
    """The rows of the steps of :func:`run` that the server ran before the step that raised
    ``error``, one entry per step as :func:`run` returns them; None for an error that did
    not come back as a step's result (a lost connection: what ran is unknown). A COMMIT
    among them committed: the caller can tell what it wrote from what failed after."""
    done = getattr(error, _STEPS_DONE, None)
    return done if isinstance(done, list) else None


def _rows(transformer: Transformer, messages: Sequence[_Message],
          results: Sequence[pq.abc.PGresult]) -> list[list[tuple[Any, ...]]]:
    """Each step's rows, up to the first that failed (or was skipped for an earlier
    failure: the rest of the pipeline is aborted)."""
    rows: list[list[tuple[Any, ...]]] = []
    for message, result in zip(messages, results, strict=True):
        if result.status in (ExecStatus.FATAL_ERROR, ExecStatus.PIPELINE_ABORTED):
            break
        if message.returns:
            transformer.set_pgresult(result)
            rows.append(transformer.load_rows(0, result.ntuples, tuple)
                        if result.status == ExecStatus.TUPLES_OK else [])
    return rows


def _check_ready(conn: psycopg.Connection, pgconn: pq.abc.PGconn) -> None:
    if conn.closed:
        raise psycopg.OperationalError("the connection is closed")
    if not conn.autocommit:
        raise psycopg.ProgrammingError("jobd's fast path needs an autocommit connection")
    if (pgconn.transaction_status != pq.TransactionStatus.IDLE
            or pgconn.pipeline_status != pq.PipelineStatus.OFF):
        raise psycopg.ProgrammingError("jobd's fast path needs an idle connection")


@dataclass(frozen=True, slots=True)
class _Message:
    """One message to queue, yielding one result: a transaction command, a prepare (``text``
    set), the execution of a prepared statement (``params`` set) or of an unnamed one (both
    set)."""

    name: bytes
    text: bytes | None = None  # the statement to prepare, or to run unnamed with params
    params: Sequence[Buffer | None] | None = None
    result_format: pq.Format = pq.Format.TEXT
    command: bool = False  # a transaction command, sent unprepared
    internal: bool = False  # the exchange's own (session settings): no rows for the caller

    @property
    def prepares(self) -> bool:
        return self.text is not None and self.params is None

    @property
    def returns(self) -> bool:
        """Whether the caller gets this message's rows (one list per step)."""
        return not self.prepares and not self.internal


def _messages(transformer: Transformer, steps: Sequence[Step], prepared: set[bytes],
              binary: frozenset[str]) -> list[_Message]:
    """The messages for ``steps``, parameters already converted, with a prepare before the
    first use of each statement this session has not prepared yet."""
    messages: list[_Message] = []
    preparing: set[bytes] = set()
    for name, params in steps:
        if name in _COMMANDS:
            messages.append(_Message(_COMMANDS[name], command=True))
            continue
        stmt = statement(name)
        if stmt.name not in prepared and stmt.name not in preparing:
            messages.append(_Message(stmt.name, text=stmt.text))
            preparing.add(stmt.name)
        values = [(params or {})[param] for param in stmt.params]
        dumped = transformer.dump_sequence(values, [PyFormat.TEXT] * len(values))
        messages.append(_Message(stmt.name, params=list(dumped), result_format=(
            pq.Format.BINARY if name in binary else pq.Format.TEXT)))
    return messages


def _pooled_messages(transformer: Transformer, steps: Sequence[Step],
                     gucs: Mapping[str, str], binary: frozenset[str]) -> list[_Message]:
    """The messages for ``steps`` through a transaction-mode pooler: every statement unnamed,
    and the session settings at the start of each transaction (first, and after each
    COMMIT that more statements follow)."""
    names = list(gucs)
    settings = _unnamed(transformer, "session_local",
                        {"names": names, "values": [gucs[n] for n in names]}, internal=True)
    messages = [settings]
    for index, (name, params) in enumerate(steps):
        if name in _COMMANDS:
            messages.append(_Message(_COMMANDS[name], command=True))
            if name == COMMIT and index < len(steps) - 1:
                messages.append(settings)
            continue
        messages.append(_unnamed(transformer, name, params, binary=name in binary))
    return messages


def _unnamed(transformer: Transformer, name: str, params: Mapping[str, Any] | None, *,
             binary: bool = False, internal: bool = False) -> _Message:
    stmt = statement(name)
    values = [(params or {})[param] for param in stmt.params]
    dumped = transformer.dump_sequence(values, [PyFormat.TEXT] * len(values))
    return _Message(b"", text=stmt.text, params=list(dumped), internal=internal,
                    result_format=pq.Format.BINARY if binary else pq.Format.TEXT)


def _send(pgconn: pq.abc.PGconn, messages: Sequence[_Message]) -> None:
    """Queue every message; each yields one result, in order."""
    for message in messages:
        if message.command:
            pgconn.send_query_params(message.name, None)
        elif message.text is not None and message.params is not None:
            # Parse into the unnamed statement, Bind, Execute: nothing stays prepared.
            pgconn.send_query_params(message.text, message.params,
                                     result_format=message.result_format)
        elif message.text is not None:
            pgconn.send_prepare(message.name, message.text)
        else:
            pgconn.send_query_prepared(message.name, message.params,
                                       result_format=message.result_format)


class _Waiter:
    """Blocks until the connection's socket is ready, doing ``while_waiting``'s work when its
    descriptor is ready first. A socket that stays silent for ``reply_timeout`` seconds (the
    connection's, :class:`jobd.db.BoundedConnection`) raises :class:`jobd.db.NoAnswer`, and
    the exchange is cut short: without it a claim or a settle sent into a network that had
    gone silent waited for as long as the silence lasted."""

    def __init__(self, pgconn: pq.abc.PGconn, while_waiting: WhileWaiting | None,
                 reply_timeout: float | None) -> None:
        self.socket = pgconn.socket
        self.while_waiting = while_waiting
        self.reply_timeout = reply_timeout

    def wait(self, events: int) -> None:
        poller = select.poll()
        poller.register(self.socket, events)
        if self.while_waiting is not None:
            poller.register(self.while_waiting.fd, select.POLLIN)
        deadline = None if self.reply_timeout is None else time.monotonic() + self.reply_timeout
        while True:
            ready = dict(poller.poll(_poll_ms(deadline)))
            if self.while_waiting is not None and self.while_waiting.fd in ready:
                self.while_waiting.act()
            if self.socket in ready:
                return
            if deadline is not None and time.monotonic() >= deadline:
                assert self.reply_timeout is not None
                raise NoAnswer(self.reply_timeout)


def _poll_ms(deadline: float | None) -> int | None:
    """poll()'s timeout until ``deadline`` (monotonic; None: none), rounded up."""
    if deadline is None:
        return None
    return max(0, int((deadline - time.monotonic()) * 1000) + 1)


def _flush(pgconn: pq.abc.PGconn, waiter: _Waiter) -> None:
    # Read while writing: the server may be blocked sending results we have not consumed.
    while pgconn.flush():
        waiter.wait(select.POLLIN | select.POLLOUT)
        pgconn.consume_input()


def _next(pgconn: pq.abc.PGconn, waiter: _Waiter) -> pq.abc.PGresult | None:
    while pgconn.is_busy():
        waiter.wait(select.POLLIN)
        pgconn.consume_input()
    return pgconn.get_result()


def _result_of(pgconn: pq.abc.PGconn, waiter: _Waiter) -> pq.abc.PGresult:
    """The result of the next queued statement (its first result; the NULL ends it)."""
    result = _next(pgconn, waiter)
    if result is None:
        raise psycopg.OperationalError("lost track of the pipeline: a statement had no result")
    while _next(pgconn, waiter) is not None:
        pass
    return result


def _read_sync(pgconn: pq.abc.PGconn, waiter: _Waiter) -> None:
    result = _next(pgconn, waiter)
    if result is None or result.status != ExecStatus.PIPELINE_SYNC:
        raise psycopg.OperationalError("lost track of the pipeline: no sync at its end")


def _dispatch_notifications(pgconn: pq.abc.PGconn) -> None:
    # Notifications that arrived with the results wait in libpq; hand them to psycopg's
    # handler as its own cursors would, so conn.notifies() and listeners still see them.
    while (notification := pgconn.notifies()) is not None:
        if pgconn.notify_handler is not None:
            pgconn.notify_handler(notification)


def _first_error(conn: psycopg.Connection, messages: Sequence[_Message],
                 results: Sequence[pq.abc.PGresult],
                 prepared: set[bytes]) -> psycopg.Error | None:
    first: psycopg.Error | None = None
    for message, result in zip(messages, results, strict=True):
        if message.prepares and result.status == ExecStatus.COMMAND_OK:
            prepared.add(message.name)
        if result.status == ExecStatus.FATAL_ERROR and first is None:
            first = errors.error_from_result(result, encoding=conn.info.encoding)
    if isinstance(first, errors.InvalidSqlStatementName):
        # The session lost its prepared statements (DISCARD ALL, say): prepare them again.
        prepared.clear()
    return first


def _rollback(conn: psycopg.Connection, pgconn: pq.abc.PGconn) -> None:
    result = pgconn.exec_(b"ROLLBACK")
    if result.status != ExecStatus.COMMAND_OK:
        raise errors.error_from_result(result, encoding=conn.info.encoding)

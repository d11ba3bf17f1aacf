"""The connection an application hands to jobd's Python API (``enqueue``, ``enqueue_many``,
``cancel``, ``pause``, ``resume``): a synchronous psycopg 3 connection, checked before
anything is sent; and the hint their errors carry when jobd's schema is not migrated.

Anything else used to fail somewhere inside, with a message about jobd's own code: an
``AsyncConnection`` with "'coroutine' object has no attribute 'fetchone'" (and a coroutine
never awaited), a SQLAlchemy or Django connection, a psycopg2 connection or a cursor with
"object has no attribute 'cursor'". Each is refused here with what to pass instead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg

# From async code, and from any driver: the SQL function takes the same arguments.
_SQL_FUNCTION = ("SELECT jobd.enqueue('handler', '{...}'::jsonb, lane => ..., "
                 "idempotency_key => ...)")


def checked(conn: Any, caller: str) -> psycopg.Connection:
    """``conn`` if it is a ``psycopg.Connection``; else TypeError naming what to pass."""
    if isinstance(conn, psycopg.Connection):
        return conn
    raise TypeError(f"{caller} takes a psycopg.Connection (psycopg 3), not "
                    f"{_described(conn)}: {_advice(conn)}")


def _described(conn: Any) -> str:
    kind = type(conn)
    return "None" if conn is None else f"{kind.__module__}.{kind.__qualname__}"


def _advice(conn: Any) -> str:
    """What to pass instead, for the objects an application most likely has at hand."""
    module = type(conn).__module__.split(".")[0]
    if isinstance(conn, psycopg.AsyncConnection):
        return ("jobd's Python API is synchronous; from async code, run it on a synchronous "
                "connection (in a thread), or call the SQL function on the async connection: "
                + _SQL_FUNCTION)
    if isinstance(conn, psycopg.Cursor | psycopg.AsyncCursor):
        return "pass the cursor's connection (cursor.connection)"
    if module == "sqlalchemy":
        return ("with SQLAlchemy's psycopg dialect (postgresql+psycopg://), pass "
                "connection.connection.driver_connection, which joins the same transaction")
    if module == "django":
        return ("with Django's psycopg 3 backend, pass django.db.connection.connection "
                "(after connection.ensure_connection()), which joins the same transaction")
    if module == "psycopg2":
        return ("psycopg2 is not supported; call the SQL function on its connection: "
                + _SQL_FUNCTION)
    return ("connect with psycopg.connect(url); from another driver, call the SQL function: "
            + _SQL_FUNCTION)


# What a statement meets in a database where jobd's schema is missing, or is an older jobd's
# (a function, table or column it lacks): the cases the CLI answers with "run `jobd migrate`".
_SCHEMA_MISSING = (psycopg.errors.InvalidSchemaName, psycopg.errors.UndefinedFunction,
                   psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)


@contextlib.contextmanager
def schema_hint(schema: str) -> Iterator[None]:
    """The schema-missing errors of jobd's own statements (enqueue, enqueue_many, cancel,
    pause, resume) say what to do, as the CLI and jobd.testing do. The exception itself is
    re-raised, only its message extended after the server's first line: callers that catch
    psycopg.errors.InvalidSchemaName (or any psycopg.Error) still do, and its diag is the
    server's."""
    try:
        yield
    except _SCHEMA_MISSING as exc:
        if exc.args and isinstance(exc.args[0], str):
            first, newline, rest = exc.args[0].partition("\n")
            hint = (f"jobd's schema {schema!r} is missing or incomplete in this database; run "
                    f"`jobd migrate` on it first (or pass the schema it uses: schema=)")
            exc.args = (f"{first}: {hint}{newline}{rest}", *exc.args[1:])
        raise

"""The connection an application hands to jobd's Python API (``enqueue``, ``enqueue_many``,
``cancel``, ``pause``, ``resume``): a synchronous psycopg 3 connection, checked before
anything is sent.

Anything else used to fail somewhere inside, with a message about jobd's own code: an
``AsyncConnection`` with "'coroutine' object has no attribute 'fetchone'" (and a coroutine
never awaited), a SQLAlchemy or Django connection, a psycopg2 connection or a cursor with
"object has no attribute 'cursor'". Each is refused here with what to pass instead."""

from __future__ import annotations

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

"""Opening connections to the jobd schema.

jobd's own connections set ``search_path`` to the jobd schema at connect time, so the named
queries in ``jobd/sql/queries.sql`` use unqualified names and work for any schema name.
"""

from __future__ import annotations

import os
import re

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobd.errors import DatabaseUnavailable, UsageError

DEFAULT_SCHEMA = "jobd"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
CONNECT_TIMEOUT_SECONDS = 5
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
             "keepalives_count": 3, "tcp_user_timeout": 30_000}

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def validate_schema(schema: str) -> str:
    if not _SCHEMA_NAME.match(schema):
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

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


def conninfo(url: str, schema: str, application_name: str = "jobd") -> str:
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise UsageError(f"invalid database URL: {first_line(exc)}") from None
    params.setdefault("application_name", application_name)
    params.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
    # search_path without public: a jobd connection sees only jobd's objects and pg_catalog.
    options = params.get("options", "")
    params["options"] = f"{options} -c search_path={validate_schema(schema)}".strip()
    return make_conninfo(**params)


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

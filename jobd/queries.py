"""Named SQL statements, loaded once from ``jobd/sql/queries.sql``.

Each block starts with ``-- name: <name>``. Most rely on the connection's search_path (jobd's
own connections set it to the jobd schema). Statements that also run on connections jobd does
not own (a caller's transaction, a transactional handler's) name jobd's objects as
``{schema}.name``: :func:`qualified` fills the placeholder with a
:class:`psycopg.sql.Identifier`, and :func:`query` drops it for jobd's own connections, so one
text serves both. Blocks whose name ends in ``_qualified`` run only with their placeholders
bound: by :func:`qualified`, or by :func:`with_identifiers` for statements whose placeholders
are all identifiers (a schema, a role, a channel: CREATE SCHEMA, GRANT, LISTEN).
"""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

_NAME_LINE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _parse(text: str) -> dict[str, str]:
    parts = _NAME_LINE.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


_SCHEMA_PREFIX = "{schema}."


@functools.cache
def _all() -> dict[str, str]:
    return _parse(resources.files("jobd.sql").joinpath("queries.sql").read_text("utf-8"))


def names() -> list[str]:
    return sorted(_all())


def text(name: str) -> str:
    """A named query as written, ``{schema}`` placeholders and all (for tools that match
    statements by their text, such as bench/pressure.py)."""
    return _all()[name]


@functools.cache
def query(name: str) -> str:
    """The text of a named query for a connection whose search_path is the jobd schema."""
    if name.endswith("_qualified"):
        raise KeyError(f"{name!r} runs only schema-qualified; use qualified()")
    return _all()[name].replace(_SCHEMA_PREFIX, "")


@functools.cache
def qualified(name: str, schema: str) -> sql.Composed:
    """A named query with ``{schema}`` bound to ``schema`` as an identifier and
    ``{job_id_seq}`` to the regclass literal of its job id sequence (a constant, so the
    planner resolves it once rather than per row)."""
    if "{schema}" not in _all()[name]:
        raise KeyError(f"{name!r} has no {{schema}} placeholder to qualify")
    sequence = sql.SQL("{}::regclass").format(
        sql.Literal(sql.Identifier(schema, "job_id_seq").as_string()))
    return sql.SQL(_all()[name]).format(schema=sql.Identifier(schema), job_id_seq=sequence)


def with_identifiers(name: str, **identifiers: str) -> sql.Composed:
    """A named query whose ``{placeholders}`` are all identifiers (a schema, a role), each
    bound with :class:`psycopg.sql.Identifier`: for statements, such as GRANT, that take no
    parameters."""
    return sql.SQL(_all()[name]).format(
        **{key: sql.Identifier(value) for key, value in identifiers.items()})

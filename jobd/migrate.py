"""Applying ``migrations/NNNN_name.sql`` in order, once each.

All pending migrations run in one transaction, at READ COMMITTED whatever the default, under a
transaction-level advisory lock keyed by the schema name, so any number of nodes may run
``jobd migrate`` at once: the first applies, the others wait and then find nothing to do. A
migration that fails rolls back entirely. The same transaction grants the runtime and producer
roles their privileges (:mod:`jobd.grants`), so a role never sees a schema it lacks the
privileges for.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

import psycopg
from psycopg import sql

from jobd import archive, grants
from jobd.db import unbounded_replies, validate_schema
from jobd.queries import query, text, with_identifiers

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def available() -> list[Migration]:
    """The migrations shipped with the package, in version order."""
    found = []
    for entry in resources.files("jobd.migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {versions}")
    return found


class MigrationMismatch(RuntimeError):
    """An applied migration differs from the file that ships now."""


class NotOwner(RuntimeError):
    """The schema needs a change that only its owner may make."""


class ForeignSchema(ValueError):
    """A first ``jobd migrate`` into a schema that holds other objects, or into public."""


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What one ``jobd migrate`` did."""

    applied: list[Migration] = field(default_factory=list)
    roles: grants.Granted = field(default_factory=grants.Granted)
    payload_limit: int | None = None  # limits.max_payload_bytes, when this run set it
    # Functions whose search_path this run pinned to the schema again, with the path they had
    # (a schema restored or renamed under another name).
    repinned: list[tuple[str, str]] = field(default_factory=list)
    # The limit this run replaced, when it set one: nodes whose files differ set it back and
    # forth at each start, and the fleet-wide value must not change unseen.
    payload_limit_was: int | None = None


def migrate(conn: psycopg.Connection, schema: str, *,
            max_payload_bytes: int | None = None) -> list[Migration]:
    """Bring ``schema`` up to date; returns the migrations this call applied.

    ``max_payload_bytes`` (the config's ``limits.max_payload_bytes``), when given, becomes the
    database's payload limit, which every entry point enforces.
    """
    return upgrade(conn, schema, max_payload_bytes=max_payload_bytes).applied


def upgrade(conn: psycopg.Connection, schema: str, *, max_payload_bytes: int | None = None,
            grant_runtime: Sequence[str] = (), grant_producer: Sequence[str] = ()) -> Upgrade:
    """:func:`migrate`, then grant the roles named here and every role granted before
    (:func:`jobd.grants.apply`), all in one transaction. A role that does not exist raises
    :class:`jobd.grants.MissingRole`, a runtime grant to the schema's owner
    :class:`jobd.grants.OwnerGrant`, and nothing changes.

    A role that does not own the schema (the runtime role, running ``jobd migrate`` before
    the daemon as the systemd unit does) may run it while there is nothing to change: it
    tops up the archive partitions and returns. If there is something to change it raises
    :class:`NotOwner` before trying.
    """
    validate_schema(schema)
    applied_now: list[Migration] = []
    # Its statements run without the session's statement_timeout (set_local_no_statement_
    # timeout below): nor may the client give up on them at that timeout.
    # A transaction of its own at READ COMMITTED (migrate_read_committed); inside a caller's
    # transaction, the caller's level stands.
    own_transaction = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with unbounded_replies(conn), conn.transaction():
        if own_transaction:
            conn.execute(query("migrate_read_committed"))
        conn.execute(query("migrate_lock"), {"schema": schema})
        row = conn.execute(query("schema_ownership"), {"schema": schema}).fetchone()
        owner = row is None or bool(row[0])  # a schema about to be created is its creator's
        problem = None if owner else grants.usage_problem(conn, schema)
        if problem:
            raise NotOwner(problem)
        if row is None:
            conn.execute(with_identifiers("create_schema_qualified", schema=schema))
        conn.execute(with_identifiers("set_local_search_path_qualified", schema=schema))
        conn.execute(query("set_local_no_statement_timeout"))
        exists = conn.execute(query("migration_ledger_exists")).fetchone()
        if not (exists and exists[0]):
            _check_first_install(conn, schema)
            conn.execute(query("create_migration_ledger"))
        done = {version: (name, checksum)
                for version, name, checksum in conn.execute(query("applied_migrations"))}
        pending = _pending(available(), done)
        stale = pinned_elsewhere(conn, schema)
        if not owner and (pending or stale or grant_runtime or grant_producer
                          or _limit_differs(conn, max_payload_bytes)):
            raise NotOwner(
                f"schema {schema} needs changes ({_what_changes(pending, stale)}) that only "
                "its owner may make: run jobd migrate as the role that owns it (the runtime "
                "and producer roles cannot change it)")
        # Before the migrations: they may call the functions (the partitions' upkeep does).
        _pin_search_paths(conn, schema, stale)
        for migration in pending:
            conn.execute(migration.text)
            conn.execute(query("record_migration"), {
                "version": migration.version, "name": migration.name,
                "checksum": migration.checksum})
            applied_now.append(migration)
        # Archive partitions are dated; every migrate run tops them up.
        archive.ensure_partitions(conn)
        limit_was = _stored_limit(conn)
        limit_set = max_payload_bytes is not None and limit_was != max_payload_bytes
        if limit_set:
            conn.execute(query("set_payload_limit"), {"max_payload_bytes": max_payload_bytes})
        granted = grants.Granted()
        if owner:
            granted = grants.apply(conn, schema, runtime=grant_runtime,
                                   producer=grant_producer)
    return Upgrade(applied_now, granted, max_payload_bytes if limit_set else None, stale,
                   limit_was if limit_set else None)


def pinned_elsewhere(conn: psycopg.Connection, schema: str) -> list[tuple[str, str]]:
    """The functions of ``schema`` whose pinned search_path names another schema, with that
    path: what a schema restored or renamed under another name has (the pins hold names, not
    the schema itself). Until they are pinned again they use the old schema's tables."""
    rows = conn.execute(query("functions_pinned_elsewhere"), {"schema": schema}).fetchall()
    return [(signature, path) for signature, path in rows]


def _pin_search_paths(conn: psycopg.Connection, schema: str,
                      functions: list[tuple[str, str]]) -> None:
    for signature, _path in functions:
        conn.execute(sql.SQL(text("pin_search_path_qualified")).format(
            function=sql.SQL(signature), schema=sql.Identifier(schema)))


def _check_first_install(conn: psycopg.Connection, schema: str) -> None:
    """Refuse to install jobd into a schema that holds something else. Its grants cover
    every table and function in the schema (GRANT ... ON ALL TABLES IN SCHEMA, jobd.grants)
    and migration 0014 pins the search_path of every function there that sets one: in an
    application's schema the runtime role would get to write the application's tables, and
    its functions would be changed. ``public`` is refused even while empty, as tables come
    to it by default."""
    if schema == "public":
        raise ForeignSchema(
            "schema public is shared by default with whatever is created without a schema: "
            "jobd's grants there would reach those tables too; give jobd a schema of its "
            "own (the default is jobd)")
    row = conn.execute(query("schema_other_objects"), {"schema": schema}).fetchone()
    if row is not None and row[0]:
        raise ForeignSchema(
            f"schema {schema} already holds {row[0]} object(s) that are not jobd's: jobd's "
            "grants would reach them and its migrations change them; give jobd a schema of "
            "its own (a new or empty one)")


def _pending(shipped: list[Migration], done: dict[int, tuple[str, str]]) -> list[Migration]:
    for migration in shipped:
        if migration.version in done and done[migration.version][1] != migration.checksum:
            raise MigrationMismatch(
                f"migration {migration.version:04d}_{migration.name} was changed "
                "after it was applied; add a new migration instead")
    return [m for m in shipped if m.version not in done]


def _stored_limit(conn: psycopg.Connection) -> int | None:
    row = conn.execute(query("payload_limit")).fetchone()
    return None if row is None else int(row[0])


def _limit_differs(conn: psycopg.Connection, max_payload_bytes: int | None) -> bool:
    return max_payload_bytes is not None and _stored_limit(conn) != max_payload_bytes


def _what_changes(pending: list[Migration], stale: list[tuple[str, str]]) -> str:
    if pending:
        return "migrations " + ", ".join(f"{m.version:04d}_{m.name}" for m in pending)
    if stale:
        return f"{len(stale)} functions to pin to it again: {_stale_paths(stale)}"
    return "grants or the payload limit"


def _stale_paths(stale: list[tuple[str, str]]) -> str:
    paths = sorted({path for _signature, path in stale})
    return "their search_path names " + " and ".join(repr(path) for path in paths)


def schema_problem(conn: psycopg.Connection, schema: str) -> str | None:
    """Why the database is not ready for the daemon (its schema missing, older than this
    jobd, or out of the role's reach), or None. ``conn`` is in autocommit."""
    latest = max(m.version for m in available())
    try:
        row = conn.execute(query("latest_migration")).fetchone()
    except psycopg.errors.UndefinedTable:
        return (grants.usage_problem(conn, schema)
                or "jobd's tables are missing in this database; run `jobd migrate` first")
    version = row[0] if row else None
    if version is None or version < latest:
        return f"the schema is at version {version}, this jobd needs {latest}; run `jobd migrate`"
    stale = pinned_elsewhere(conn, schema)
    if stale:
        # Restored or renamed under another name: its functions would claim, archive and drop
        # partitions in the schema they name, if there is one.
        return (f"{len(stale)} functions of schema {schema} work on another schema "
                f"({_stale_paths(stale)}; restored or renamed under another name?): run "
                f"`jobd migrate --schema {schema}` as its owner to pin them to it")
    return None

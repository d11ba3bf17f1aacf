"""jobd/sql/schema.sql, the current schema in one file, builds exactly what the migrations
build: the same columns, constraints, indexes, views, functions (bodies included), triggers,
sequences, table options and rows. And the names that Python and SQL both spell agree."""

from __future__ import annotations

import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql

from jobd import outbox, validation
from jobd.config import OUTBOX_HANDLER_PATH
from jobd.db import connect
from jobd.handlers import resolve
from jobd.migrate import migrate

if TYPE_CHECKING:
    from conftest import Databases

# Long, distinctive names, so that replacing them in catalog text touches nothing else.
MIGRATED = "jobd_built_by_migrations"
FROM_FILE = "jobd_built_by_schema_file"
PLACEHOLDER = "<schema>"

# What `jobd migrate` adds beside the schema, with their indexes: its ledger, and the dated
# archive partitions it tops up on every run (runtime state: which days exist depends on
# today's date).
NOT_SCHEMA = r"^(schema_migrations|jobs_archive_[0-9]{8})(_|$)"


def schema_file() -> str:
    return resources.files("jobd.sql").joinpath("schema.sql").read_text("utf-8")


# Each query takes the schema as %(schema)s and returns rows comparable as values; every
# relation is named by relname, never by a schema-qualified regclass.
CATALOG: dict[str, str] = {
    "relations": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text,
               coalesce(array_to_string(c.reloptions, ','), ''),
               coalesce(pg_get_partkeydef(c.oid), ''),
               coalesce(pg_get_expr(c.relpartbound, c.oid), ''), c.relreplident::text,
               coalesce((SELECT string_agg(p.relname, ',') FROM pg_inherits i
                           JOIN pg_class p ON p.oid = i.inhparent
                          WHERE i.inhrelid = c.oid), '')
          FROM pg_class c
         WHERE c.relnamespace = %(schema)s::regnamespace""",
    "columns": """
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum),
               a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attidentity::text,
               a.attgenerated::text, coalesce(a.attcollation::regcollation::text, '')
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind IN ('r', 'p', 'v')
           AND a.attnum > 0 AND NOT a.attisdropped""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid),
               k.convalidated, k.condeferrable, k.conislocal
          FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
         WHERE k.connamespace = %(schema)s::regnamespace""",
    "indexes": """
        SELECT t.relname, i.relname, pg_get_indexdef(i.oid)
          FROM pg_index x
          JOIN pg_class i ON i.oid = x.indexrelid
          JOIN pg_class t ON t.oid = x.indrelid
         WHERE t.relnamespace = %(schema)s::regnamespace""",
    "views": """
        SELECT c.relname, pg_get_viewdef(c.oid)
          FROM pg_class c
         WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind IN ('v', 'm')""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
          FROM pg_proc p
         WHERE p.pronamespace = %(schema)s::regnamespace""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal""",
    "sequences": """
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement,
               s.seqmin, s.seqmax, s.seqcache, s.seqcycle,
               coalesce(owner.relname || '.' || a.attname, ''), coalesce(d.deptype::text, '')
          FROM pg_sequence s
          JOIN pg_class c ON c.oid = s.seqrelid
          LEFT JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid
                               AND d.refclassid = 'pg_class'::regclass
                               AND d.deptype IN ('a', 'i')
          LEFT JOIN pg_class owner ON owner.oid = d.refobjid
          LEFT JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
         WHERE c.relnamespace = %(schema)s::regnamespace""",
    "types": """
        SELECT t.typname, t.typtype::text, format_type(t.typbasetype, t.typtypmod)
          FROM pg_type t
         WHERE t.typnamespace = %(schema)s::regnamespace AND t.typtype IN ('d', 'e', 'r')""",
}

# The relation each catalog row belongs to (its first column), to leave out NOT_SCHEMA.
RELATION_COLUMN = {"relations", "columns", "constraints", "indexes", "triggers", "sequences"}


def normalized(value: object, schema: str) -> object:
    """Catalog text with the schema's name replaced, so two schemas compare as equal."""
    if isinstance(value, str):
        return re.sub(rf"\b{schema}\b", PLACEHOLDER, value)
    return value


def describe(conn: psycopg.Connection, schema: str) -> dict[str, list[tuple[object, ...]]]:
    """Every catalog fact of ``schema`` above, and the rows of every table."""
    # A search_path without either schema: catalog text names both the same way, qualified.
    conn.execute("SET search_path TO pg_catalog")
    description: dict[str, list[tuple[object, ...]]] = {}
    for kind, text in CATALOG.items():
        rows = conn.execute(text, {"schema": schema}).fetchall()
        if kind in RELATION_COLUMN:
            rows = [row for row in rows if not re.match(NOT_SCHEMA, row[0])]
        description[kind] = sorted(tuple(normalized(v, schema) for v in row) for row in rows)
    description["rows"] = table_rows(conn, schema)
    return description


def table_rows(conn: psycopg.Connection, schema: str) -> list[tuple[object, ...]]:
    """The rows a schema starts with, per table (e.g. the settings row of 0006)."""
    tables = [row[0] for row in conn.execute(
        "SELECT relname FROM pg_class WHERE relnamespace = %s::regnamespace AND relkind = 'r'",
        (schema,)).fetchall() if not re.match(NOT_SCHEMA, row[0])]
    found: list[tuple[object, ...]] = []
    for table in tables:
        rows = conn.execute(sql.SQL(
            "SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY to_jsonb(t)::text), '[]')::text"
            " FROM {} AS t").format(sql.Identifier(schema, table))).fetchone()
        assert rows is not None
        found.append((table, rows[0]))
    return sorted(found)


@pytest.fixture(scope="module")
def built(databases: Databases) -> dict[str, dict[str, list[tuple[object, ...]]]]:
    """One database holding the schema built both ways, described."""
    url = databases.empty()
    with connect(url) as conn:
        # One transaction, so now() is one instant in both: a row whose default is now()
        # compares equal.
        with conn.transaction():
            migrate(conn, MIGRATED)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(FROM_FILE)))
            conn.execute(sql.SQL("SET LOCAL search_path TO {}").format(
                sql.Identifier(FROM_FILE)))
            conn.execute(schema_file())
        return {MIGRATED: describe(conn, MIGRATED), FROM_FILE: describe(conn, FROM_FILE)}


@pytest.mark.parametrize("kind", [*CATALOG, "rows"])
def test_the_schema_file_builds_what_the_migrations_build(
    built: dict[str, dict[str, list[tuple[object, ...]]]], kind: str
) -> None:
    assert built[FROM_FILE][kind] == built[MIGRATED][kind]


def test_the_comparison_sees_what_it_compares(
    built: dict[str, dict[str, list[tuple[object, ...]]]],
) -> None:
    # The equality above proves something only if the description holds the schema.
    migrated = built[MIGRATED]
    functions = {row[0]: row[2] for row in migrated["functions"]}
    assert {"enqueue", "check_job", "check_payload_size", "lane_head", "fire_schedule",
            "declare_schedule", "reconcile_schedule", "schedule_definition", "outbox_add",
            "outbox_mark_dead", "notify_new_jobs", "ensure_archive_partitions",
            "drop_archive_partitions", "pause", "resume", "cancel", "quarantine",
            "check_name"} <= set(functions)
    assert "arm_waiter_probe(" in str(functions["arm_waiter"])  # the body of 0022, not 0011
    assert "lane_pauses" in str(functions["arm_waiter_register"])
    assert "ORDER BY j.run_at, j.id" in str(functions["arm_waiter_probe"])  # 0023, not 0020
    assert "DELETE" not in str(functions["arm_waiter_probe"])  # 0024: the row stays on 'work'
    assert "DELETE FROM lane_waiters" in str(functions["arm_waiter"])  # 0024
    assert "PERFORM check_job(" in str(functions["enqueue"])  # the body of 0006, not 0001
    assert f"SET search_path TO '{PLACEHOLDER}'" in str(functions["enqueue"])
    relations = {row[0]: row for row in migrated["relations"]}
    assert "autovacuum_vacuum_cost_delay=0" in str(relations["jobs"][3])
    assert relations["jobs_archive_default"][5] == "DEFAULT"
    assert "schema_migrations" not in relations
    # Columns in order: those added last by migrations are last.
    assert [row[2] for row in migrated["columns"] if row[0] == "jobs"][-4:] == [
        "suspect", "claimed_at", "cancel_requested_at", "fairness_key"]
    archive_checks = {row[1]: row for row in migrated["constraints"]
                      if row[0] == "jobs_archive" and row[2] == "c"}
    assert "'cancelled'" in archive_checks["jobs_archive_state_check"][3]
    assert [row[2] for row in migrated["columns"]
            if row[0] == "jobs_archive"][-3:] == ["finished_at", "claimed_at",
                                                "fairness_key"]
    assert ("settings", '[{"name": "max_payload_bytes", "value": 1048576}]') in migrated["rows"]
    assert {row[1] for row in migrated["triggers"]} == {"jobs_notify_insert",
                                                        "dead_letter_outbox"}
    assert {row[0] for row in migrated["sequences"]} == {"job_id_seq", "lease_token_seq",
                                                         "outbox_id_seq"}
    assert [row[0] for row in migrated["views"]] == ["all_jobs"]


def test_the_schema_file_ships_in_the_package() -> None:
    pyproject = tomllib.loads(
        (Path(__file__).parent.parent / "pyproject.toml").read_text("utf-8"))
    assert "*.sql" in pyproject["tool"]["setuptools"]["package-data"]["jobd.sql"]
    assert schema_file().startswith("-- The whole current schema of jobd")


# --- names spelled once in Python and once in SQL, and the two agree ------------------------


def function_source(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = %s"
                       " AND pronamespace = 'jobd'::regnamespace", (name,)).fetchone()
    assert row is not None
    return str(row[0])


def test_sql_checks_names_by_the_rule_python_checks(conn: psycopg.Connection) -> None:
    for function in ("check_job", "check_name"):
        source = function_source(conn, function)
        assert f"'{validation.NAME_CHARS.pattern}'" in source
        assert f"> {validation.MAX_NAME_BYTES}" in source


@pytest.mark.parametrize("value", [
    "a", "A9", "a" * 128, "a" * 129, "9_.:-", "_a", "-a", "", "a b", "a\n", "é", "a/b"])
def test_the_two_forms_of_the_name_rule_agree(value: str) -> None:
    # SQL checks NAME_CHARS and the length apart (no ASCII name differs in bytes and
    # characters; a non-ASCII one fails both).
    split = (validation.NAME_CHARS.fullmatch(value) is not None
             and len(value.encode()) <= validation.MAX_NAME_BYTES)
    assert split == (validation.NAME_RULE.fullmatch(value) is not None)


def test_sql_reserves_the_key_prefix_python_reserves(conn: psycopg.Connection) -> None:
    assert (f"starts_with(check_job.idempotency_key, '{validation.RESERVED_KEY_PREFIX}')"
            in function_source(conn, "check_job"))
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="reserved"):
        conn.execute("SELECT enqueue('h', idempotency_key => %s)",
                     (f"{validation.RESERVED_KEY_PREFIX}mine",))


def test_sql_outbox_deliveries_run_the_handler_python_registers(
    conn: psycopg.Connection,
) -> None:
    conn.execute("SELECT outbox_add_for_sender('k', 'mail', '{}', 'outbox')")
    # Deliveries queued by daemons of before migration 0043, which workers still run.
    conn.execute("SELECT outbox_add('k2', 'mail', '{}', 'outbox')")
    rows = conn.execute("SELECT handler, idempotency_key FROM jobs ORDER BY id").fetchall()
    reserved = validation.RESERVED_KEY_PREFIX
    assert rows == [(validation.outbox_handler("mail"), f"{reserved}outbox:k"),
                    (validation.OUTBOX_HANDLER, f"{reserved}outbox:k2")]
    # The handler names workers map to the outbox's delivery function.
    for name in (validation.outbox_handler("mail"), validation.OUTBOX_HANDLER):
        delivery = resolve(name, OUTBOX_HANDLER_PATH)
        assert (delivery.func, delivery.is_transactional) == (outbox.deliver, True)

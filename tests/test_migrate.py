"""`jobd migrate`: once each, safe under concurrency, refuses edited history, and the schema it
builds is the one the code's SQL expects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import pq, sql

import jobd
from jobd import queries, queue
from jobd.claim_floors import full_scan_params
from jobd.db import connect
from jobd.migrate import MigrationMismatch, available, migrate

if TYPE_CHECKING:
    from conftest import Databases

TIMEOUT = 60


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JOBD_DATABASE_URL", "JOBD_CONFIG")}
    return subprocess.run([sys.executable, "-m", "jobd", *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT)


def applied_versions(url: str, schema: str = "jobd") -> list[tuple[int, str]]:
    with connect(url, schema) as conn:
        return conn.execute("SELECT version, checksum FROM schema_migrations ORDER BY version"
                            ).fetchall()


def shipped() -> list[tuple[int, str]]:
    return [(m.version, m.checksum) for m in available()]


def test_migrations_ship_in_order_and_start_with_the_queue() -> None:
    migrations = available()
    assert [m.version for m in migrations] == sorted({m.version for m in migrations})
    assert (migrations[0].version, migrations[0].name) == (1, "queue")


def test_migrate_applies_everything_once(databases: Databases) -> None:
    url = databases.empty()
    with connect(url) as conn:
        first = migrate(conn, "jobd")
        assert [(m.version, m.name) for m in first] == [(m.version, m.name) for m in available()]
        assert migrate(conn, "jobd") == []
    assert applied_versions(url) == shipped()


def test_three_concurrent_migrate_commands_all_succeed(databases: Databases) -> None:
    url = databases.empty()
    env = {k: v for k, v in os.environ.items() if k not in ("JOBD_DATABASE_URL", "JOBD_CONFIG")}
    command = [sys.executable, "-m", "jobd", "migrate", "--database-url", url, "--json"]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for _ in range(3)]
    results = [(p.wait(timeout=TIMEOUT), *p.communicate(timeout=TIMEOUT)) for p in processes]
    assert [(code, err) for code, _, err in results] == [(0, "")] * 3
    applied = sorted(len(json.loads(out)["applied"]) for _, out, _ in results)
    # Exactly one process applied the migrations; the other two found nothing to do.
    assert applied == [0, 0, len(available())]
    assert applied_versions(url) == shipped()
    with connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone() == (
            len(available()),)


def test_an_edited_migration_is_refused(databases: Databases) -> None:
    url = databases.migrated()
    with connect(url) as conn:
        conn.execute("UPDATE schema_migrations SET checksum = 'edited' WHERE version = 1")
        with pytest.raises(MigrationMismatch, match="0001_queue"):
            migrate(conn, "jobd")
        # The refusal changed nothing.
        assert conn.execute("SELECT checksum FROM schema_migrations WHERE version = 1"
                            ).fetchone() == ("edited",)
    result = run_cli("migrate", "--database-url", url)
    assert result.returncode == 1
    assert result.stderr.startswith("jobd: ")
    assert "0001_queue" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_migrate_into_another_schema(databases: Databases) -> None:
    url = databases.empty()
    result = run_cli("migrate", "--schema", "other", "--database-url", url)
    assert result.returncode == 0, result.stderr
    assert "other" in result.stdout
    assert applied_versions(url, "other") == shipped()

    with connect(url, "other") as conn:
        assert conn.execute("SELECT to_regnamespace('jobd')").fetchone() == (None,)
        conn.execute("LISTEN other_wakeup")
        for lane in ("default", "b"):  # due work notifies only lanes with a worker waiting
            assert queue.arm(conn, lane, f"worker-{lane}", full_scan_params()) == "armed"
        job_id = jobd.enqueue(conn, "send_email", {"to": "a@example.com"}, schema="other",
                              idempotency_key="k")
        assert jobd.enqueue(conn, "send_email", schema="other", idempotency_key="k") == job_id
        [bulk] = jobd.enqueue_many(conn, [jobd.JobSpec("h", lane="b")], schema="other")
        notified = sorted(n.payload for n in conn.notifies(timeout=5, stop_after=2))
        assert notified == ["b#1", "default#1"]
        [job] = queue.claim(conn, "default", "w", 10, 30)
        assert (job.id, job.payload) == (job_id, {"to": "a@example.com"})
        assert queue.complete(conn, [job.lease]).applied == [job_id]
        states = dict(conn.execute("SELECT id, state FROM other.all_jobs").fetchall())
        assert states == {job_id: "done", bulk: "pending"}
        # The SQL function captured its own schema, whatever the caller's search_path.
        conn.execute("SET search_path TO public")
        row = conn.execute("SELECT other.enqueue('h', lane => 'c')").fetchone()
        assert row is not None
        assert conn.execute("SELECT lane FROM other.jobs WHERE id = %s", row).fetchone() == ("c",)


def test_invalid_schema_name_is_a_usage_error(databases: Databases) -> None:
    url = databases.empty()
    result = run_cli("migrate", "--schema", "Bad-Name", "--database-url", url)
    assert result.returncode == 2
    assert result.stderr.startswith("jobd: ") and "Traceback" not in result.stderr


def test_jobd_is_not_installed_into_public(databases: Databases) -> None:
    # Installed there, its runtime grant (ON ALL TABLES IN SCHEMA) reached every table
    # created later without a schema, and migration 0014 re-pinned the search_path of any
    # function there that set one.
    url = databases.empty()
    result = run_cli("migrate", "--schema", "public", "--database-url", url)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("jobd: schema public is shared by default")
    assert len(result.stderr.strip().splitlines()) == 1
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT to_regclass('public.schema_migrations')").fetchone() == (
            None,)


def test_jobd_is_not_installed_into_a_schema_holding_other_objects(
    databases: Databases
) -> None:
    url = databases.empty()
    runtime = f"jobd_rt_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(runtime)))
        admin.execute("CREATE SCHEMA app; CREATE TABLE app.accounts (id int, balance int);"
                      " CREATE FUNCTION app.total() RETURNS bigint LANGUAGE sql"
                      " SET search_path = app AS 'SELECT sum(balance) FROM accounts'")
    try:
        result = run_cli("migrate", "--schema", "app", "--database-url", url,
                         "--grant-runtime", runtime)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(
            "jobd: schema app already holds 2 object(s) that are not jobd's")
        with psycopg.connect(url) as conn:
            assert conn.execute(
                "SELECT has_table_privilege(%s, 'app.accounts', 'UPDATE'),"
                " (SELECT proconfig FROM pg_proc WHERE proname = 'total'),"
                " to_regclass('app.schema_migrations')", (runtime,)
            ).fetchone() == (False, ["search_path=app"], None)
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(runtime)))


def test_a_schema_created_empty_beforehand_takes_jobd(databases: Databases) -> None:
    # A DBA's CREATE SCHEMA jobd AUTHORIZATION owner, before the first jobd migrate.
    url = databases.empty()
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA jobd")
    result = run_cli("migrate", "--database-url", url)
    assert result.returncode == 0, result.stderr
    assert applied_versions(url) == shipped()
    again = run_cli("migrate", "--database-url", url)  # jobd's own objects are no obstacle
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout


# --- the fresh schema equals what the code expects -----------------------------------------

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def to_positional(text: str) -> str:
    """psycopg's %(name)s placeholders as the server's $n (one number per distinct name)."""
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"${numbers.setdefault(match[1], len(numbers) + 1)}"

    return _PLACEHOLDER.sub(number, text).replace("%%", "%")


def prepare_error(conn: psycopg.Connection, name: str, text: str) -> str | None:
    result = conn.pgconn.prepare(name.encode(), to_positional(text).encode())
    if result.status == pq.ExecStatus.COMMAND_OK:
        return None
    return (result.error_message or b"").decode().strip()


# Utility statements: PREPARE takes none of them (nor a savepoint's).
_UTILITY = {"CREATE", "SET", "LISTEN", "COPY", "GRANT", "REVOKE", "ALTER",
            "SAVEPOINT", "RELEASE", "ROLLBACK"}


def is_utility(name: str) -> bool:
    statement = [line for line in queries.text(name).splitlines() if not line.startswith("--")]
    return statement[0].split()[0].upper() in _UTILITY


def test_every_named_query_prepares_against_a_fresh_schema(conn: psycopg.Connection) -> None:
    names = [name for name in queries.names() if not name.endswith("_qualified")
             and not is_utility(name)]
    assert {"claim_jobs", "complete_jobs", "fail_jobs", "expired_leases"} <= set(names)
    errors = {name: prepare_error(conn, name, queries.query(name)) for name in names}
    assert {name: error for name, error in errors.items() if error} == {}


def test_schema_qualified_queries_prepare_too(conn: psycopg.Connection) -> None:
    names = [name for name in queries.names() if name.endswith("_qualified")
             and not is_utility(name)]
    assert "enqueue_qualified" in names
    conn.execute("SET search_path TO public")
    errors = {
        name: prepare_error(conn, name, queries.qualified(name, "jobd").as_string(conn))
        for name in names
    }
    assert {name: error for name, error in errors.items() if error} == {}


def test_a_query_that_does_not_match_the_schema_fails_to_prepare(
    conn: psycopg.Connection,
) -> None:
    # The check above can fail: a column the schema lacks is caught at PREPARE time.
    assert prepare_error(conn, "broken", "SELECT no_such_column FROM jobs WHERE id = %(id)s")


CONTRACT_COLUMNS = {
    "id": "bigint",
    "lane": "text",
    "handler": "text",
    "payload": "jsonb",
    "state": "text",
    "priority": "integer",
    "run_at": "timestamp with time zone",
    "attempts": "integer",
    "max_attempts": "integer",
    "lease_until": "timestamp with time zone",
    "claimed_by": "text",
    "idempotency_key": "text",
    "created_at": "timestamp with time zone",
    "last_error": "text",
}


def column_types(conn: psycopg.Connection, relation: str) -> dict[str, str]:
    rows = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
        (relation,),
    ).fetchall()
    return dict(rows)


def test_contract_columns_of_jobs(conn: psycopg.Connection) -> None:
    columns = column_types(conn, "jobd.jobs")
    assert {name: columns.get(name) for name in CONTRACT_COLUMNS} == CONTRACT_COLUMNS


@pytest.mark.parametrize(
    ("relation", "without"),
    [("jobd.all_jobs", set()), ("jobd.dead_letter", {"state", "lease_until"})],
)
def test_all_jobs_and_dead_letter_carry_the_contract_columns(
    conn: psycopg.Connection, relation: str, without: set[str]
) -> None:
    columns = column_types(conn, relation)
    expected = {k: v for k, v in CONTRACT_COLUMNS.items() if k not in without}
    assert {name: columns.get(name) for name in expected} == expected


def test_contract_relations_exist(conn: psycopg.Connection) -> None:
    kinds = dict(conn.execute(
        "SELECT c.relname, c.relkind::text FROM pg_class c "
        "WHERE c.relnamespace = 'jobd'::regnamespace").fetchall())
    assert kinds["jobs"] == "r"
    assert kinds["all_jobs"] == "v"
    assert kinds["dead_letter"] == "r"
    assert kinds["schema_migrations"] == "r"
    assert kinds["jobs_archive"] == "p"


def test_states_allowed_in_the_hot_table(conn: psycopg.Connection) -> None:
    for state in ("pending", "failed"):
        conn.execute("INSERT INTO jobs (handler, state) VALUES ('h', %s)", (state,))
    for state in ("done", "dead", "running"):
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO jobs (handler, state) VALUES ('h', %s)", (state,))


def test_run_at_must_be_a_moment_every_reader_can_load(conn: psycopg.Connection) -> None:
    for moment in ("infinity", "-infinity", "10000-01-01 00:00+00", "1969-12-31 23:59+00"):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="run_at"):
            conn.execute("SELECT jobd.enqueue('h', '{}', run_at => %s::timestamptz)", (moment,))
        # Hand-written SQL meets the same rule through the table's constraint.
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO jobd.jobs (handler, run_at) VALUES ('h', %s)", (moment,))


def function_signature(conn: psycopg.Connection, schema: str, name: str
                       ) -> list[tuple[Sequence[str], list[str], str, int]]:
    rows = conn.execute(
        """SELECT p.proargnames,
                  ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes::oid[]) AS t),
                  format_type(p.prorettype, NULL), p.pronargdefaults
             FROM pg_proc p
            WHERE p.pronamespace = %s::regnamespace AND p.proname = %s""",
        (schema, name),
    ).fetchall()
    return [(list(a), list(b), c, d) for a, b, c, d in rows]


def test_the_enqueue_function_matches_the_contract(conn: psycopg.Connection) -> None:
    assert function_signature(conn, "jobd", "enqueue") == [(
        ["handler", "payload", "lane", "run_at", "priority", "idempotency_key", "max_attempts",
         "fairness_key"],
        ["text", "jsonb", "text", "timestamp with time zone", "integer", "text", "integer",
         "text"],
        "bigint",
        7,
    )]
    # The contract's defaults, and a named argument.
    row = conn.execute("SELECT enqueue('send_email', max_attempts => 3)").fetchone()
    assert row is not None
    job = conn.execute(
        "SELECT payload, lane, run_at = created_at, priority, idempotency_key, max_attempts "
        "FROM jobs WHERE id = %s", row).fetchone()
    assert job == ({}, "default", True, 0, None, 3)


def test_indexes_the_queries_rely_on(conn: psycopg.Connection) -> None:
    definitions = dict(conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'jobd'").fetchall())
    claimable = definitions["jobs_claimable_idx"]
    assert "(lane, priority DESC, run_at, id)" in claimable
    assert "WHERE (state = ANY (ARRAY['pending'::text, 'failed'::text]))" in claimable
    assert "(lease_until) WHERE (state = 'claimed'::text)" in definitions["jobs_lease_idx"]
    assert "jobs_archive_id_idx" in definitions
    fair = definitions["jobs_fair_idx"]
    assert '(lane, priority DESC, COALESCE(fairness_key, handler) COLLATE "C", run_at, id)' in fair
    assert 'COALESCE(fairness_key, handler) COLLATE "C") IS NOT NULL' in fair  # 0025


def test_fresh_template_and_fresh_migration_build_the_same_schema(
    databases: Databases, conn: psycopg.Connection
) -> None:
    url = databases.empty()
    with connect(url) as fresh:
        migrate(fresh, "jobd")
        assert describe_schema(fresh) == describe_schema(conn)


def describe_schema(conn: psycopg.Connection) -> list[tuple[object, ...]]:
    """Columns, constraints, indexes and functions of the jobd schema, comparable as values."""
    query = sql.SQL("""
        SELECT 'column', c.relname, a.attname, format_type(a.atttypid, a.atttypmod),
               a.attnotnull::text, coalesce(pg_get_expr(d.adbin, d.adrelid), '')
          FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = 'jobd'::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
           AND c.relname !~ '^jobs_archive_[0-9]'
        UNION ALL
        SELECT 'constraint', conrelid::regclass::text, conname, pg_get_constraintdef(oid), '', ''
          FROM pg_constraint WHERE connamespace = 'jobd'::regnamespace
           AND conrelid::regclass::text !~ 'jobs_archive_[0-9]'
        UNION ALL
        SELECT 'index', tablename, indexname, indexdef, '', '' FROM pg_indexes
         WHERE schemaname = 'jobd' AND tablename !~ '^jobs_archive_[0-9]'
        UNION ALL
        SELECT 'function', proname, pg_get_function_identity_arguments(oid),
               md5(prosrc), '', '' FROM pg_proc WHERE pronamespace = 'jobd'::regnamespace
        ORDER BY 1, 2, 3""")
    return conn.execute(query).fetchall()


def test_a_migration_may_run_past_the_connections_reply_bound(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """jobd migrate lets its statements run past the session's statement_timeout (a
    migration may index a large table): the client's own bound on a reply (statement_timeout
    + REPLY_GRACE, there against a silent network) must not cut them off either."""
    from jobd import migrate as migrate_module
    from jobd.db import BoundedConnection, NoAnswer
    from jobd.migrate import Migration

    slow = Migration(9001, "slow", "SELECT pg_sleep(1)")
    monkeypatch.setattr(migrate_module, "available", lambda: [*available(), slow])
    with connect(db_url, "jobd", autocommit=True) as conn:
        assert isinstance(conn, BoundedConnection)
        conn.reply_timeout = 0.3  # as if statement_timeout were a fraction of the migration
        with pytest.raises(NoAnswer):
            conn.execute("SELECT pg_sleep(1)")  # the bound holds outside jobd migrate
    with connect(db_url, "jobd", autocommit=True) as conn:
        conn.reply_timeout = 0.3
        assert [m.version for m in migrate(conn, "jobd")] == [9001]
        assert conn.reply_timeout == 0.3  # bounded again afterwards

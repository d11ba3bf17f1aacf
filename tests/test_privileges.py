"""Least privilege: `jobd migrate --grant-runtime ROLE --grant-producer ROLE`.

The owner (the tests' superuser) migrates; the daemon runs as the runtime role and must do
its whole job (claims, completions, retries, archive maintenance, the CLI) without being able
to change the schema; the producer role can call enqueue and nothing else."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from cli_support import assert_one_line_error, cli
from daemon_support import (
    HANDLERS,
    Daemon,
    create_effects_table,
    job_row,
    job_state,
    make_config,
    wait_until,
)
from psycopg import sql

import jobd
from jobd.db import connect

SCHEMA = "jobd"

TRANSACTIONAL_HANDLER = '''\
import jobd


@jobd.transactional
def charge(job, conn):
    conn.execute("INSERT INTO public.ledger (job_id) VALUES (%s)", (job.id,))


def broken(job):
    raise ValueError("always fails")
'''


class Roles:
    """Two login roles of the test's own, dropped (with their privileges) at its end."""

    def __init__(self, db_url: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.db_url = db_url
        self.runtime = f"jobd_runtime_{suffix}"
        self.producer = f"jobd_producer_{suffix}"

    def url(self, role: str) -> str:
        return psycopg.conninfo.make_conninfo(self.db_url, user=role)

    def connect(self, role: str) -> psycopg.Connection:
        return connect(self.url(role), SCHEMA)


@pytest.fixture
def roles(db_url: str) -> Iterator[Roles]:
    made = Roles(db_url)
    with psycopg.connect(db_url, autocommit=True) as admin:
        for role in (made.runtime, made.producer):
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield made
    finally:
        with psycopg.connect(db_url, autocommit=True) as admin:
            for role in (made.runtime, made.producer):
                # Their sessions (a daemon's) must end before the role can go.
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                              " WHERE usename = %s", (role,))
                admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
def granted(roles: Roles) -> Roles:
    result = cli("migrate", "--database-url", roles.db_url, "--grant-runtime", roles.runtime,
                 "--grant-producer", roles.producer)
    assert result.returncode == 0, result.stderr
    assert f"granted runtime privileges to {roles.runtime}" in result.stdout
    assert f"granted producer privileges to {roles.producer}" in result.stdout
    return roles


def refused(conn: psycopg.Connection, statement: str) -> str:
    """The statement fails for want of privilege (or ownership); returns the message."""
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
        conn.execute(statement)
    return str(caught.value)


# --- the runtime role ------------------------------------------------------------------------


def test_the_daemon_runs_as_the_runtime_role(granted: Roles, tmp_path: Path) -> None:
    create_effects_table(granted.db_url)
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        # The handlers' own table is the application's: its grants are the application's.
        admin.execute(sql.SQL("GRANT INSERT ON public.test_effects TO {role};"
                              " GRANT USAGE ON SEQUENCE public.test_effects_id_seq TO {role}")
                      .format(role=sql.Identifier(granted.runtime)))
        # Drop every archive partition: the daemon's maintenance (a SECURITY DEFINER
        # function) must create them again, without any DDL privilege of its own.
        for (name,) in admin.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = 'jobd.jobs_archive'::regclass"
                "   AND c.relname <> 'jobs_archive_default'").fetchall():
            admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(SCHEMA, name)))
        admin.execute("CREATE TABLE public.ledger (job_id bigint PRIMARY KEY)")
        admin.execute(sql.SQL("GRANT INSERT ON public.ledger TO {}").format(
            sql.Identifier(granted.runtime)))
    (tmp_path / "privhandlers.py").write_text(TRANSACTIONAL_HANDLER)
    daemon = Daemon(tmp_path, granted.url(granted.runtime))
    config = make_config({"default": {"max_attempts": 2}},
                         handlers={**HANDLERS, "charge": "privhandlers:charge",
                                   "broken": "privhandlers:broken"})
    try:
        daemon.start(config)
        daemon.wait_workers_started("default", 1)
        with granted.connect(granted.producer) as producer:
            done = jobd.enqueue(producer, "ok", {"n": 1})
            failing = jobd.enqueue(producer, "broken", {"n": 2})
            charged = jobd.enqueue(producer, "charge", {"n": 3})
            # Crash attribution ends the dead worker's backends: the role's own, so allowed.
            poison = jobd.enqueue(producer, "suicide", {"n": 4})
        with psycopg.connect(granted.db_url, autocommit=True) as admin:
            admin.execute("SET search_path TO jobd")
            for job, state in ((done, "done"), (failing, "dead"), (charged, "done"),
                               (poison, "dead")):
                wait_until(lambda job=job, state=state: job_state(admin, job) == state, 40,
                           message=lambda job=job, state=state:
                               f"job {job} to be {state}\n{daemon.tail()}")
            assert admin.execute("SELECT job_id FROM public.ledger").fetchall() == [(charged,)]
            assert all("died: killed by SIGKILL" in e["error"]
                       for e in job_row(admin, poison)["errors"])

            # Yesterday to a week ahead, owned by the owner like the rest of the schema.
            def partitions() -> tuple[int, bool] | None:
                return admin.execute(
                    "SELECT count(*), bool_and(c.relowner = p.relowner)"
                    "  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                    "  JOIN pg_class p ON p.oid = i.inhparent"
                    " WHERE i.inhparent = 'jobd.jobs_archive'::regclass"
                    "   AND c.relname <> 'jobs_archive_default'").fetchone()

            wait_until(lambda: partitions() == (9, True), 30,
                       message=lambda: f"the archive partitions (now {partitions()})")
        # The CLI's reads and controls work as the runtime role too.
        url = granted.url(granted.runtime)
        status = cli("status", "--json", "--database-url", url)
        assert status.returncode == 0, status.stderr
        for args in (["lanes", "pause", "default"], ["lanes", "resume", "default"],
                     ["dlq", "replay", str(failing)], ["jobs", "show", str(done)]):
            result = cli(*args, "--database-url", url)
            assert result.returncode == 0, (args, result.stderr)
        assert not daemon.events("database statement failed", process=None), daemon.tail()
    finally:
        daemon.stop()


def test_the_runtime_role_cannot_change_the_schema(granted: Roles) -> None:
    with granted.connect(granted.runtime) as conn:
        refused(conn, "CREATE TABLE jobd.intruder (id int)")
        refused(conn, "CREATE FUNCTION jobd.intruder() RETURNS int LANGUAGE sql AS 'SELECT 1'")
        refused(conn, "ALTER TABLE jobd.jobs ADD COLUMN intruder int")
        refused(conn, "DROP TABLE jobd.dead_letter")
        refused(conn, "DROP INDEX jobd.jobs_claimable_idx")
        refused(conn, "TRUNCATE jobd.jobs")
        refused(conn, "CREATE OR REPLACE FUNCTION jobd.enqueue(handler text) RETURNS bigint"
                      " LANGUAGE sql AS 'SELECT 1::bigint'")
        refused(conn, "INSERT INTO jobd.schema_migrations VALUES (999, 'x', 'x')")
        refused(conn, "UPDATE jobd.settings SET value = '1'")
        refused(conn, "SELECT * FROM jobd.role_grants")
        # What it does need: rows, ids, the functions.
        assert conn.execute("SELECT count(*) FROM jobd.all_jobs").fetchone() is not None
        assert conn.execute("SELECT max(version) FROM jobd.schema_migrations").fetchone()


def test_migrate_as_the_runtime_role_changes_nothing_and_says_who_may(granted: Roles) -> None:
    url = granted.url(granted.runtime)
    # Up to date: nothing to change, so the systemd unit's `jobd migrate` before `jobd run`
    # succeeds as the runtime role.
    result = cli("migrate", "--database-url", url)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "schema jobd is up to date\n"
    line = assert_one_line_error(cli("migrate", "--database-url", url, "--grant-producer",
                                     granted.runtime))
    assert "only its owner may make: run jobd migrate as the role that owns it" in line
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        # As if this jobd were newer than the schema: its last migration is pending.
        admin.execute("DELETE FROM jobd.schema_migrations"
                      " WHERE version = (SELECT max(version) FROM jobd.schema_migrations)")
    line = assert_one_line_error(cli("migrate", "--database-url", url))
    assert "needs changes (migrations 0" in line and "run jobd migrate as the role" in line
    with granted.connect(granted.producer) as conn:
        refused(conn, "SELECT * FROM jobd.schema_migrations")


# --- the producer role -----------------------------------------------------------------------


def test_the_producer_role_can_only_enqueue(granted: Roles) -> None:
    with granted.connect(granted.producer) as conn:
        first = jobd.enqueue(conn, "ok", {"secret": "a"})
        row = conn.execute("SELECT jobd.enqueue('ok', '{\"n\": 2}')").fetchone()
        assert row is not None and row[0] > first
        for statement in ("SELECT payload FROM jobd.jobs", "SELECT * FROM jobd.all_jobs",
                          "SELECT * FROM jobd.dead_letter", "SELECT * FROM jobd.jobs_archive",
                          "SELECT * FROM jobd.outbox", "SELECT * FROM jobd.nodes",
                          "INSERT INTO jobd.jobs (lane, handler) VALUES ('default', 'ok')",
                          "UPDATE jobd.jobs SET state = 'dead'", "DELETE FROM jobd.jobs",
                          "SELECT jobd.drop_archive_partitions('infinity')",
                          "SELECT jobd.ensure_archive_partitions(30)",
                          "SELECT jobd.pause('default')",
                          f"SELECT * FROM jobd.cancel(ARRAY[{first}::bigint])",
                          "SELECT nextval('jobd.job_id_seq')",
                          "CREATE TABLE jobd.intruder (id int)"):
            refused(conn, statement)
        # Python's bulk path writes rows with COPY: that takes the runtime role.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            jobd.enqueue_many(conn, [jobd.JobSpec("ok", {})])
    result = cli("enqueue", "ok", "--payload", '{"n": 3}', "--database-url",
                 granted.url(granted.producer))
    assert result.returncode == 0, result.stderr
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        count = admin.execute("SELECT count(*) FROM jobd.jobs WHERE handler = 'ok'").fetchone()
    assert count == (3,)
    # Nor does it see the queue's state.
    status = cli("status", "--database-url", granted.url(granted.producer))
    assert status.returncode == 1 and "permission denied" in status.stderr


def test_a_pair_being_listed_is_recorded_as_wanted_by_the_producer_and_runtime_roles(
    granted: Roles,
) -> None:
    # An open transaction lists a new (lane, priority) pair. The producer's enqueue (as the
    # owner) and the runtime role's bulk path (the insert trigger, as the caller) do not wait
    # for it but record the pair as wanted; the runtime role's lane poll merges it.
    with connect(granted.db_url, SCHEMA, autocommit=False) as first:
        jobd.enqueue(first, "ok", lane="fresh", priority=3)
        with granted.connect(granted.producer) as producer:
            producer.execute("SET lock_timeout = '3s'")
            jobd.enqueue(producer, "ok", lane="fresh", priority=3)
        with granted.connect(granted.runtime) as runtime:
            runtime.execute("SET lock_timeout = '3s'")
            jobd.enqueue_many(runtime, [jobd.JobSpec("ok", lane="fresh", priority=3)])
        first.rollback()
    with granted.connect(granted.runtime) as runtime:
        assert runtime.execute("SELECT count(*) FROM jobd.lane_priorities_wanted"
                               ).fetchone() == (1,)  # the first one covers both
        assert runtime.execute("SELECT jobd.merge_wanted_priorities()").fetchone() == (1,)
        assert runtime.execute("SELECT lane, priority FROM jobd.lane_priorities"
                               ).fetchall() == [("fresh", 3)]


def test_enqueue_runs_as_the_owner_with_its_search_path_pinned(granted: Roles) -> None:
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        definers = admin.execute(
            "SELECT p.proname FROM pg_proc p"
            " WHERE p.pronamespace = 'jobd'::regnamespace AND p.prosecdef").fetchall()
        assert sorted(name for (name,) in definers) == [
            "drop_archive_partitions", "enqueue", "ensure_archive_partitions"]
        # Every function that sets a search_path (enqueue calls several) puts pg_temp last.
        paths = admin.execute(
            "SELECT p.proname, c FROM pg_proc p, unnest(p.proconfig) c"
            " WHERE p.pronamespace = 'jobd'::regnamespace AND c LIKE 'search_path=%'"
            ).fetchall()
        assert len(paths) > 10
        assert [(name, c) for name, c in paths if c != "search_path=jobd, pg_temp"] == []
        admin.execute("UPDATE jobd.settings SET value = '100' WHERE name = 'max_payload_bytes'")
    with granted.connect(granted.producer) as conn:
        # A temporary table named like jobd's settings, with a generous limit, comes first in
        # an unpinned search_path; the pinned one looks at it last, never for a jobd name.
        conn.execute("CREATE TEMP TABLE settings (name text, value jsonb)")
        conn.execute("INSERT INTO settings VALUES ('max_payload_bytes', '100000000')")
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute("SELECT jobd.enqueue('ok', jsonb_build_object('x', repeat('y', 500)))")


# --- migrate's grants ------------------------------------------------------------------------


def test_a_missing_role_is_a_one_line_error_and_changes_nothing(roles: Roles) -> None:
    result = cli("migrate", "--database-url", roles.db_url, "--grant-runtime", roles.runtime,
                 "--grant-producer", "jobd_no_such_role")
    line = assert_one_line_error(result)
    assert "role 'jobd_no_such_role' does not exist" in line
    with psycopg.connect(roles.db_url, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM jobd.role_grants").fetchone() == (0,)
        usage = admin.execute("SELECT has_schema_privilege(%s, 'jobd', 'USAGE')",
                              (roles.runtime,)).fetchone()
    assert usage == (False,)


def test_every_migrate_grants_again_what_was_added_since(granted: Roles) -> None:
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        # As a later migration would: a table the runtime role has not been granted yet.
        admin.execute("CREATE TABLE jobd.added_later (id int)")
    with granted.connect(granted.runtime) as conn:
        refused(conn, "SELECT * FROM jobd.added_later")
    result = cli("migrate", "--database-url", granted.db_url)
    assert result.returncode == 0, result.stderr
    assert f"granted runtime privileges to {granted.runtime}" in result.stdout
    with granted.connect(granted.runtime) as conn:
        assert conn.execute("SELECT count(*) FROM jobd.added_later").fetchone() == (0,)
    with granted.connect(granted.producer) as conn:
        refused(conn, "SELECT * FROM jobd.added_later")


def test_a_dropped_role_is_forgotten(granted: Roles) -> None:
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(
            sql.Identifier(granted.runtime + "_x")))
    gone = granted.runtime + "_x"
    try:
        assert cli("migrate", "--database-url", granted.db_url, "--grant-runtime",
                   gone).returncode == 0
    finally:
        with psycopg.connect(granted.db_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(
                r=sql.Identifier(gone)))
    result = cli("migrate", "--database-url", granted.db_url, "--json")
    assert result.returncode == 0, result.stderr
    assert {"role": gone, "kind": "runtime"} in json.loads(result.stdout)["forgotten"]
    with psycopg.connect(granted.db_url, autocommit=True) as admin:
        kept = admin.execute("SELECT role::text, kind FROM jobd.role_grants ORDER BY 1, 2"
                             ).fetchall()
    assert kept == sorted([(granted.producer, "producer"), (granted.runtime, "runtime")])


def test_a_role_whose_name_needs_quotes_is_granted_and_granted_again(db_url: str) -> None:
    # A role named as the cluster spells it: capitals and a space. Looked up as an identifier
    # it was refused ("invalid name syntax"), and 'Alice' was looked up as alice.
    role = f"ETL Jobs {uuid.uuid4().hex[:6]}"
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        first = cli("migrate", "--database-url", db_url, "--grant-producer", role)
        assert first.returncode == 0, first.stderr
        assert f"granted producer privileges to {role}" in first.stdout
        with connect(psycopg.conninfo.make_conninfo(db_url, user=role), SCHEMA) as conn:
            assert conn.execute("SELECT jobd.enqueue('ok')").fetchone() is not None
            refused(conn, "SELECT count(*) FROM jobd.jobs")
        # The ledger's name is found again by the next migrate, not taken for a dropped role.
        again = cli("migrate", "--database-url", db_url, "--json")
        assert again.returncode == 0, again.stderr
        report = json.loads(again.stdout)
        assert {"role": role, "kind": "producer"} not in report["forgotten"]
        assert {"role": role, "kind": "producer"} in report["granted"]
    finally:
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(
                r=sql.Identifier(role)))


def test_a_missing_role_whose_name_needs_quotes_is_named_quoted(db_url: str) -> None:
    result = cli("migrate", "--database-url", db_url, "--grant-runtime", "Jobd Nobody")
    line = assert_one_line_error(result)
    assert "role 'Jobd Nobody' does not exist" in line
    assert 'CREATE ROLE "Jobd Nobody" LOGIN' in line


def test_a_runtime_grant_to_the_schemas_own_owner_is_refused(db_url: str) -> None:
    # The runtime grant revokes writes to schema_migrations and settings and everything on
    # role_grants. Granted to the owner itself, it took from the owner what its own `jobd
    # migrate` writes: every later run failed, saying to run it as the owner.
    owner = f"jobd_owner_{uuid.uuid4().hex[:8]}"
    schema = f"jobd_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {r} LOGIN; GRANT CREATE ON DATABASE {d} TO {r}")
                      .format(r=sql.Identifier(owner),
                              d=sql.Identifier(admin.info.dbname)))
    url = psycopg.conninfo.make_conninfo(db_url, user=owner)
    try:
        created = cli("migrate", "--database-url", url, "--schema", schema)
        assert created.returncode == 0, created.stderr
        line = assert_one_line_error(cli("migrate", "--database-url", url, "--schema", schema,
                                         "--grant-runtime", owner))
        assert f"role {owner!r} owns schema {schema}" in line
        # Nothing changed: the owner migrates, grants and sets the payload limit as before.
        again = cli("migrate", "--database-url", url, "--schema", schema,
                    "--grant-producer", owner)
        assert again.returncode == 0, again.stderr
        with psycopg.connect(db_url, autocommit=True) as admin:
            kept = admin.execute(sql.SQL("SELECT role::text, kind FROM {}.role_grants").format(
                sql.Identifier(schema))).fetchall()
            assert kept == [(owner, "producer")]
            assert admin.execute(
                "SELECT has_table_privilege(%s, %s, 'INSERT')",
                (owner, f"{schema}.schema_migrations")).fetchone() == (True,)
    finally:
        with psycopg.connect(db_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(
                r=sql.Identifier(owner)))


def test_a_role_without_usage_on_the_schema_is_told_to_get_a_grant(roles: Roles,
                                                                     tmp_path: Path) -> None:
    # Not granted (or granted on another database): the schema's names are invisible to it,
    # which read as a schema not migrated yet, and `jobd migrate` itself said to run
    # `jobd migrate` first.
    url = roles.url(roles.runtime)
    config = tmp_path / "jobd.yaml"
    config.write_text(yaml.safe_dump(make_config({"default": {}})))
    # enqueue, cancel and the pauses call functions that name the schema: refused the
    # schema itself, they said "database error: permission denied for schema jobd".
    for args, code in ((["status"], 1), (["jobs", "list"], 1), (["run", "-c", str(config)], 1),
                       (["migrate"], 2), (["enqueue", "echo"], 1), (["jobs", "cancel", "1"], 1),
                       (["lanes", "pause", "default"], 1)):
        line = assert_one_line_error(cli(*args, "--database-url", url), code)
        assert f"role {roles.runtime!r} may not use schema jobd" in line, (args, line)
        assert "--grant-runtime" in line and "first" not in line, (args, line)
    # A schema that is really missing still says so.
    missing = assert_one_line_error(cli("status", "--database-url", roles.db_url,
                                        "--schema", "jobd_nowhere"), 1)
    assert "missing or incomplete" in missing

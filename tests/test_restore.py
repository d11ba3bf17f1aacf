"""Restoring a jobd database from a logical dump (docs/operations.md, "Backup and
point-in-time restore"): with pg_dump and pg_restore as an operator runs them, into a database
whose roles differ and under another schema name, then `jobd migrate` on the result."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cli_support import ok
from conftest import Databases
from psycopg import sql

import jobd
from jobd.db import connect
from jobd.localpg import LocalPgError, find_bindir
from jobd.migrate import schema_problem


@pytest.fixture(scope="module")
def bindir() -> Path:
    try:
        return find_bindir()
    except LocalPgError as exc:
        pytest.skip(f"no pg_dump here: {exc}")


def dump_and_restore(bindir: Path, source_url: str, target_url: str, *options: str) -> None:
    """``pg_dump -Fc`` of the source, ``pg_restore`` of it into the (empty) target."""
    dump = subprocess.run([str(bindir / "pg_dump"), "-Fc", "-d", source_url],
                          capture_output=True, check=True, timeout=120).stdout
    subprocess.run([str(bindir / "pg_restore"), "--exit-on-error", "-d", target_url, *options],
                   input=dump, capture_output=True, check=True, timeout=120)


@pytest.fixture
def producer(databases: Databases) -> Iterator[str]:
    role = f"jobd_producer_{uuid.uuid4().hex[:8]}"
    with databases.server.admin() as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        with databases.server.admin() as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE usename = %s", (role,))
            # The session's databases that still exist: other tests dropped theirs.
            existing = {row[0] for row in admin.execute("SELECT datname FROM pg_database")}
            for name in [n for n in databases.created if n in existing]:
                try:
                    with psycopg.connect(databases.server.url_for(name),
                                         autocommit=True) as conn:
                        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                except psycopg.OperationalError:
                    # Dropped since the listing (a finished test's database, dropped while
                    # the next tests run): what the role owned there went with it.
                    if name in existing - _databases(admin):
                        continue
                    raise
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _databases(admin: psycopg.Connection) -> set[str]:
    return {row[0] for row in admin.execute("SELECT datname FROM pg_database")}


def archive_partitions(conn: psycopg.Connection, schema: str) -> int:
    row = conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = %s::regclass",
                       (f"{schema}.jobs_archive",)).fetchone()
    assert row is not None
    return int(row[0])


def test_a_restore_without_privileges_keeps_the_archive_from_producers(
        databases: Databases, bindir: Path, producer: str) -> None:
    # Into a server whose roles are missing or named otherwise, the dump's GRANTs cannot be
    # replayed: the restore leaves them out and `jobd migrate --grant-*` grants anew.
    source, target = databases.migrated(), databases.empty()
    dump_and_restore(bindir, source, target, "--no-owner", "--no-acl")
    ok("migrate", "--database-url", target, "--grant-producer", producer)
    url = psycopg.conninfo.make_conninfo(target, user=producer)
    with psycopg.connect(url, autocommit=True) as conn:
        before = archive_partitions(conn, "jobd")
        assert before > 1
        for statement in ("SELECT jobd.drop_archive_partitions('infinity')",
                          "SELECT jobd.ensure_archive_partitions(30)"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
        assert archive_partitions(conn, "jobd") == before
        assert jobd.enqueue(conn, "ok", {}) > 0


def test_a_schema_restored_under_another_name_works_on_its_own_tables(
        databases: Databases, bindir: Path) -> None:
    # A copy restored beside the live schema: restore, rename, the live one back in place.
    source, target = databases.migrated(), databases.empty()
    with connect(source, "jobd", autocommit=True) as conn:
        copied = jobd.enqueue(conn, "ok", {"copied": True})
    dump_and_restore(bindir, source, target)
    with psycopg.connect(target, autocommit=True) as admin:
        admin.execute("ALTER SCHEMA jobd RENAME TO jobd_copy")
    ok("migrate", "--database-url", target)  # a fresh, live jobd beside the copy
    with connect(target, "jobd_copy", autocommit=True) as conn:
        # Its functions still name jobd, so the daemon is refused until migrate pins them.
        problem = schema_problem(conn, "jobd_copy")
        assert problem is not None and "jobd migrate --schema jobd_copy" in problem
    out = ok("migrate", "--database-url", target, "--schema", "jobd_copy")
    assert "pinned the search_path of" in out and "to schema jobd_copy" in out
    assert "pinned" not in ok("migrate", "--database-url", target, "--schema", "jobd_copy")
    with connect(target, "jobd_copy", autocommit=True) as conn:
        assert schema_problem(conn, "jobd_copy") is None
        added = conn.execute("SELECT jobd_copy.enqueue('ok', '{}')").fetchone()
        assert added is not None and added[0] > copied
        in_copy = conn.execute("SELECT id FROM jobd_copy.jobs ORDER BY id").fetchall()
        assert in_copy == [(copied,), (added[0],)]
        assert conn.execute("SELECT count(*) FROM jobd.jobs").fetchone() == (0,)
        # The archive upkeep works on the copy's partitions, not the live schema's.
        live = archive_partitions(conn, "jobd")
        conn.execute("SELECT jobd_copy.drop_archive_partitions('infinity')")
        assert archive_partitions(conn, "jobd_copy") == 1  # the default partition
        assert archive_partitions(conn, "jobd") == live

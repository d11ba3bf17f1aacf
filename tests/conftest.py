"""The test database harness.

Where the server comes from, in order:
1. ``JOBD_TEST_DATABASE_URL`` (an admin URL: the tests create and drop databases on it);
2. a local server on 127.0.0.1:5432 (user postgres, trust auth);
3. a throwaway cluster from the installed PostgreSQL binaries, deleted afterwards;
4. a testcontainers PostgreSQL where a Docker engine answers.
If none works, the run stops with a message naming what was tried.

Each run migrates one template database and clones a fresh database from it for every test
that asks for one; all of them are dropped at the end. A run stopped with SIGTERM (a CI
timeout, ``kill``) tears down as on Ctrl-C, so the daemons, clusters and databases the tests
started do not outlive it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import psycopg
import pytest
from psycopg import sql

from jobd.db import connect
from jobd.localpg import LocalPgError, throwaway_cluster
from jobd.migrate import migrate

LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
SCHEMA = "jobd"


def pytest_configure(config: pytest.Config) -> None:
    # Python's default for SIGTERM ends the process without running a single finally block:
    # every fixture's teardown is skipped, and the daemons a test started keep running.
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@dataclass
class Server:
    admin_url: str
    origin: str

    def url_for(self, dbname: str) -> str:
        return psycopg.conninfo.make_conninfo(self.admin_url, dbname=dbname)

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5)


def _answers(url: str) -> str | None:
    """None when the server answers, else why not."""
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        return None
    except psycopg.Error as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@contextlib.contextmanager
def _throwaway_cluster() -> Iterator[str]:
    with throwaway_cluster("jobd-test-pg-") as cluster:
        yield cluster.url


def postgres_container_class() -> type:
    """testcontainers' PostgresContainer, from where this release keeps it without a warning.

    Newer releases' ``testcontainers.postgres`` warns that it is deprecated, and the warning names
    the importing module, so the suite's ``filterwarnings = error`` turned it into the
    fallback's failure, with Docker running or not."""
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # releases before the community namespace
        from testcontainers.postgres import PostgresContainer
    return PostgresContainer


@contextlib.contextmanager
def _container() -> Iterator[str]:
    container_class = postgres_container_class()
    with container_class("postgres:16", username="postgres", password="postgres",
                         dbname="postgres", driver=None) as container:
        yield container.get_connection_url()


@contextlib.contextmanager
def _provide_server() -> Iterator[Server]:
    tried: list[str] = []
    explicit = os.environ.get("JOBD_TEST_DATABASE_URL")
    if explicit:
        problem = _answers(explicit)
        if problem:
            pytest.exit(f"JOBD_TEST_DATABASE_URL does not answer: {problem}", returncode=3)
        yield Server(explicit, "JOBD_TEST_DATABASE_URL")
        return
    problem = _answers(LOCAL_URL)
    if problem is None:
        yield Server(LOCAL_URL, "local server on 127.0.0.1:5432")
        return
    tried.append(f"local server: {problem}")
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(_throwaway_cluster())
            origin = "throwaway cluster"
        except LocalPgError as exc:
            tried.append(f"throwaway cluster: {exc}")
            try:
                url = stack.enter_context(_container())
                origin = "testcontainers"
            except Exception as exc:  # Docker missing shows up as many exception types.
                first_line = str(exc).splitlines()[0] if str(exc) else repr(exc)
                tried.append(f"testcontainers (needs a running Docker engine): {first_line}")
                pytest.exit("no PostgreSQL for the tests; tried: " + "; ".join(tried),
                            returncode=3)
        yield Server(url, origin)


class Databases:
    """Creates per-test databases as clones of one migrated template.

    A test's own database (``db_url``) is dropped on a thread once the test is over, while
    the next tests run: a DROP DATABASE takes the server about 90 ms, mostly waiting, and
    the run's 1,500 drops left to its end took a minute of it. The others are dropped at the
    end, with any the thread could not drop."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.prefix = f"jobd_test_{uuid.uuid4().hex[:8]}"
        self.template = f"{self.prefix}_template"
        self.counter = itertools.count(1)
        self.created: list[str] = []
        self._done: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._dropper = threading.Thread(target=self._drop_done, name="drop-test-databases",
                                         daemon=True)
        self._dropper.start()

    def release(self, url: str) -> None:
        """The test that had the database at ``url`` is over: drop it now, on the thread."""
        self._done.put(psycopg.conninfo.conninfo_to_dict(url)["dbname"])

    def _drop_done(self) -> None:
        with contextlib.ExitStack() as stack:
            admin: psycopg.Connection | None = None
            while (name := self._done.get()) is not None:
                try:
                    if admin is None:
                        admin = stack.enter_context(self.server.admin())
                    _drop(admin, name)
                except psycopg.Error:
                    admin = None  # left in self.created: drop_all tries it again
                else:
                    self.created.remove(name)

    def create_template(self) -> None:
        with self.server.admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.template)))
        self.created.append(self.template)
        with connect(self.server.url_for(self.template), SCHEMA, autocommit=True) as conn:
            migrate(conn, SCHEMA)

    def empty(self) -> str:
        """A new database with nothing in it; returns its URL."""
        name = f"{self.prefix}_{next(self.counter)}"
        with self.server.admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.created.append(name)
        return self.server.url_for(name)

    def migrated(self) -> str:
        """A new database with the jobd schema migrated; returns its URL."""
        name = f"{self.prefix}_{next(self.counter)}"
        with self.server.admin() as admin:
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(self.template)))
        self.created.append(name)
        return self.server.url_for(name)

    def drop_all(self) -> None:
        self._done.put(None)
        self._dropper.join()
        with self.server.admin() as admin:
            for name in reversed(self.created):
                _drop(admin, name)


def _drop(admin: psycopg.Connection, name: str) -> None:
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
        sql.Identifier(name)))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    with _provide_server() as server:
        yield server


@pytest.fixture(scope="session")
def databases(pg_server: Server) -> Iterator[Databases]:
    dbs = Databases(pg_server)
    dbs.create_template()
    try:
        yield dbs
    finally:
        dbs.drop_all()


@pytest.fixture
def db_url(databases: Databases) -> Iterator[str]:
    """URL of a fresh, migrated database for this test alone."""
    url = databases.migrated()
    yield url
    databases.release(url)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test's database, search_path = jobd."""
    with connect(db_url, SCHEMA, autocommit=True) as connection:
        yield connection

"""The session settings of jobd's connections (``database:`` in the config, jobd.db):
parsed and checked, applied on a direct connection and through a transaction-mode PgBouncer
alike, enforced by the server, and the application_name of each of the daemon's processes."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import daemon_support
import psycopg
import pytest
from conftest import Server
from daemon_support import Daemon, make_config, wait_until
from netcut import cutting_proxy
from pgbouncer_support import PACKAGE, pgbouncer_binary, running_pgbouncer

import jobd
from jobd import protocol, queue
from jobd.config import LaneConfig, parse
from jobd.db import (
    APPLICATION_NAME_MAX,
    DEFAULT_SESSION,
    ManagedConnection,
    SessionSettings,
    application_name,
    connect,
    is_pooled,
    options_settings,
    supervisor_session,
    worker_reply_cap,
    worker_session,
)
from jobd.errors import ConfigError, DatabaseUnavailable, UsageError

daemons = daemon_support.daemons  # the fixture

Daemons = Callable[..., Daemon]
TIGHT = SessionSettings(statement_timeout=0.3, lock_timeout=0.2,
                        idle_in_transaction_session_timeout=0.5)


# --- the config ----------------------------------------------------------------------------


def test_database_section_defaults() -> None:
    config = parse("database: {url: 'postgresql:///x'}\n")
    assert config.session == DEFAULT_SESSION
    assert (config.session.pooler, config.session.statement_timeout,
            config.session.lock_timeout, config.session.idle_in_transaction_session_timeout
            ) == ("auto", 60.0, 10.0, 60.0)
    assert config.listen_url is None


def test_database_section_settings() -> None:
    config = parse(
        "database:\n"
        "  url: postgresql://pgbouncer:6432/app\n"
        "  listen_url: postgresql://db:5432/app\n"
        "  pooler: transaction\n"
        "  statement_timeout: 2m\n"
        "  lock_timeout: 500ms\n"
        "  idle_in_transaction_session_timeout: 0\n")
    assert config.listen_url == "postgresql://db:5432/app"
    assert config.session == SessionSettings("transaction", 120.0, 0.5, 0.0)
    assert config.session.gucs("jobd") == {
        "search_path": "jobd", "statement_timeout": "120000", "lock_timeout": "500",
        "idle_in_transaction_session_timeout": "0"}


@pytest.mark.parametrize(("line", "message"), [
    ("pooler: session", "database.pooler: must be one of"),
    ("lock_timeout: -1", "database.lock_timeout: a duration cannot be negative"),
    ("statement_timeout: soon", "database.statement_timeout: expected a duration"),
    ("pool_mode: transaction", "database.pool_mode"),
])
def test_database_section_mistakes_name_line_and_key(line: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(f"database:\n  url: postgresql:///x\n  {line}\n", "jobd.yaml")
    assert str(caught.value).startswith("jobd.yaml:3:")
    assert message in str(caught.value)


def test_supervisor_session_is_bounded_whatever_the_config() -> None:
    assert supervisor_session(DEFAULT_SESSION).gucs(None) == {
        "statement_timeout": "10000", "lock_timeout": "2000",
        "idle_in_transaction_session_timeout": "60000", "jit": "off"}
    unbounded = SessionSettings(statement_timeout=0, lock_timeout=0)
    assert supervisor_session(unbounded).statement_timeout == 10.0
    assert supervisor_session(TIGHT).lock_timeout == 0.2


def test_worker_spec_carries_the_session_settings() -> None:
    spec = protocol.WorkerSpec(
        worker_id="n:default#0:ab", lane=LaneConfig("default"), handlers={}, database_url="",
        schema="jobd", slot=0, generation=1, status_fd=-1, wake_fd=-1, shutdown_timeout=1.0,
        node="web-1", session=TIGHT, worker_timeout=12.0)
    assert protocol.WorkerSpec.from_json(spec.to_json()) == spec


def test_a_workers_loop_gives_up_on_an_answer_before_its_worker_timeout() -> None:
    # A wait may follow a connection attempt (5 s) and a report may be a second late.
    assert worker_reply_cap(30.0, 1.0) == 23.0
    assert worker_reply_cap(4.0, 1.0) == 2.0
    capped = SessionSettings(statement_timeout=60.0, reply_cap=23.0)
    assert capped.reply_timeout() == 23.0
    assert SessionSettings(statement_timeout=10.0, reply_cap=23.0).reply_timeout() == 15.0
    assert SessionSettings(statement_timeout=0, reply_cap=23.0).reply_timeout() == 23.0
    assert DEFAULT_SESSION.reply_timeout() == 65.0


def test_application_names_name_role_detail_and_node_within_63_characters() -> None:
    assert application_name("supervisor", node="web-1") == "jobd supervisor node=web-1"
    assert application_name("cli") == "jobd cli"
    long = application_name("listener", node="n" * 100)
    assert len(long) == APPLICATION_NAME_MAX
    assert long.startswith("jobd listener node=nnn")
    prefix = protocol.backend_prefix("web-1:default#2:beef")
    assert re.fullmatch(r"jobd worker [0-9a-f]{12} ", prefix)


@pytest.mark.parametrize(("lane", "node", "role", "expected"), [
    ("default", "web-1", "", "default/2 node=web-1"),
    ("default", "web-1", "settle", "default/2 settle node=web-1"),
    ("default", "web-1", "handler", "default/2 handler node=web-1"),
    # A long node name is cut ...
    ("default", "n" * 60, "settle", "default/2 settle node=" + "n" * 16),
    # ... a long lane name too, to fit the node's, but never below 16 characters: the slot
    # and the role always show.
    ("customer_notifications_high_priority_eu", "web-1", "settle",
     "customer_notificat/2 settle node=web-1"),
    ("customer_notifications_high_priority_eu", "n" * 60, "handler",
     "customer_notific/2 handler node=nnnnnn"),
])
def test_a_workers_connections_show_slot_and_role_within_63_characters(
        lane: str, node: str, role: str, expected: str) -> None:
    spec = protocol.WorkerSpec(
        worker_id="web-1:x#2:beef", lane=LaneConfig(lane), handlers={},
        database_url="postgresql:///unused", schema="jobd", slot=2, generation=1,
        status_fd=-1, wake_fd=-1, shutdown_timeout=1.0, node=node)
    name = protocol.worker_connection_name(spec, role)
    assert len(name) <= APPLICATION_NAME_MAX
    assert name == protocol.backend_prefix(spec.worker_id) + expected


def test_the_urls_own_options_become_settings() -> None:
    assert options_settings("-c work_mem=8MB -cjit=off --geqo-threshold=9") == {
        "work_mem": "8MB", "jit": "off", "geqo_threshold": "9"}
    assert options_settings("") == {}
    with pytest.raises(UsageError, match="-c name=value"):
        options_settings("-v 3")


# --- on the server: direct and through PgBouncer --------------------------------------------


@pytest.fixture(params=["direct", "pgbouncer"])
def target(request: pytest.FixtureRequest, pg_server: Server, db_url: str) -> Iterator[str]:
    """The test database's URL, directly or through a PgBouncer in transaction mode."""
    if request.param == "direct":
        yield db_url
        return
    if pgbouncer_binary() is None:
        pytest.skip(f"needs pgbouncer (Debian package {PACKAGE})")
    with running_pgbouncer(pg_server.admin_url) as bouncer:
        yield bouncer.url_for(db_url)


def show(conn: psycopg.Connection, name: str) -> str:
    row = conn.execute(f"SHOW {name}").fetchone()
    assert row is not None
    return str(row[0])


def test_settings_are_in_force(target: str) -> None:
    with connect(target, "jobd", session=supervisor_session(DEFAULT_SESSION)) as conn:
        assert {name: show(conn, name) for name in (
            "search_path", "statement_timeout", "lock_timeout",
            "idle_in_transaction_session_timeout", "jit")} == {
            "search_path": "jobd", "statement_timeout": "10s", "lock_timeout": "2s",
            "idle_in_transaction_session_timeout": "1min", "jit": "off"}


def test_settings_in_the_url_apply_too(target: str) -> None:
    url = psycopg.conninfo.make_conninfo(target, options="-c work_mem=7MB -c lock_timeout=3s")
    # pooler: auto, so through PgBouncer the refusal of `options` is what makes it pooled.
    with connect(url, "jobd", session=DEFAULT_SESSION) as conn:
        # The URL's own settings, except where jobd's session settings name the same one.
        assert (show(conn, "work_mem"), show(conn, "lock_timeout")) == ("7MB", "10s")


def test_a_workers_sessions_read_their_jobs_times_in_utc(target: str, db_url: str,
                                                         conn: psycopg.Connection) -> None:
    # A server whose zone is not "UTC" (here through the URL, as a database's or role's
    # default would set it): the worker's statements run in UTC and its claim hands over the
    # same instants, while code that connects keeps the URL's zone. On a direct connection
    # the times come as UTC datetimes; through the pooler the client keeps the zone the
    # server reported at connect (the URL's options are refused there, so the server's).
    url = psycopg.conninfo.make_conninfo(target, options="-c TimeZone=America/New_York")
    run_at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    job_id = jobd.enqueue(conn, "h", run_at=run_at)
    with connect(url, "jobd", session=worker_session(DEFAULT_SESSION)) as worker_conn:
        assert show(worker_conn, "TimeZone") == "UTC"
        _, _, claimed = queue.settle_and_claim(
            worker_conn, [], [], queue.ClaimRequest("default", "w1", 10, 30.0))
    [job] = claimed.jobs
    assert job.id == job_id
    assert job.run_at == run_at
    if target == db_url:
        for moment in (job.run_at, job.created_at, job.lease_until):
            assert moment.tzinfo is UTC, moment
        with connect(url, "jobd", session=DEFAULT_SESSION) as users_conn:
            assert show(users_conn, "TimeZone") == "America/New_York"


def test_code_that_connects_gets_the_servers_own_timeouts(target: str) -> None:
    with connect(target, "jobd") as conn:
        assert show(conn, "statement_timeout") == "0"
        assert show(conn, "search_path") == "jobd"


def test_statement_timeout_is_enforced(target: str) -> None:
    with connect(target, "jobd", session=TIGHT) as conn, \
            pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
        conn.execute("SELECT pg_sleep(5)")


def test_lock_timeout_is_enforced(target: str, conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE public.locked (id int PRIMARY KEY)")
    conn.execute("INSERT INTO public.locked VALUES (1)")
    with connect(target, "jobd", session=TIGHT) as subject, conn.transaction():
        conn.execute("SELECT * FROM public.locked FOR UPDATE")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            subject.execute("UPDATE public.locked SET id = 2")


def test_idle_in_transaction_session_timeout_is_enforced(
        target: str, conn: psycopg.Connection, request: pytest.FixtureRequest) -> None:
    name = f"jobd idle test {time.monotonic_ns()}"

    def backends() -> int:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                           (name,)).fetchone()
        assert row is not None
        return int(row[0])

    subject = connect(target, "jobd", session=TIGHT, application_name=name, autocommit=False)
    try:
        assert is_pooled(subject) == (request.node.callspec.params["target"] == "pgbouncer")
        subject.execute("SELECT 1")  # and stays idle in the transaction
        wait_until(lambda: backends() == 1, 5, message="the idle backend")
        wait_until(lambda: backends() == 0, 10,
                   message="the server to end the transaction left idle")
    finally:
        subject.close()


# --- the daemon's processes ----------------------------------------------------------------


@pytest.mark.slow
def test_the_daemons_connections_name_node_lane_and_role(
        daemons: Daemons, conn: psycopg.Connection) -> None:
    # Outcomes apart said outright: auto depends on the machine's cores.
    config = make_config({"default": {"workers": 2, "settle_connection": True}})
    config["node"] = {"name": "web-1"}
    daemon = daemons(config)
    daemon.wait_workers_started("default", 2)

    def names() -> list[str]:
        rows = conn.execute("SELECT application_name FROM pg_stat_activity"
                            " WHERE datname = current_database() AND application_name"
                            " LIKE 'jobd %%' ORDER BY 1").fetchall()
        return [row[0] for row in rows]

    # Each worker's two: its claims', and the one its outcomes are written on.
    wait_until(lambda: len(names()) == 6, 15, message=lambda: f"6 jobd backends: {names()}")
    supervisor, listener, *workers = sorted(names(), key=lambda n: n.split()[1] != "supervisor")
    assert (supervisor, listener) == ("jobd supervisor node=web-1", "jobd listener node=web-1")
    assert sorted(re.sub(r"^jobd worker [0-9a-f]{12} ", "", w) for w in workers) == [
        "default/0 node=web-1", "default/0 settle node=web-1",
        "default/1 node=web-1", "default/1 settle node=web-1"]


def test_a_connection_lost_while_its_options_are_checked_is_unavailable_not_an_error(
    db_url: str,
) -> None:
    # connect() reads search_path back (a pooler may have dropped the options). A connection
    # terminated in that moment (a storm of pg_terminate_backend) raised psycopg's error,
    # which ManagedConnection does not take for a failed attempt: it ended the supervisor.
    def is_the_check(message: bytes) -> bool:
        return b"current_setting('search_path')" in message

    with cutting_proxy(db_url) as (proxy, proxied_url):
        proxy.cut_before(is_the_check)
        with pytest.raises(DatabaseUnavailable, match="cannot connect"):
            connect(proxied_url, "jobd")
        assert proxy.cut.is_set()
        link = ManagedConnection(proxied_url, "jobd", "jobd test")
        proxy.cut_before(is_the_check)
        assert link.ensure() is False and link.conn is None  # a failed attempt, retried later

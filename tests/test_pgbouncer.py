"""jobd through a real PgBouncer in transaction mode, with PgBouncer's default settings
(tests/pgbouncer_support.py): the fast path, psycopg's own statements, the CLI, SQL enqueue,
the daemon's full drain with LISTEN on a direct connection, and the daemon without LISTEN
(``database.listen_url`` unreachable or pointing at the pooler): one warning, the fallback
poll, ``jobd_listener_connected 0`` and `jobd status` saying so, until LISTEN is back."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from cli_support import clean_env, cli
from conftest import Server
from daemon_support import Daemon, make_config, wait_until
from pgbouncer_support import PACKAGE, PgBouncer, TcpRelay, pgbouncer_binary, running_pgbouncer
from prometheus_support import fetch

import jobd
from jobd import queue, testing
from jobd.db import DEFAULT_SESSION, SessionSettings, connect, is_pooled
from jobd.errors import UsageError
from jobd.listener import Listener
from jobd.localpg import free_port
from jobd.queue import ClaimRequest

daemons = daemon_support.daemons  # the fixture

Daemons = Callable[..., Daemon]

pytestmark = pytest.mark.skipif(pgbouncer_binary() is None,
                                reason=f"needs pgbouncer (Debian package {PACKAGE})")

NOOP_MODULE = '''\
"""A handler that does nothing: the drain measures jobd, not the handler."""


def noop(job):
    pass
'''
NOOP = {"noop": "pooltesthandlers:noop"}


@pytest.fixture(scope="module")
def bouncer(pg_server: Server) -> Iterator[PgBouncer]:
    with running_pgbouncer(pg_server.admin_url) as bouncer:
        yield bouncer


@pytest.fixture
def pooled_url(bouncer: PgBouncer, db_url: str) -> str:
    return bouncer.url_for(db_url)


def test_a_pooler_that_drops_the_options_instead_of_refusing_them_is_taken_for_one(
    pg_server: Server, db_url: str
) -> None:
    # PgBouncer with ignore_startup_parameters = options accepts the connection and drops
    # its settings: taken for direct, nothing of jobd's session was set, and a LISTEN there
    # (listen_url) reported itself connected and heard nothing.
    with running_pgbouncer(pg_server.admin_url,
                           ignore_startup_parameters="options,extra_float_digits") as lenient:
        url = lenient.url_for(db_url)
        conn = connect(url, session=SessionSettings(statement_timeout=42.0))
        try:
            assert is_pooled(conn)
            assert conn.execute("SHOW statement_timeout").fetchone() == ("42s",)
        finally:
            conn.close()
        with pytest.raises(UsageError, match="ignored the connection's options"):
            connect(url, session=SessionSettings(pooler="none"))
        listener = Listener(url, "jobd", listen_url=url)
        try:
            listener.link.ensure()
            assert not listener.connected
        finally:
            listener.close()


def pooled_daemon(daemons: Daemons, tmp_path: Path, pooled_url: str) -> Daemon:
    """A daemon whose database.url goes through PgBouncer (its handlers' effects and the
    test's own checks stay direct)."""
    daemon = daemons()
    daemon.run_url = pooled_url
    (tmp_path / "pooltesthandlers.py").write_text(NOOP_MODULE)
    return daemon


def pooled_config(lanes: dict[str, dict[str, Any]], database: dict[str, Any],
                  metrics_port: int | None = None, **supervisor: Any) -> dict[str, Any]:
    config = make_config(lanes, handlers=NOOP, supervisor=supervisor or None)
    config["database"] = database
    if metrics_port is not None:
        config["metrics"] = {"listen": f"127.0.0.1:{metrics_port}"}
    return config


def done_count(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM all_jobs WHERE state = 'done'").fetchone()
    assert row is not None
    return int(row[0])


def listener_gauge(port: int) -> float | None:
    for line in fetch(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith("jobd_listener_connected "):
            return float(line.split()[1])
    return None


def node_listening(url: str) -> list[bool | None]:
    result = cli("status", "--json", "--database-url", url)
    assert result.returncode == 0, result.stderr
    return [node["listening"] for node in json.loads(result.stdout)["nodes"]]


# --- the premise ---------------------------------------------------------------------------


def test_the_pooler_refuses_the_options_startup_parameter(pooled_url: str) -> None:
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter"):
        psycopg.connect(pooled_url, options="-c search_path=jobd", connect_timeout=5)


# --- connections ---------------------------------------------------------------------------


def test_jobd_connections_through_the_pooler_carry_their_settings(pooled_url: str) -> None:
    with connect(pooled_url, "jobd", session=DEFAULT_SESSION) as conn:
        assert is_pooled(conn)
        assert conn.execute("SHOW search_path").fetchone() == ("jobd",)
        conn.cursor().executemany("INSERT INTO lane_pauses (lane, paused_by) VALUES (%s, 't')",
                                  [("a",), ("b",)])
        assert conn.execute("SELECT count(*) FROM lane_pauses").fetchone() == (2,)
        assert conn.execute("SHOW lock_timeout").fetchone() == ("10s",)
        with conn.transaction():
            assert conn.execute("SHOW search_path").fetchone() == ("jobd",)
            assert conn.execute("SHOW statement_timeout").fetchone() == ("1min",)
    # Nothing stays on the server session: a plain client that gets it sees its own defaults.
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as plain:
        assert plain.execute("SHOW search_path").fetchone() != ("jobd",)


def test_psycopg_statements_repeat_across_clients_sharing_server_sessions(
        pooled_url: str) -> None:
    """More executions than psycopg's prepare threshold, alternating between clients that
    PgBouncer serves from the same server sessions: nothing is prepared, nothing collides."""
    with connect(pooled_url, "jobd") as one, connect(pooled_url, "jobd") as two:
        for n in range(12):
            for conn in (one, two):
                assert conn.execute("SELECT count(*) + %s FROM jobs", (n,)).fetchone() == (n,)
        assert one.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)


def test_the_fast_path_claims_and_settles_through_the_pooler(pooled_url: str,
                                                            conn: psycopg.Connection) -> None:
    jobd.enqueue_many(conn, [jobd.JobSpec("h", {"n": n}) for n in range(40)])
    links = [connect(pooled_url, "jobd"), connect(pooled_url, "jobd")]
    try:
        done: list[int] = []
        held: dict[int, list[jobd.Job]] = {0: [], 1: []}
        # Alternate the clients: each exchange lands on whichever server session PgBouncer
        # lends it, where the other client's exchange ran before.
        for turn in range(30):
            index = turn % 2
            done += [job.id for job in held[index]]
            _, _, claimed = queue.settle_and_claim(
                links[index], [job.lease for job in held[index]], [],
                ClaimRequest("default", f"w{index}", 3, 30.0))
            held[index] = list(claimed.jobs)
        for index in (0, 1):
            completed, _, _ = queue.settle_and_claim(
                links[index], [job.lease for job in held[index]], [], None)
            assert completed.applied == [job.id for job in held[index]]
            done += completed.applied
    finally:
        for link in links:
            link.close()
    assert len(done) == len(set(done)) == 40
    assert done_count(conn) == 40


# --- the CLI and SQL -----------------------------------------------------------------------


def test_cli_commands_through_the_pooler(pooled_url: str, conn: psycopg.Connection) -> None:
    env = clean_env(JOBD_DATABASE_URL=pooled_url)
    enqueued = cli("enqueue", "send_email", "--payload", '{"to": "a@example.com"}', env=env)
    assert enqueued.returncode == 0, enqueued.stderr
    job_id = int(enqueued.stdout.strip())
    listed = cli("jobs", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [job["id"] for job in json.loads(listed.stdout)] == [job_id]
    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    [lane] = json.loads(status.stdout)["lanes"]
    assert (lane["lane"], lane["pending"]) == ("default", 1)
    shown = cli("jobs", "show", str(job_id), env=env)
    assert shown.returncode == 0 and "send_email" in shown.stdout, shown.stderr
    row = conn.execute("SELECT handler, payload FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("send_email", {"to": "a@example.com"})


def test_sql_enqueue_through_the_pooler(pooled_url: str, conn: psycopg.Connection) -> None:
    # A client of the pooler: no automatic prepared statements (docs/pooler.md).
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as client:
        ids = [client.execute("SELECT jobd.enqueue('h', %s, run_at => now())",
                              (json.dumps({"n": n}),)).fetchone()[0] for n in range(8)]
        with client.transaction():
            ids.append(client.execute("SELECT jobd.enqueue('h')").fetchone()[0])
    assert conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s)", (ids,)).fetchone() \
        == (9,)


# --- jobd.testing through the pooler --------------------------------------------------------


@pytest.fixture
def alternating_url(pg_server: Server, db_url: str) -> Iterator[str]:
    """A pooler whose three server sessions take turns (``server_round_robin``): a client's
    consecutive transactions run on different server sessions, every time, and so do those
    of two clients that take turns."""
    with running_pgbouncer(pg_server.admin_url, default_pool_size="3",
                           server_round_robin="1") as alternating:
        url = alternating.url_for(db_url)
        clients = [psycopg.connect(url, prepare_threshold=None) for _ in range(3)]
        try:
            for client in clients:  # all held at once: the pool opens three
                client.execute("SELECT 1")
            for client in clients:  # and keeps them (one closed in a transaction it drops)
                client.commit()
        finally:
            for client in clients:
                client.close()
        yield url


def test_testing_helpers_on_an_autocommit_connection_leave_the_pooled_sessions_alone(
        alternating_url: str, conn: psycopg.Connection) -> None:
    """On an autocommit connection run_jobs switched the search_path for the session, ran
    jobd's statements, and switched it back, three transactions: through the pooler the
    claim ran on the other server session ("jobd's schema 'jobd' is missing"), and the
    session switched to jobd's schema stayed so for whoever got it next."""
    with psycopg.connect(alternating_url, autocommit=True, prepare_threshold=None) as client:
        jobd.enqueue_many(client, [jobd.JobSpec("h", {"n": n}) for n in range(3)])
        assert len(testing.assert_enqueued(client, "h")) == 3
        summary = testing.run_jobs(client, handlers={"h": lambda job: None})
        assert summary.done == 3, str(summary)
        paths = {client.execute("SHOW search_path").fetchone() for _ in range(4)}
        assert ("jobd",) not in paths
    assert done_count(conn) == 3


def test_run_jobs_on_a_pooled_url_prepares_nothing_on_the_transactional_handlers_connection(
        alternating_url: str, conn: psycopg.Connection) -> None:
    """The handler's connection run_jobs opens to a URL is opened as the worker's pool opens
    them: through a pooler, psycopg prepares none of its statements (it prepared the sixth
    run of one on a server session, and the next job's ran on the other one)."""
    @jobd.transactional
    def record(job: jobd.Job, handler_conn: psycopg.Connection) -> None:
        handler_conn.execute("SELECT %s::int", (job.payload["n"],))

    jobd.enqueue_many(conn, [jobd.JobSpec("record", {"n": n}) for n in range(12)])
    summary = testing.run_jobs(alternating_url, handlers={"record": record})
    assert summary.done == 12, str(summary)
    assert done_count(conn) == 12


# --- the daemon ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_daemon_drains_through_the_pooler_with_listen_on_a_direct_connection(
        daemons: Daemons, tmp_path: Path, pooled_url: str, db_url: str,
        conn: psycopg.Connection) -> None:
    jobs = 3000
    port = free_port()
    daemon = pooled_daemon(daemons, tmp_path, pooled_url)
    daemon.start(pooled_config({"default": {"workers": 2, "concurrency": 10}},
                               {"pooler": "transaction", "listen_url": db_url}, port))
    daemon.wait_workers_started("default", 2)
    wait_until(lambda: listener_gauge(port) == 1.0, 15,
               message=lambda: f"jobd_listener_connected 1\n{daemon.tail()}")
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as client:
        client.execute("SELECT jobd.enqueue('noop', jsonb_build_object('n', n))"
                       " FROM generate_series(1, %s) AS n", (jobs,))
    # Far below the 60 s fallback poll: the drain runs on wake-ups.
    wait_until(lambda: done_count(conn) == jobs, 120, interval=0.5,
               message=lambda: f"{jobs} jobs done (done: {done_count(conn)})\n{daemon.tail()}")
    row = conn.execute("SELECT count(*), max(attempts) FROM all_jobs").fetchone()
    assert row == (jobs, 1)
    failures = [e for e in daemon.events(process=None)
                if e.get("event") in ("database statement failed", "listen connection lost")
                or e.get("level") == "error"]
    assert failures == [], failures
    assert node_listening(db_url) == [True]


@pytest.mark.slow
def test_without_listen_the_daemon_polls_says_so_once_and_listens_again_when_it_can(
        daemons: Daemons, tmp_path: Path, pooled_url: str, db_url: str,
        conn: psycopg.Connection) -> None:
    relay = TcpRelay(("127.0.0.1", int(conn.info.port)))  # closed: nothing on its port yet
    port = free_port()
    daemon = pooled_daemon(daemons, tmp_path, pooled_url)
    daemon.start(pooled_config(
        {"default": {"workers": 1, "poll_interval": "1s"}},
        {"pooler": "transaction", "listen_url": relay.url_for(db_url)}, port,
        log_level="debug"))
    try:
        warning = daemon.wait_for_log("LISTEN unavailable; waking workers on the fallback poll")
        assert warning["level"] == "warning"
        first = jobd.enqueue(conn, "noop")
        wait_until(lambda: done_count(conn) == 1, 20,
                   message=lambda: f"job {first} done on the poll\n{daemon.tail()}")
        assert listener_gauge(port) == 0.0
        wait_until(lambda: node_listening(db_url) == [False], 15,
                   message="jobd status to say the node is not listening")
        # Attempts go on quietly: still one warning after several.
        daemon.wait_for_log("LISTEN still unavailable", count=2, timeout=20)
        assert len(daemon.events("LISTEN unavailable; waking workers on the fallback poll")) == 1
        assert daemon.events("database unavailable") == []

        mark = daemon.mark()
        relay.open()
        daemon.wait_for_log("LISTEN available again; notifications wake workers", since=mark,
                            timeout=40)
        wait_until(lambda: listener_gauge(port) == 1.0, 10, message="jobd_listener_connected 1")
        wait_until(lambda: node_listening(db_url) == [True], 15,
                   message="jobd status to say the node listens again")
        listening = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'jobd listener node=testnode' AND query LIKE 'LISTEN %'"
        ).fetchone()
        assert listening == (1,)
        jobd.enqueue(conn, "noop")
        wait_until(lambda: done_count(conn) == 2, 20, message="the second job done")
    finally:
        relay.close()


def test_listen_through_the_pooler_is_refused_and_the_poll_runs_the_jobs(
        daemons: Daemons, tmp_path: Path, pooled_url: str, db_url: str,
        conn: psycopg.Connection) -> None:
    """No listen_url and pooler: auto: jobd finds out that url is a pooler, and does not
    take a LISTEN there for one that works."""
    daemon = pooled_daemon(daemons, tmp_path, pooled_url)
    daemon.start(pooled_config({"default": {"workers": 1, "poll_interval": "1s"}}, {}))
    warning = daemon.wait_for_log("LISTEN unavailable; waking workers on the fallback poll")
    assert "transaction-mode pooler" in warning["error"]
    jobd.enqueue(conn, "noop")
    wait_until(lambda: done_count(conn) == 1, 20,
               message=lambda: f"the job done on the poll\n{daemon.tail()}")
    wait_until(lambda: node_listening(db_url) == [False], 15,
               message="jobd status to say the node is not listening")
    status = cli("status", "--database-url", db_url)
    assert "poll only (LISTEN unavailable)" in status.stdout


# --- the pooler paused ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_waiting_on_a_paused_pooler_gives_its_connection_up_before_it_is_taken_for_hung(
        daemons: Daemons, tmp_path: Path, pg_server: Server, db_url: str,
        conn: psycopg.Connection) -> None:
    """PgBouncer's PAUSE (a server restart behind it, say) holds every statement in its
    queue. A worker's statement there waited statement_timeout + 5 s, and the supervisor
    aborted the worker as hung after worker_timeout: a stack dump, a restart, its jobs run
    again. It gives its connection up first, and goes on once the pooler resumes."""
    with running_pgbouncer(pg_server.admin_url) as paused:  # PAUSE is for this test alone
        daemon = pooled_daemon(daemons, tmp_path, paused.url_for(db_url))
        daemon.start(pooled_config(
            {"default": {"workers": 1, "poll_interval": "1s"}},
            {"pooler": "transaction", "listen_url": db_url, "statement_timeout": "30s"},
            worker_timeout="4s"))
        [pid] = daemon.wait_workers_started("default", 1).values()
        jobd.enqueue(conn, "noop")
        wait_until(lambda: done_count(conn) == 1, 20,
                   message=lambda: f"the first job done\n{daemon.tail()}")
        mark = daemon.mark()
        paused.admin("PAUSE")
        try:
            def gave_up() -> list[dict[str, Any]]:
                return [e for e in daemon.events("database connection lost", process=None,
                                                 since=mark)
                        if e["process"] != "supervisor"
                        and "no answer" in e["error"]]

            # Three give-ups of at most half the worker_timeout each: the worker has
            # outlasted its worker_timeout in the queue (or was aborted, without the bound).
            wait_until(lambda: len(gave_up()) >= 3 or daemon.events("worker hung; aborting it"),
                       60, message=lambda: f"the worker's waits to end\n{daemon.tail()}")
        finally:
            paused.admin("RESUME")
        assert daemon.events("worker hung; aborting it") == []
        jobd.enqueue(conn, "noop")
        wait_until(lambda: done_count(conn) == 2, 30,
                   message=lambda: f"the second job done\n{daemon.tail()}")
        assert daemon.worker_pids("default") == {0: pid}
        assert conn.execute("SELECT max(attempts) FROM all_jobs").fetchone() == (1,)
        daemon.stop()  # before its pooler does


@pytest.mark.slow
def test_a_reload_that_shortens_worker_timeout_gives_the_workers_the_shorter_wait(
        daemons: Daemons, tmp_path: Path, pg_server: Server, db_url: str,
        conn: psycopg.Connection) -> None:
    """A worker's loop gives its connection up before worker_timeout (the test above), from
    the worker_timeout it was started with. A reload that shortened worker_timeout left the
    running workers with the longer wait while the supervisor took the shorter one: a paused
    pooler then got them aborted as hung, stack dumps and restarts, as if nothing bounded
    their waits."""
    with running_pgbouncer(pg_server.admin_url) as paused:  # PAUSE is for this test alone
        daemon = pooled_daemon(daemons, tmp_path, paused.url_for(db_url))
        database = {"pooler": "transaction", "listen_url": db_url, "statement_timeout": "30s"}
        lanes = {"default": {"workers": 1, "poll_interval": "1s"}}
        daemon.start(pooled_config(lanes, database, worker_timeout="60s"))
        daemon.wait_workers_started("default", 1)
        mark = daemon.reload(pooled_config(lanes, database, worker_timeout="4s"))
        daemon.wait_for_log("config reloaded", since=mark)
        # Done by a worker of the reloaded config: the pause below is for it.
        jobd.enqueue(conn, "noop")
        wait_until(lambda: done_count(conn) == 1, 20,
                   message=lambda: f"the first job done\n{daemon.tail()}")
        mark = daemon.mark()
        paused.admin("PAUSE")
        try:
            def gave_up() -> list[dict[str, Any]]:
                return [e for e in daemon.events("database connection lost", process=None,
                                                 since=mark)
                        if e["process"] != "supervisor" and "no answer" in e["error"]]

            # Three give-ups of at most half the new worker_timeout each have outlasted it.
            wait_until(lambda: len(gave_up()) >= 3 or daemon.events("worker hung; aborting it"),
                       60, message=lambda: f"the worker's waits to end\n{daemon.tail()}")
        finally:
            paused.admin("RESUME")
        assert daemon.events("worker hung; aborting it") == [], daemon.tail()
        daemon.stop()  # before its pooler does

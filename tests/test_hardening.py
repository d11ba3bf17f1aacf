"""What a fault suite and a new user found, end to end against the real daemon.

Transactional handlers see the user's search_path; a frozen worker cannot hold its job
hostage; the supervisor survives unreadable reloads, a notify socket nobody reads, and its
workers do not outlive it; a poison job does not take its neighbours' attempts; an
undecodable payload goes to the dead-letter queue at once; the logs say what happened.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, alive, effects, job_row, job_state, make_config, wait_until
from psycopg import sql

import jobd
from jobd.supervisor import FINISH_WAIT, KILL_GRACE, STOP_MARGIN

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]

HANDLERS_MODULE = '''\
"""Handlers written the way users write them: unqualified table names."""

import logging
import os
import time

from testhandlers import _record

import jobd


@jobd.transactional
def order(job, conn):
    conn.execute("INSERT INTO orders (job_id, attempt) VALUES (%s, %s)", (job.id, job.attempt))
    hold = job.payload.get("hold_seconds", 0)
    if hold and job.attempt == 1:
        _record(job, "holding")  # the transaction is open, its row written, not committed
        time.sleep(hold)


def boom(job):
    raise RuntimeError("first line of the error\\nsecond line of it")


def masking(job):
    try:
        return job.payload["n"]
    except Exception as exc:
        raise LookupError("no usable payload") from exc


def chatty(job):
    print("hello from print")
    logging.getLogger("myapp").warning("hello from logging %s", 42)


def forks(job):
    """Forks, and the child comes back out of the handler (returns, or raises) instead of
    ending with os._exit; the parent waits for it and records how it ended."""
    pid = os.fork()
    if pid == 0:
        if job.payload.get("raise"):
            raise RuntimeError("the child's error")
        return
    _, status = os.waitpid(pid, 0)
    _record(job, f"child exit {os.waitstatus_to_exitcode(status)}")


def closes_all(job):
    """Closes every descriptor from 3 to 255, as daemonizing code does."""
    os.closerange(3, 256)


_kept = []


def takes_stderr(job):
    """Closes descriptor 2 and opens a file, which takes its number, and keeps it open."""
    os.close(2)
    _kept.append(open(job.payload["path"], "w"))
'''

HANDLERS = {**daemon_support.HANDLERS, "order": "hardhandlers:order",
            "boom": "hardhandlers:boom", "chatty": "hardhandlers:chatty",
            "masking": "hardhandlers:masking", "forks": "hardhandlers:forks",
            "takes_stderr": "hardhandlers:takes_stderr", "closes_all": "hardhandlers:closes_all"}


def config(lanes: dict[str, dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    return make_config(lanes, handlers=HANDLERS, **kwargs)


def new_daemon(daemons: Daemons, name: str = "jobd", url: str | None = None) -> Daemon:
    daemon = daemons(name=name)
    if url is not None:
        daemon.db_url = url
    (daemon.dir / "hardhandlers.py").write_text(HANDLERS_MODULE)
    return daemon


def wait_state(conn: psycopg.Connection, job_id: int, state: str, timeout: float,
               daemon: Daemon) -> None:
    wait_until(lambda: job_state(conn, job_id) == state, timeout,
               message=lambda: f"job {job_id} to be {state} (it is "
                               f"{job_state(conn, job_id)})\n{daemon.tail()}")


def orders(conn: psycopg.Connection, table: str = "public.orders") -> list[tuple[int, int]]:
    return conn.execute(sql.SQL("SELECT job_id, attempt FROM {} ORDER BY job_id").format(
        sql.SQL(table))).fetchall()


@pytest.fixture
def orders_table(effects_db: psycopg.Connection) -> psycopg.Connection:
    effects_db.execute("CREATE TABLE public.orders (job_id bigint PRIMARY KEY, attempt int)")
    return effects_db


# --- transactional handlers see the user's tables ----------------------------------------


def test_a_transactional_handler_writes_an_unqualified_table_in_public(
    daemons: Daemons, orders_table: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config({"default": {}}))
    job_id = jobd.enqueue(orders_table, "order", {})
    wait_state(orders_table, job_id, "done", 15, daemon)
    assert orders(orders_table) == [(job_id, 1)]
    assert job_row(orders_table, job_id)["attempts"] == 1


@pytest.fixture
def app_role(db_url: str, effects_db: psycopg.Connection) -> Iterator[str]:
    """A role whose default search_path is the schema `shop`, where `orders` lives; yields a
    URL that connects as it."""
    role = f"jobd_app_{secrets.token_hex(4)}"
    effects_db.execute("CREATE SCHEMA shop")
    effects_db.execute("CREATE TABLE shop.orders (job_id bigint PRIMARY KEY, attempt int)")
    effects_db.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    database = effects_db.info.dbname
    effects_db.execute(sql.SQL("ALTER ROLE {} IN DATABASE {} SET search_path = shop").format(
        sql.Identifier(role), sql.Identifier(database)))
    try:
        yield psycopg.conninfo.make_conninfo(db_url, user=role)
    finally:
        effects_db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(psycopg.conninfo.make_conninfo(db_url, dbname="postgres"),
                             autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_transactional_handler_follows_the_roles_default_search_path(
    daemons: Daemons, effects_db: psycopg.Connection, app_role: str
) -> None:
    daemon = new_daemon(daemons, url=app_role).start(config({"default": {}}))
    job_id = jobd.enqueue(effects_db, "order", {})
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert orders(effects_db, "shop.orders") == [(job_id, 1)]


# --- a frozen worker cannot hold a job hostage --------------------------------------------

FAST_SWEEP = {"worker_timeout": "120s", "duty_interval": "300ms"}
SHORT_LEASE = {"visibility_timeout": "2s", "heartbeat": "500ms", "concurrency": 1}


def holding_pid(conn: psycopg.Connection, job_id: int) -> int:
    [holding] = wait_until(lambda: effects(conn, job_id, "holding"), 15,
                           message="the handler to hold its transaction open")
    return int(holding["pid"])


def test_a_frozen_worker_loses_its_transactional_job_to_another_worker(
    daemons: Daemons, orders_table: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config(
        {"default": {**SHORT_LEASE, "workers": 2}}, supervisor=FAST_SWEEP))
    daemon.wait_workers_started("default", 2)
    job_id = jobd.enqueue(orders_table, "order", {"hold_seconds": 8})
    frozen = holding_pid(orders_table, job_id)
    os.kill(frozen, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        # Two leases (the frozen one runs out, then the retry's backoff) plus one sweep.
        wait_state(orders_table, job_id, "done", 15, daemon)
        assert time.monotonic() - frozen_at < 2 * 2.0 + 0.3 + 3.0
        assert orders(orders_table) == [(job_id, 2)]
    finally:
        mark = daemon.mark()
        os.kill(frozen, signal.SIGCONT)
    # The stale worker wakes up, finds its transaction gone, and changes nothing.
    lost = daemon.wait_for_log("lost the lease before finishing; result discarded",
                               process=None, since=mark, pid=frozen, timeout=20)
    assert (lost["job_ids"], lost["lane"]) == ([job_id], "default")
    assert orders(orders_table) == [(job_id, 2)]
    row = job_row(orders_table, job_id)
    assert (row["state"], row["attempts"]) == ("done", 2)
    assert "lease expired" in row["errors"][0]["error"]


def test_a_frozen_node_loses_its_transactional_job_to_another_node(
    daemons: Daemons, orders_table: psycopg.Connection
) -> None:
    frozen_node = new_daemon(daemons, name="frozen").start(config(
        {"default": SHORT_LEASE}, supervisor=FAST_SWEEP))
    frozen_node.wait_workers_started("default", 1)
    job_id = jobd.enqueue(orders_table, "order", {"hold_seconds": 8})
    holding_pid(orders_table, job_id)
    os.killpg(frozen_node.pid, signal.SIGSTOP)  # the whole node: supervisor and workers
    try:
        other = new_daemon(daemons, name="other")
        other.start({**config({"default": SHORT_LEASE}, supervisor=FAST_SWEEP),
                     "node": {"name": "othernode"}})
        wait_state(orders_table, job_id, "done", 20, other)
        assert orders(orders_table) == [(job_id, 2)]
    finally:
        mark = frozen_node.mark()
        os.killpg(frozen_node.pid, signal.SIGCONT)
    frozen_node.wait_for_log("lost the lease before finishing; result discarded",
                             process=None, since=mark, timeout=20)
    assert orders(orders_table) == [(job_id, 2)]
    assert job_state(orders_table, job_id) == "done"


def test_the_lane_timeout_bounds_a_frozen_handlers_transaction_on_the_server(
    daemons: Daemons, orders_table: psycopg.Connection
) -> None:
    """No sweep can help a node frozen alone (its lease never expires elsewhere); the server
    ends the idle transaction after the lane's timeout."""
    new_daemon(daemons).start(config(
        {"default": {"timeout": "2s", "visibility_timeout": "60s", "concurrency": 1}},
        supervisor={"worker_timeout": "120s"}))
    job_id = jobd.enqueue(orders_table, "order", {"hold_seconds": 30})
    frozen = holding_pid(orders_table, job_id)
    os.kill(frozen, signal.SIGSTOP)
    try:
        def handler_backends() -> list[tuple[str]]:
            return orders_table.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname ="
                " current_database() AND application_name LIKE %s",
                (f"jobd job {job_id}:%",)).fetchall()

        assert handler_backends(), "the handler's backend is named after its lease"
        wait_until(lambda: not handler_backends(), 10,
                   message="the server to end the frozen handler's transaction")
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert orders(orders_table) == []


# --- the supervisor survives, and its workers do not outlive it ---------------------------


def test_a_reload_of_a_file_that_is_not_utf8_is_refused(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config({"default": {"workers": 2}}))
    pids = daemon.wait_workers_started("default", 2)
    mark = daemon.mark()
    daemon.config_path.write_bytes(b"lanes:\n  default: {workers: \xff\xfe}\n")
    daemon.signal(signal.SIGHUP)
    refused = daemon.wait_for_log("reload refused; still running the previous config",
                                  since=mark)
    assert "UTF-8" in refused["error"] or "utf-8" in refused["error"]
    assert daemon.running()
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", 15, daemon)
    assert daemon.worker_pids("default") == pids


def test_workers_drain_and_release_when_the_supervisor_is_killed(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """Even a retiring worker (replaced by a reload, finishing its job) stops and gives its
    job back when the supervisor dies, instead of running on unaccounted for."""
    lanes = {"default": {"workers": 1, "concurrency": 2}}
    daemon = new_daemon(daemons).start(config(lanes, supervisor={"shutdown_timeout": "2s"}))
    [old] = daemon.wait_workers_started("default", 1).values()
    job_id = jobd.enqueue(effects_db, "slow", {"seconds": 120})
    wait_until(lambda: effects(effects_db, job_id, "start"), 10, message="the job to start")
    mark = daemon.mark()
    daemon.reload(config({"default": {"workers": 1, "concurrency": 3}},
                         supervisor={"shutdown_timeout": "2s"}))
    daemon.wait_for_log("worker retiring", since=mark, pid=old)
    [new] = daemon.wait_workers_started("default", 1, since=mark).values()
    os.kill(daemon.pid, signal.SIGKILL)
    wait_until(lambda: not alive(old) and not alive(new), 15,
               message=lambda: f"workers {old}, {new} to exit\n{daemon.tail()}")
    row = job_row(effects_db, job_id)
    assert (row["state"], row["claimed_by"], row["attempts"]) == ("pending", None, 0)


def test_a_notify_socket_nobody_reads_does_not_stall_the_supervisor(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as reader:
        reader.bind(address)  # bound, never read: its queue fills after a few messages
        daemon = new_daemon(daemons)
        environment = daemon.env()
        daemon.env = lambda: {**environment, "NOTIFY_SOCKET": address}  # type: ignore
        daemon.start(config({"default": {"workers": 1}}))
        daemon.wait_workers_started("default", 1)
        # Every job changes the supervisor's status line: far more updates than fit.
        for round_number in range(3):
            ids = [jobd.enqueue(effects_db, "slow", {"seconds": 0.05}) for _ in range(20)]
            for job_id in ids:
                wait_state(effects_db, job_id, "done", 15, daemon)
            mark = daemon.reload(config({"default": {"workers": 1 + round_number % 2}}))
            daemon.wait_for_log("config reloaded", since=mark)
        # Once systemd reads again, the state changes that were held back arrive.
        reader.settimeout(0.5)
        received = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(b"READY=1" in m for m in received):
            try:
                received.append(reader.recv(65536))
            except TimeoutError:
                continue
        assert any(b"READY=1" in m for m in received)


def test_at_sigterm_the_supervisor_asks_systemd_for_its_whole_stop(
    daemons: Daemons, tmp_path: Path
) -> None:
    """A shutdown_timeout raised above the unit's TimeoutStopSec (60 s) got the daemon
    SIGKILLed mid-drain: STOPPING=1 now carries EXTEND_TIMEOUT_USEC, the drain timeout plus
    the stop's own margin (the stragglers' kill, the duties' last batch and statements)."""
    address = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as reader:
        reader.bind(address)
        reader.settimeout(0.5)
        daemon = new_daemon(daemons)
        environment = daemon.env()
        daemon.env = lambda: {**environment, "NOTIFY_SOCKET": address}  # type: ignore
        daemon.start(config({"default": {"workers": 1}},
                            supervisor={"shutdown_timeout": "300s"}))

        def next_with(field: str) -> dict[str, str]:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    lines = reader.recv(65536).decode().split("\n")
                except TimeoutError:
                    continue
                message = dict(line.split("=", 1) for line in lines)
                if field in message:
                    return message
            raise AssertionError(f"no {field} from the supervisor\n{daemon.tail()}")

        assert "EXTEND_TIMEOUT_USEC" not in next_with("READY")
        daemon.signal(signal.SIGTERM)
        stopping = next_with("STOPPING")
        assert daemon.wait_exit(timeout=30) == 0
    assert stopping["STOPPING"] == "1"
    assert STOP_MARGIN >= KILL_GRACE + FINISH_WAIT
    assert int(stopping["EXTEND_TIMEOUT_USEC"]) == round((300 + STOP_MARGIN) * 1_000_000)


# --- a poison job does not take its neighbours down with it --------------------------------


def left(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT id, state, claimed_by, suspect, attempts, run_at > now()"
                        " FROM jobs ORDER BY id").fetchall()


def test_a_poison_among_many_fast_jobs_is_the_only_one_to_spend_attempts(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config(
        {"default": {"workers": 2, "concurrency": 4, "max_attempts": 3}},
        supervisor={"restart_backoff": {"base": "100ms", "cap": "500ms"}}))
    daemon.wait_workers_started("default", 2)
    specs = [jobd.JobSpec("ok", {"n": n}) for n in range(300)]
    specs.insert(150, jobd.JobSpec("suicide", {}))
    ids = jobd.enqueue_many(effects_db, specs)
    poison = ids[150]
    wait_state(effects_db, poison, "dead", 30, daemon)
    # Dead at its second crash alone (max_crashes, default 2), an attempt of 3 left: each
    # crash beside other jobs gave its attempt back.
    assert job_row(effects_db, poison)["attempts"] == 2
    wait_until(lambda: effects_db.execute(
        "SELECT count(*) FROM jobs").fetchone() == (0,), 30,
        message=lambda: f"every other job to finish: {left(effects_db)}\n{daemon.tail()}")
    dead = effects_db.execute("SELECT id FROM dead_letter").fetchall()
    assert dead == [(poison,)]
    attempts = effects_db.execute(
        "SELECT attempts, count(*) FROM jobs_archive GROUP BY attempts").fetchall()
    assert attempts == [(1, 300)]
    suspects = daemon.events("a worker died running several jobs; each runs alone next, to "
                             "find the one that killed it (their attempts are given back)")
    assert suspects and all(poison in e["suspect_job_ids"] for e in suspects)


def test_suspects_left_by_another_node_are_found_through_the_lane_poll(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """A worker looks for suspects when it starts and whenever its supervisor says some
    wait; the supervisor's fallback poll notices those another node's crash attribution
    made."""
    daemon = new_daemon(daemons).start(config({"default": {"poll_interval": "500ms"}}))
    daemon.wait_workers_started("default", 1)
    warm_up = jobd.enqueue(effects_db, "ok", {})  # the worker has looked, found none
    wait_state(effects_db, warm_up, "done", 15, daemon)
    [(job_id,)] = effects_db.execute(
        "INSERT INTO jobd.jobs (handler, suspect) VALUES ('ok', true) RETURNING id").fetchall()
    wait_state(effects_db, job_id, "done", 15, daemon)


def test_a_due_suspect_does_not_wait_for_a_busy_lane_to_empty(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """A worker told a suspect is due claims nothing more until it holds nothing, then runs
    the suspect alone, however much other work the lane has."""
    daemon = new_daemon(daemons).start(config({"default": {"poll_interval": "500ms"}}))
    daemon.wait_workers_started("default", 1)
    # Uneven durations, so the two slots rarely fall idle together by chance.
    backlog = jobd.enqueue_many(effects_db, [
        jobd.JobSpec("slow", {"seconds": 0.2 if n % 2 else 0.35}) for n in range(60)])
    wait_until(lambda: effects(effects_db, backlog[3], "end"), 15, message="the backlog to run")
    [(job_id,)] = effects_db.execute(
        "INSERT INTO jobd.jobs (handler, suspect) VALUES ('ok', true) RETURNING id").fetchall()
    wait_state(effects_db, job_id, "done", 15, daemon)
    still_waiting = effects_db.execute(
        "SELECT count(*) FROM jobd.jobs WHERE id = ANY(%s)", (backlog,)).fetchone()
    assert still_waiting is not None and still_waiting[0] > 10


# --- an accepted payload that cannot be decoded --------------------------------------------


@pytest.mark.parametrize("handler", ["slow", "masking"])
def test_an_undecodable_payload_is_dead_lettered_at_once(
    daemons: Daemons, effects_db: psycopg.Connection, handler: str
) -> None:
    """The handler reads the payload, which cannot be decoded: retrying cannot help, whatever
    exception the handler turns the failure into ("masking" raises one of its own)."""
    daemon = new_daemon(daemons).start(config({"default": {"max_attempts": 8}}))
    # Written by hand, past jobd.enqueue's rules: deeper than the worker's decoder goes.
    deep = "[" * 2000 + "]" * 2000
    [(job_id,)] = effects_db.execute(
        "INSERT INTO jobd.jobs (handler, payload) VALUES (%s, %s::jsonb) RETURNING id",
        (handler, deep)).fetchall()
    wait_state(effects_db, job_id, "dead", 15, daemon)
    row = job_row(effects_db, job_id)
    assert row["attempts"] == 1
    assert "payload cannot be decoded" in row["errors"][0]["error"]
    assert effects(effects_db, job_id, "end") == []
    entry = daemon.wait_for_log("job dead-lettered", process=None, job_id=job_id)
    assert entry["reason"] == "payload cannot be decoded"


# --- the logs tell an operator what happened ----------------------------------------------


def test_logs_name_each_failed_attempt_and_each_dead_job(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config({"default": {"max_attempts": 2}}))
    job_id = jobd.enqueue(effects_db, "boom", {"secret": "never logged"})
    wait_state(effects_db, job_id, "dead", 15, daemon)
    retry = daemon.wait_for_log("job failed; will retry", process=None, job_id=job_id)
    assert (retry["handler"], retry["lane"], retry["attempt"], retry["max_attempts"]) == (
        "boom", "default", 1, 2)
    assert retry["error"] == "RuntimeError: first line of the error"
    # Seconds as a number, as the other retry_in fields: one type per key for log stores.
    assert isinstance(retry["retry_in"], int | float)
    dead = daemon.wait_for_log("job dead-lettered", process=None, job_id=job_id)
    assert (dead["handler"], dead["attempt"], dead["max_attempts"], dead["reason"]) == (
        "boom", 2, 2, "attempts spent")
    assert "never logged" not in daemon.log_path.read_text()


def test_handler_output_and_logging_become_structured_records(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config({"default": {}},
                                              supervisor={"log_level": "debug"}))
    job_id = jobd.enqueue(effects_db, "chatty", {})
    wait_state(effects_db, job_id, "done", 15, daemon)
    printed = daemon.wait_for_log("hello from print", process=None)
    assert (printed["stream"], printed["job_id"], printed["handler"]) == ("stdout", job_id,
                                                                          "chatty")
    logged = daemon.wait_for_log("hello from logging 42", process=None)
    assert (logged["logger"], logged["level"], logged["job_id"]) == ("myapp", "warning", job_id)
    raw = [line for line in daemon.log_path.read_text().splitlines()
           if "hello from" in line and not line.startswith("{")]
    assert raw == []
    # Debug shows claims and wake-ups.
    claimed = daemon.wait_for_log("claimed", process=None)
    assert job_id in claimed["job_ids"]
    assert daemon.events("waking workers")


STRUCTLOG_APP = '''\
"""An application that sets structlog up at import, as structlog's documentation shows."""

import structlog

structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    logger_factory=structlog.PrintLoggerFactory(),
)
log = structlog.get_logger("structapp")


def handler(job):
    log.info("hello from structlog", n=job.payload["n"])
    print("hello from print", job.payload["n"])
'''


def test_an_application_that_configures_structlog_at_import_keeps_the_workers_running(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Every worker imports every handler. The application's configuration printed to
    # sys.stdout, which the worker turns into log records, and the worker's first record
    # waited forever on structlog's print lock: every worker of the node hung at start,
    # was killed as hung and restarted, and no job ran.
    daemon = new_daemon(daemons)
    (daemon.dir / "structapp.py").write_text(STRUCTLOG_APP)
    daemon.start(make_config({"default": {}},
                             handlers={**HANDLERS, "structapp": "structapp:handler"}))
    job_id = jobd.enqueue(effects_db, "structapp", {"n": 5})
    wait_state(effects_db, job_id, "done", 20, daemon)
    logged = daemon.wait_for_log("hello from structlog", process=None)
    assert (logged["n"], logged["job_id"], logged["handler"]) == (5, job_id, "structapp")
    printed = daemon.wait_for_log("hello from print 5", process=None)
    assert (printed["stream"], printed["job_id"]) == ("stdout", job_id)
    assert daemon.events("worker exited") == []
    raw = [line for line in daemon.log_path.read_text().splitlines()
           if "hello from" in line and not line.startswith("{")]
    assert raw == []


def test_a_reload_whose_handlers_import_slowly_does_not_hold_up_the_lanes(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """The reload's import check runs beside the loop: work keeps being woken and done."""
    daemon = new_daemon(daemons)
    gate = gated_module(daemon)
    debug = {"log_level": "debug"}  # the loop's relays are logged at debug
    daemon.start(config({"default": {}}, supervisor=debug))
    daemon.wait_workers_started("default", 1)
    mark = daemon.reload({**config({"default": {}}, supervisor=debug),
                          "handlers": {**HANDLERS, "later": "slowimport:run"}})
    wait_until((daemon.dir / "importing").exists, 15, message="the reload's import check")
    importing = daemon.mark()

    def relayed() -> bool:
        # A worker still claiming takes a job without a wake-up; once it sleeps armed, only
        # the loop's relay brings it the next one (its fallback poll is a minute away).
        job_id = jobd.enqueue(effects_db, "ok", {})
        wait_state(effects_db, job_id, "done", 15, daemon)
        return bool(daemon.events("waking workers", since=importing))

    wait_until(relayed, 20, interval=0.2, message="a wake-up relayed while the check imports")
    assert not daemon.events("config reloaded", since=mark)  # still importing
    gate.touch()
    daemon.wait_for_log("config reloaded", since=mark)


def gated_module(daemon: Daemon, *, in_workers_only: bool = False) -> Path:
    """A handler module whose import waits for a file (the returned path): in the boot
    check's process, or only in the workers' (``python -m jobd.worker``). It leaves a file
    named ``importing`` when it starts waiting."""
    gate = daemon.dir / "gate"
    only = "sys.argv[0].endswith('worker.py')" if in_workers_only else "True"
    (daemon.dir / "slowimport.py").write_text(
        "import os, sys, time\n"
        f"if {only}:\n"
        f"    open({str(daemon.dir / 'importing')!r}, 'w').close()\n"
        f"while {only} and not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.05)\n"
        "def run(job):\n"
        "    pass\n")
    return gate


def started_with_a_slow_import(daemons: Daemons, *, in_workers_only: bool = False
                               ) -> tuple[Daemon, Path]:
    """A daemon started with a handler whose import waits (gated_module), and its gate."""
    daemon = new_daemon(daemons)
    gate = gated_module(daemon, in_workers_only=in_workers_only)
    daemon.start({**config({"default": {}}), "handlers": {**HANDLERS, "later": "slowimport:run"}})
    return daemon, gate


def boot_check_running(daemon: Daemon) -> bool:
    return any("jobd.handlers" in line for line in daemon_support.children_of(daemon.pid).values())


def test_a_sigterm_while_the_handlers_import_at_start_stops_the_daemon_cleanly(
    daemons: Daemons,
) -> None:
    # Before, the signal took its default action: exit 143, nothing logged, the import
    # check orphaned.
    daemon, gate = started_with_a_slow_import(daemons)
    wait_until(lambda: boot_check_running(daemon), 15, message="the boot's import check")
    daemon.signal(signal.SIGTERM)
    gate.touch()
    assert daemon.wait_exit(15) == 0
    assert daemon.events("stopped before starting", signal="SIGTERM")
    assert not daemon.events("worker spawned")


def test_ctrl_c_while_the_handlers_import_at_start_stops_the_daemon_cleanly(
    daemons: Daemons,
) -> None:
    # Ctrl-C in a terminal (`make run`) sends SIGINT to the whole foreground process group,
    # the import check included, whose import then ends in KeyboardInterrupt. Before, that
    # was reported as a boot failure: exit code 3, "failed at import: KeyboardInterrupt".
    daemon, _gate = started_with_a_slow_import(daemons)
    wait_until((daemon.dir / "importing").exists, 15, message="the boot's import check")
    os.killpg(daemon.pid, signal.SIGINT)  # the daemon leads its own process group
    assert daemon.wait_exit(15) == 0
    assert daemon.events("stopped before starting", signal="SIGINT")
    assert not daemon.events("boot failure")
    assert not daemon.events("worker spawned")


def test_ctrl_c_while_a_worker_interpreter_starts_stops_the_daemon_cleanly(
    daemons: Daemons,
) -> None:
    # The window before `jobd.worker` holds its signals itself: the interpreter's start and
    # its imports. A sitecustomize (read by every interpreter on the daemon's PYTHONPATH)
    # waits there in the workers only. Before, the group's SIGINT ended the worker with a
    # KeyboardInterrupt traceback, and the supervisor logged a crash.
    daemon = new_daemon(daemons)
    gate = daemon.dir / "gate"
    (daemon.dir / "sitecustomize.py").write_text(
        "import os, time\n"
        "with open('/proc/self/cmdline', 'rb') as f:\n"
        "    worker = b'jobd.worker' in f.read()\n"
        "if worker:\n"
        f"    open({str(daemon.dir / 'starting')!r}, 'w').close()\n"
        f"while worker and not os.path.exists({str(gate)!r}):\n"
        "    time.sleep(0.05)\n")
    daemon.start(config({"default": {}}))
    wait_until((daemon.dir / "starting").exists, 15, message="a worker's interpreter")
    os.killpg(daemon.pid, signal.SIGINT)  # the daemon leads its own process group
    daemon.wait_for_log("draining", signal="SIGINT")
    gate.touch()
    assert daemon.wait_exit(20) == 0
    assert "KeyboardInterrupt" not in daemon.log_path.read_text(errors="replace")
    assert daemon.events("worker exited")
    assert not daemon.events("worker exited", level="error")

def test_a_sighup_while_the_handlers_import_at_start_is_a_reload_once_running(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Its default action is to exit (129), which systemd's Restart=on-failure does not undo.
    daemon, gate = started_with_a_slow_import(daemons)
    wait_until(lambda: boot_check_running(daemon), 15, message="the boot's import check")
    daemon.signal(signal.SIGHUP)
    gate.touch()
    daemon.wait_workers_started("default", 1)
    daemon.wait_for_log("config reloaded")
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", 15, daemon)


def test_a_sighup_to_the_process_group_while_the_handlers_import_at_start_is_no_boot_failure(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # A terminal's hangup reaches the boot's import check too. Before, its default action
    # ended the check, which the supervisor took for a handler that cannot be imported: exit
    # code 3, which systemd does not restart.
    daemon, gate = started_with_a_slow_import(daemons)
    wait_until((daemon.dir / "importing").exists, 15, message="the boot's import check")
    os.killpg(daemon.pid, signal.SIGHUP)  # the daemon leads its own process group
    gate.touch()
    daemon.wait_workers_started("default", 1)
    daemon.wait_for_log("config reloaded")
    assert not daemon.events("boot failure")
    job_id = jobd.enqueue(effects_db, "ok", {})
    wait_state(effects_db, job_id, "done", 15, daemon)


def test_a_newer_reload_that_is_refused_also_drops_the_one_still_being_checked(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # An edit whose import check is still running (a heavy application), then another edit
    # that is refused. "Still running the previous config" must stay true: before, the
    # earlier edit was applied once its check finished, a config no longer in the file.
    daemon = new_daemon(daemons)
    gate = gated_module(daemon)
    gate.touch()  # the start's own check passes at once
    daemon.start(config({"default": {}}))
    daemon.wait_workers_started("default", 1)
    gate.unlink()
    mark = daemon.reload({**config({"default": {}, "extra": {}}),
                          "handlers": {**HANDLERS, "later": "slowimport:run"}})
    wait_until(lambda: boot_check_running(daemon), 15, message="the reload's import check")
    daemon.reload("lanes: [this is not: valid yaml\n")
    daemon.wait_for_log("reload refused; still running the previous config", since=mark)
    wait_until(lambda: not boot_check_running(daemon), 5,
               message=lambda: f"the superseded check to end\n{daemon.tail()}")
    gate.touch()
    daemon.reload(config({"default": {}, "third": {}}))
    reloaded = daemon.wait_for_log("config reloaded", since=mark)
    assert reloaded["lanes"] == {"default": 1, "third": 1}
    assert not daemon.events("worker spawned", since=mark, lane="extra")


def test_a_worker_asked_to_drain_while_its_handlers_import_drains_and_is_no_crash(
    daemons: Daemons,
) -> None:
    daemon, gate = started_with_a_slow_import(daemons, in_workers_only=True)
    spawned = daemon.wait_for_log("worker spawned", lane="default")
    wait_until((daemon.dir / "importing").exists, 15, message="the worker's import")
    daemon.signal(signal.SIGTERM)  # the supervisor drains: SIGTERM to the importing worker
    wait_until(lambda: daemon.events("draining"), 15, message="the drain to begin")
    gate.touch()
    assert daemon.wait_exit(20) == 0
    [exited] = daemon.events("worker exited", pid=spawned["pid"])
    assert exited["level"] == "info", exited  # before: "killed by SIGTERM", a crash


# --- claiming ahead (prefetch) -------------------------------------------------------------


def held(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT coalesce(claimed_by, '-'), count(*) FROM jobd.jobs"
                             " GROUP BY 1").fetchall())


def test_a_drain_gives_the_buffered_jobs_back_at_once(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    daemon = new_daemon(daemons).start(config(
        {"default": {"workers": 1, "concurrency": 1, "prefetch": 4}},
        supervisor={"shutdown_timeout": "30s"}))
    daemon.wait_workers_started("default", 1)
    ids = jobd.enqueue_many(effects_db, [jobd.JobSpec("slow", {"seconds": 60})
                                         for _ in range(5)])
    wait_until(lambda: effects(effects_db, ids[0], "start"), 10, message="the first job")
    wait_until(lambda: sum(held(effects_db).values()) == 5 and "-" not in held(effects_db), 10,
               message=lambda: f"all five claimed, one running: {held(effects_db)}")
    daemon.signal(signal.SIGTERM)
    # The four waiting in the buffer are back at once, not after the 30 s drain.
    wait_until(lambda: held(effects_db).get("-") == 4, 5,
               message=lambda: f"the buffer to be released: {held(effects_db)}")
    rows = effects_db.execute("SELECT attempts FROM jobd.jobs WHERE claimed_by IS NULL"
                              ).fetchall()
    assert rows == [(0,)] * 4


def test_a_buffer_that_waits_too_long_goes_to_another_worker(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    """One worker claims a slow job and buffers three more; they wait behind it only a
    moment, then go back to the queue and the other worker runs them."""
    daemon = new_daemon(daemons).start(config(
        {"default": {"workers": 2, "concurrency": 1, "prefetch": 3}}))
    pids = set(daemon.wait_workers_started("default", 2).values())
    # One statement, one wake-up for four jobs: one worker (capacity 1 + 3) claims them all.
    slow, *quick = jobd.enqueue_many(
        effects_db, [jobd.JobSpec("slow", {"seconds": 30})] + [jobd.JobSpec("ok", {})] * 3)
    wait_until(lambda: effects(effects_db, slow, "start"), 10, message="the slow job")
    [slow_pid] = {e["pid"] for e in effects(effects_db, slow, "start")}
    for job_id in quick:
        wait_state(effects_db, job_id, "done", 15, daemon)
    ran_on = {e["pid"] for job_id in quick for e in effects(effects_db, job_id, "end")}
    assert ran_on <= pids - {slow_pid}
    assert [job_row(effects_db, job_id)["attempts"] for job_id in quick] == [1, 1, 1]


# --- handlers that damage their worker process -----------------------------------------------


FORKED_CHILD_EXITS = ("a process forked by a handler returned into jobd instead of ending "
                      "with os._exit(); it exits now (its parent's job runs on)")


def test_a_forked_child_that_comes_back_from_its_handler_exits_at_once(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # Before, the child ran on as a copy of the worker: it wrote to the run board it shares
    # with its parent, then waited forever for a job, outside the supervisor's reach (it
    # ignores SIGTERM, as workers do); a parent that waited for it never finished its job.
    daemon = new_daemon(daemons).start(config({"default": {"workers": 1}}))
    forking = [jobd.enqueue(effects_db, "forks", {}),
               jobd.enqueue(effects_db, "forks", {"raise": True})]
    neighbours = jobd.enqueue_many(effects_db, [jobd.JobSpec("ok", {})] * 10)
    for job_id in forking + neighbours:
        wait_state(effects_db, job_id, "done", 15, daemon)
        assert job_row(effects_db, job_id)["attempts"] == 1
    for job_id in forking:
        assert [e["kind"] for e in effects(effects_db, job_id)] == ["child exit 70"]
        daemon.wait_for_log(FORKED_CHILD_EXITS, process=None, job_id=job_id, level="error")
    # No copy of the worker outlives its job: the group holds the supervisor and its worker.
    wait_until(lambda: len(daemon_support.group_members(daemon.pid)) == 2, 5,
               message=lambda: f"the group to shrink: {daemon_support.group_members(daemon.pid)}")
    assert not daemon.events("worker exited")


def test_a_handler_that_takes_descriptor_2_leaves_the_workers_log_where_it_was(
    daemons: Daemons, effects_db: psycopg.Connection, tmp_path: Path
) -> None:
    # Before, every later record of the worker went to the file the handler opened (it took
    # the number 2), or nowhere had the handler only closed it.
    daemon = new_daemon(daemons).start(config({"default": {"workers": 1, "concurrency": 1}}))
    users_file = tmp_path / "users-file.txt"
    taker = jobd.enqueue(effects_db, "takes_stderr", {"path": str(users_file)})
    wait_state(effects_db, taker, "done", 15, daemon)
    failing = jobd.enqueue(effects_db, "boom", {}, max_attempts=1)
    wait_state(effects_db, failing, "dead", 15, daemon)
    daemon.wait_for_log("job dead-lettered", process=None, job_id=failing)
    assert users_file.read_text() == ""


def test_a_handler_that_closes_the_workers_descriptors_fails_alone_and_the_log_says_why(
    daemons: Daemons, effects_db: psycopg.Connection
) -> None:
    # The worker cannot go on without its pipes and sockets: it exits and is replaced, and
    # the job that did it is the one that fails. Before, the traceback reached the log one
    # line per record, as "info" output of the worker, and the exit said only "exit code 1".
    daemon = new_daemon(daemons).start(config({"default": {"workers": 1, "concurrency": 1}}))
    [first_pid] = daemon.wait_workers_started("default", 1).values()
    bad = jobd.enqueue(effects_db, "closes_all", {}, max_attempts=1)
    neighbours = jobd.enqueue_many(effects_db, [jobd.JobSpec("ok", {})] * 5)
    wait_state(effects_db, bad, "dead", 20, daemon)
    for job_id in neighbours:
        wait_state(effects_db, job_id, "done", 20, daemon)
        assert job_row(effects_db, job_id)["attempts"] == 1
    failed = daemon.wait_for_log("the worker's loop failed; the worker exits and is replaced",
                                 process=None, pid=first_pid, level="error")
    assert "Bad file descriptor" in failed["exception"]
    [exited] = daemon.events("worker exited", pid=first_pid)
    assert exited["cause"] == "exit code 5 (its loop failed)"
    assert "(its loop failed)" in job_row(effects_db, bad)["last_error"]

"""Database faults under load: storms of pg_terminate_backend against every jobd connection,
a crash restart (pg_ctl restart -m immediate) of a private cluster, and a server whose
connection slots are taken by 300 idle clients and then exhausted.

The soak (tests/test_soak.py) terminates one worker backend every couple of seconds; a storm
ends every jobd connection, the supervisor's and the listener's included, many times a
second, so the reconnect paths are taken while the others are still reconnecting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, wait_until
from fault_support import (
    HANDLER,
    LANE,
    create_effects_table,
    done_count,
    enqueue_load,
    fault_config,
    prepare,
    private_cluster_factory,
    scalar,
    wait_all_done,
)
from invariants import assert_invariants

import jobd
from jobd import queue
from jobd.db import connect
from jobd.jobs import JobSpec
from jobd.localpg import LocalCluster

daemons = daemon_support.daemons
effects_db = daemon_support.effects_db
private_cluster = private_cluster_factory

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]

TERMINATE_ALL = """
SELECT application_name, pg_terminate_backend(pid) FROM pg_stat_activity
 WHERE datname = current_database() AND application_name LIKE 'jobd %%'
   AND pid <> pg_backend_pid()
"""


class Storm(threading.Thread):
    """Terminates every jobd backend of the database every ``every`` seconds until stopped;
    counts the terminations by application_name."""

    def __init__(self, url: str, every: float = 0.2) -> None:
        super().__init__(name="terminate-storm", daemon=True)
        self.url = url
        self.every = every
        self.terminated: dict[str, int] = {}
        self.rounds = 0
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True,
                                 application_name="fault storm") as conn:
                while not self._stop_event.wait(self.every):
                    self.rounds += 1
                    for name, ok in conn.execute(TERMINATE_ALL).fetchall():
                        if ok:
                            self.terminated[str(name)] = self.terminated.get(str(name), 0) + 1
        except Exception as exc:  # reported by the test through self.errors
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        assert not self.is_alive(), "the storm did not stop"


def test_a_storm_of_backend_terminations_loses_and_doubles_nothing(
    daemons: Daemons, conn: psycopg.Connection, db_url: str
) -> None:
    create_effects_table(conn)
    daemon = prepare(daemons(name="storm")).start(fault_config())
    daemon.wait_workers_started(LANE, 2, timeout=30)
    ids = enqueue_load(conn, 300, hold=0.02)
    wait_until(lambda: done_count(conn, ids) >= 20, 30, message="the load to start")
    storm = Storm(db_url)
    storm.start()
    try:
        # Storm for as long as the supervisor and workers have each been hit a few times.
        wait_until(lambda: (storm.rounds >= 15 and len(storm.terminated) >= 3)
                   or not storm.is_alive(), 60, message=lambda: f"the storm: {storm.terminated}")
    finally:
        storm.stop()
    assert storm.errors == []
    names = set(storm.terminated)
    assert any(name.startswith("jobd supervisor") for name in names), names
    assert any(name.startswith("jobd listener") for name in names), names
    wait_all_done(conn, ids, 90, daemon)
    assert daemon.running(), daemon.tail()
    assert_invariants(conn, ids, context=f"{storm.terminated}\n{daemon.tail()}")


TURNOVER_LANE = "turnover"


def worker_backend(conn: psycopg.Connection, role: str = "node=") -> tuple[int, str | None]:
    """The pid and wait event type of the lane's worker connection: its claims' (``role``
    "node=") or the one its outcomes are written on ("settle")."""
    row = conn.execute(
        "SELECT pid, wait_event_type FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'jobd worker %%'"
        " AND application_name LIKE %s", [f"%{TURNOVER_LANE}/0 {role}%"]).fetchone()
    assert row is not None, f"no worker connection {role}"
    return int(row[0]), row[1]


@pytest.mark.parametrize(("settle_connection", "role"), [(False, "node="), (True, "settle")],
                         ids=["one connection", "outcomes apart"])
def test_a_connection_lost_while_the_slots_turn_over_loses_and_doubles_nothing(
    daemons: Daemons, effects_db: psycopg.Connection, db_url: str, settle_connection: bool,
    role: str,
) -> None:
    # The connection the outcomes go on waits on a row lock the test holds: with one
    # connection per worker (settle_connection: false) the worker's exchange, which waits
    # for the server while its handlers finish and its slots turn over (outcomes collected,
    # buffered jobs started); with the outcomes apart (jobd.settler) their batch, while the
    # worker goes on claiming and running jobs on its other connection. Then that connection
    # is terminated mid-statement. Nothing of it committed: the outcomes must still be
    # written, each job once.
    config = daemon_support.make_config({TURNOVER_LANE: {
        "concurrency": 2, "prefetch": 8, "settle_connection": settle_connection}})
    config["database"] = {"lock_timeout": "120s"}  # the test ends the wait, not the timeout
    daemon = daemons(config, name="turnover")
    daemon.wait_workers_started(TURNOVER_LANE, 1, timeout=30)
    ids = jobd.enqueue_many(effects_db, [
        jobd.JobSpec("slow", {"seconds": 0.3}, lane=TURNOVER_LANE) for _ in range(16)])

    def ended() -> int:
        return int(effects_db.execute("SELECT count(*) FROM public.test_effects"
                                      " WHERE kind = 'end'").fetchone()[0])

    def waits_on_lock() -> bool:
        return worker_backend(effects_db, role)[1] == "Lock"

    with connect(db_url, autocommit=False) as holder:
        # The first job, once running (not merely buffered): its outcome's write, 0.3 s from
        # now, will wait for this lock, with most of the jobs still to run.
        wait_until(lambda: daemon_support.effects(effects_db, ids[0], "start"), 30,
                   message="the first job to start")
        holder.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", [ids[0]])
        wait_until(waits_on_lock, 30,
                   message=lambda: f"the outcomes' write to wait\n{daemon.tail()}")
        blocked_at = ended()
        # More jobs end than the slots held: buffered jobs started while it waited.
        wait_until(lambda: ended() >= blocked_at + 4 or not waits_on_lock(),
                   30, message="the slots to turn over")
        assert waits_on_lock(), "the write stopped waiting"
        pid = worker_backend(effects_db, role)[0]
        assert effects_db.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
        holder.rollback()

    wait_until(lambda: all(daemon_support.job_state(effects_db, i) == "done" for i in ids), 60,
               message=lambda: f"every job done\n{daemon.tail()}")
    runs = effects_db.execute(
        "SELECT job_id, count(*) FILTER (WHERE kind = 'end') FROM public.test_effects"
        " GROUP BY job_id").fetchall()
    assert sorted(runs) == [(i, 1) for i in sorted(ids)]  # each ran once, none lost
    assert daemon.running(), daemon.tail()


@pytest.fixture
def cluster(private_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return private_cluster()


def test_a_crash_restart_of_the_server_loses_and_doubles_nothing(
    daemons: Daemons, cluster: LocalCluster
) -> None:
    with connect(cluster.url, autocommit=True) as setup:
        create_effects_table(setup)
        ids = enqueue_load(setup, 300, hold=0.02)
    daemon = prepare(daemons(name="crash"))
    daemon.db_url = cluster.url
    daemon.start(fault_config())
    daemon.wait_workers_started(LANE, 2, timeout=30)
    with connect(cluster.url, autocommit=True) as watcher:
        wait_until(lambda: done_count(watcher, ids) >= 20, 30, message="the load to start")
    mark = daemon.mark()
    cluster.restart("immediate")  # every backend killed, no checkpoint: crash recovery
    # jobd notices the loss (a worker's connection, at its next statement); the server may be
    # back by then, so no attempt to reconnect need fail.
    daemon.wait_for_log("database connection lost", process=None, since=mark, timeout=30)
    with connect(cluster.url, autocommit=True) as conn:
        wait_all_done(conn, ids, 120, daemon)
        assert daemon.running(), daemon.tail()
        assert_invariants(conn, ids, context=daemon.tail())


def test_a_claim_undone_by_a_crash_leaves_its_worker_a_token_no_later_claim_draws(
    private_cluster: Callable[..., LocalCluster],
) -> None:
    """A claim commits without waiting for its flush, so a crash of the server can undo it and
    the job is claimed again. The worker of the undone claim may still be running the job:
    nothing it writes with its token may pass for the new claim's. (Tokens drawn from a
    sequence repeated here: the sequence's progress is written to the WAL at its first use
    after a checkpoint, in the same unflushed WAL as the claim.)"""
    # The WAL writer waits up to 10 s between flushes: the undone claim is not left to chance.
    cluster = private_cluster(wal_writer_delay="10s")
    with connect(cluster.url, autocommit=True) as conn:
        job_id = jobd.enqueue(conn, "h", lane=LANE)
        conn.execute("CHECKPOINT")
        *_, first = queue.settle_and_claim(
            conn, [], [], queue.ClaimRequest(LANE, "worker-a", 10, 30.0))
        [stale] = [job.lease for job in first.jobs]
    cluster.restart("immediate")
    with connect(cluster.url, autocommit=True) as conn:
        state = conn.execute("SELECT state FROM jobd.jobs WHERE id = %s", (job_id,)).fetchone()
        assert state == ("pending",), "the crash was to undo the claim"
        *_, second = queue.settle_and_claim(
            conn, [], [], queue.ClaimRequest(LANE, "worker-b", 10, 30.0))
        [current] = [job.lease for job in second.jobs]
        assert current.id == stale.id == job_id
        assert current.token != stale.token
        assert queue.heartbeat(conn, [stale], 30.0).lease_lost == [job_id]
        assert queue.complete(conn, [stale]).lease_lost == [job_id]
        assert queue.complete(conn, [current]).applied == [job_id]


RESTARTS = 5


def wait_done_at_least(url: str, ids: list[int], count: int, daemon: Daemon) -> None:
    with connect(url, autocommit=True) as conn:
        wait_until(lambda: done_count(conn, ids) >= count, 120, interval=0.2,
                   message=lambda: f"{count} jobs done\n{daemon.tail()}")


@pytest.mark.slow_fault
def test_repeated_crash_restarts_under_a_larger_load_lose_and_double_nothing(
    daemons: Daemons, cluster: LocalCluster
) -> None:
    """The long version of the crash restart: two nodes, 3,000 jobs, a crash restart each
    time another sixth of them is done."""
    jobs = 3000
    with connect(cluster.url, autocommit=True) as setup:
        create_effects_table(setup)
        ids = enqueue_load(setup, jobs, hold=0.01)
    nodes = []
    for name in ("crash-a", "crash-b"):
        daemon = prepare(daemons(name=name))
        daemon.db_url = cluster.url
        nodes.append(daemon.start(fault_config(name)))
    for daemon in nodes:
        daemon.wait_workers_started(LANE, 2, timeout=60)
    for restart in range(1, RESTARTS + 1):
        wait_done_at_least(cluster.url, ids, restart * jobs // (RESTARTS + 1), nodes[0])
        cluster.restart("immediate")
    with connect(cluster.url, autocommit=True) as conn:
        wait_all_done(conn, ids, 180, *nodes)
        assert all(d.running() for d in nodes), nodes[0].tail()
        assert_invariants(conn, ids, context=nodes[0].tail())


# --- connection slots ------------------------------------------------------------------

IDLE_CLIENTS = 300
SPARE_SLOTS = 30  # what jobd's one node (2 workers x 4 handlers, supervisor, listener) needs
SQUEEZE_GRAB = 0.5  # seconds of taking freed slots after each termination of jobd's


def open_connections(url: str, count: int | None) -> list[psycopg.Connection]:
    """``count`` idle connections, or as many as the server accepts when None."""
    held: list[psycopg.Connection] = []
    while count is None or len(held) < count:
        try:
            held.append(psycopg.connect(url, autocommit=True, connect_timeout=5,
                                        application_name="idle client"))
        except psycopg.OperationalError as exc:
            if count is None and "too many clients" in str(exc):
                return held
            raise
    return held


def jobd_backends(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE"
                       " 'jobd %%'").fetchone()
    assert row is not None
    return int(row[0])


def squeeze_out_jobd(conn: psycopg.Connection, url: str,
                     filler: list[psycopg.Connection]) -> None:
    """Take every free slot and end jobd's connections until jobd holds none and no slot
    is free."""

    def squeezed() -> bool:
        filler.extend(open_connections(url, None))
        if jobd_backends(conn) == 0:
            return True
        conn.execute(TERMINATE_ALL)
        # The slots free as the terminated backends exit, and jobd's connections try again
        # at once (the listener's from a thread of its own): keep taking them meanwhile, so
        # that jobd's attempts meet a full server and back off.
        deadline = time.monotonic() + SQUEEZE_GRAB
        while time.monotonic() < deadline:
            filler.extend(open_connections(url, None))
        return False

    wait_until(squeezed, 30, interval=0.02, message="jobd to be left without a slot")


@pytest.fixture
def crowded_cluster(private_cluster: Callable[..., LocalCluster]
                    ) -> Iterator[tuple[LocalCluster, list[psycopg.Connection]]]:
    """A cluster with room for jobd and 300 idle clients, the clients connected."""
    cluster = private_cluster(max_connections=str(IDLE_CLIENTS + SPARE_SLOTS))
    idle = open_connections(cluster.url, IDLE_CLIENTS)
    try:
        yield cluster, idle
    finally:
        for client in idle:
            client.close()


def test_idle_clients_and_then_exhausted_slots_degrade_jobd_with_clear_errors_and_it_recovers(
    daemons: Daemons, crowded_cluster: tuple[LocalCluster, list[psycopg.Connection]]
) -> None:
    cluster, idle = crowded_cluster
    conn = idle[0]  # one of the idle clients does the test's own queries
    create_effects_table(conn)
    daemon = prepare(daemons(name="crowded"))
    daemon.db_url = cluster.url
    daemon.start(fault_config())
    daemon.wait_workers_started(LANE, 2, timeout=30)
    # Beside 300 idle clients, jobd works as usual.
    first = enqueue_load(conn, 100, prefix="first")
    wait_all_done(conn, first, 60, daemon)

    # Every slot left is taken, and jobd's connections are ended until it has none: each
    # slot a termination frees goes to another idle client or back to jobd, never back to
    # a client, so jobd ends up with none.
    mark = daemon.mark()
    filler: list[psycopg.Connection] = []
    try:
        squeeze_out_jobd(conn, cluster.url, filler)
        second = enqueue_load(conn, 100, prefix="second")
        refused = daemon.wait_for_log(
            "database unavailable", lambda e: "too many clients" in str(e.get("error")),
            process=None, since=mark, timeout=30)
        assert "\n" not in str(refused["error"]), "one line, no traceback"
        assert daemon.running(), daemon.tail()
        assert done_count(conn, second) == 0  # without a connection, jobd claims nothing
        # A node started now cannot connect either: it exits with a runtime failure (for its
        # service manager to start it again) saying why, in one line.
        latecomer = prepare(daemons(name="latecomer"))
        latecomer.db_url = cluster.url
        latecomer.start(fault_config("latecomer"))
        assert latecomer.wait_exit(30) == 1
        [line] = latecomer.log_path.read_text().splitlines()
        assert line.startswith("jobd: cannot connect to the database") \
            and "too many clients" in line, line
    finally:
        for client in filler:
            client.close()
    # The slots are free again: jobd reconnects and finishes everything.
    wait_all_done(conn, second, 90, daemon)
    assert daemon.running(), daemon.tail()
    assert sum(1 for client in idle if not client.closed) == IDLE_CLIENTS
    assert_invariants(conn, first + second, context=daemon.tail())


# --- the database away and back --------------------------------------------------------

OUTAGE_SECONDS = 18.0
# Back to work this soon after the server is: the longest wait between connection attempts
# (db.RECONNECT_DELAY_CAP, 5 s) and a claim.
PICKUP_AFTER_RETURN = 8.0


def running_transactions(conn: psycopg.Connection) -> int:
    """Transactional runs under way: their backends carry the job's lease in their name."""
    return int(scalar(conn, "SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name LIKE 'jobd job %%'"))


def errors_of(conn: psycopg.Connection, ids: list[int]) -> list[Any]:
    return [row[0] for row in conn.execute(
        "SELECT errors FROM jobd.all_jobs WHERE id = ANY(%s) AND errors <> '[]'::jsonb",
        (ids,)).fetchall()]


def test_a_restart_and_an_outage_of_the_server_leave_no_stall_no_failed_job_no_log_flood(
    daemons: Daemons, cluster: LocalCluster
) -> None:
    with connect(cluster.url, autocommit=True) as setup:
        create_effects_table(setup)
    daemon = prepare(daemons(name="outage"))
    daemon.db_url = cluster.url
    daemon.start(fault_config(lane={"workers": 1, "concurrency": 2}))
    daemon.wait_workers_started(LANE, 1, timeout=30)
    with connect(cluster.url, autocommit=True) as conn:
        # Both of the lane's handler connections open, then idle in the pool.
        warm = enqueue_load(conn, 2, hold=1.0, prefix="warm")
        wait_until(lambda: running_transactions(conn) == 2, 30, message="two runs at once")
        wait_all_done(conn, warm, 30, daemon)

    # A clean restart closes them while they sit idle: the next runs must not fail for it.
    cluster.restart("fast")
    with connect(cluster.url, autocommit=True) as conn:
        after_restart = enqueue_load(conn, 4, prefix="restart")
        wait_all_done(conn, after_restart, 30, daemon)
        assert errors_of(conn, after_restart) == [], daemon.tail()
        # Both connections in a run when the server stops, the pool's attempts to replace
        # them fail meanwhile, their waits doubling. One attempt each: no rerun takes the
        # slots after the outage.
        held = jobd.enqueue_many(conn, [JobSpec(HANDLER, {"hold": 2.0}, lane=LANE,
                                                max_attempts=1) for _ in range(2)])
        wait_until(lambda: running_transactions(conn) == 2, 30, message="two runs at once")
    mark = daemon.mark()
    cluster.stop()
    stopped = time.monotonic()
    wait_until(lambda: time.monotonic() - stopped >= OUTAGE_SECONDS, OUTAGE_SECONDS + 5,
               interval=0.5, message="the outage to last")  # the fault's duration
    cluster.start()
    back = time.monotonic()
    with connect(cluster.url, autocommit=True) as conn:
        [fresh] = enqueue_load(conn, 1, prefix="fresh")
        wait_until(lambda: done_count(conn, [fresh]) == 1, 30, interval=0.1,
                   message=lambda: f"the job enqueued after the outage\n{daemon.tail()}")
        waited = time.monotonic() - back
        assert waited < PICKUP_AFTER_RETURN, f"{waited:.1f} s after the server was back"
        assert errors_of(conn, [fresh]) == [], daemon.tail()
        wait_until(lambda: scalar(conn, "SELECT count(*) FROM jobd.jobs WHERE id = ANY(%s)",
                                  (held,)) == 0, 30, message="the held runs' outcomes")
        assert daemon.running(), daemon.tail()
        assert_invariants(conn, warm + after_restart + held + [fresh], settled=True,
                          context=daemon.tail())

    # The log: each connection says once that the database is unavailable, and once that it
    # is back.
    unavailable: dict[str, int] = {}
    for entry in daemon.events("database unavailable", process=None, since=mark):
        name = str(entry["connection"])
        unavailable[name] = unavailable.get(name, 0) + 1
    assert unavailable and max(unavailable.values()) == 1, unavailable

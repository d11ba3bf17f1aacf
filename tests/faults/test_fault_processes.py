"""Process faults under load, between two nodes sharing one database: workers and then a
whole node SIGKILLed (the other node takes its jobs over once their leases run out), and a
node SIGSTOPped past its leases and woken again (its stale results are discarded).

The soak (tests/test_soak.py) SIGKILLs workers of one node thousands of times; the single-job
versions of the freeze are in tests/test_hardening.py. These add the second node and end with
the suite's invariants.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, alive, wait_until
from fault_support import (
    HANDLER,
    LANE,
    claimed_by_node,
    create_effects_table,
    done_count,
    enqueue_load,
    fault_config,
    prepare,
    wait_all_done,
)
from invariants import assert_invariants

daemons = daemon_support.daemons

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]


# Both nodes materialize it; its cursor is set back so dozens of occurrences fall due at
# once, and are fired while a node is killed.
CATCHING_UP = {"id": "catching-up", "cron": "* * * * *", "handler": HANDLER, "lane": LANE,
               "catchup": "all"}
MISSED_MINUTES = 40


def two_nodes(daemons: Daemons, schedules: list[dict[str, Any]] | None = None
              ) -> tuple[Daemon, Daemon]:
    first = prepare(daemons(name="alpha")).start(fault_config("alpha", schedules=schedules))
    second = prepare(daemons(name="beta")).start(fault_config("beta", schedules=schedules))
    first.wait_workers_started(LANE, 2, timeout=30)
    second.wait_workers_started(LANE, 2, timeout=30)
    return first, second


def test_a_killed_node_s_jobs_are_finished_by_the_other_node(
    daemons: Daemons, conn: psycopg.Connection
) -> None:
    create_effects_table(conn)
    alpha, beta = two_nodes(daemons, [CATCHING_UP])
    ids = enqueue_load(conn, 400, hold=0.05)
    rewound = conn.execute(
        "UPDATE jobd.schedules SET materialized_until = now() - make_interval(mins => %s)"
        " WHERE id = %s", (MISSED_MINUTES, CATCHING_UP["id"])).rowcount
    assert rewound == 1
    # First single workers of alpha, while they hold jobs: its supervisor fails their jobs
    # and restarts them.
    wait_until(lambda: claimed_by_node(conn, "alpha") >= 2, 30, message="alpha to hold jobs")
    victims = list(alpha.worker_pids(LANE).values())
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    mark = alpha.mark()
    alpha.wait_workers_started(LANE, 2, since=mark, timeout=30)
    # Then the whole node, supervisor and workers at once, in the middle of its jobs.
    wait_until(lambda: claimed_by_node(conn, "alpha") >= 2, 30,
               message="alpha's new workers to hold jobs")
    assert done_count(conn, ids) < len(ids), "the load ended before the node was killed"
    os.killpg(alpha.pid, signal.SIGKILL)
    alpha.wait_exit(10)
    orphaned = claimed_by_node(conn, "alpha")

    wait_all_done(conn, ids, 90, beta)
    fired = wait_until(lambda: scheduled_jobs(conn) if len(scheduled_jobs(conn))
                       >= MISSED_MINUTES else None, 30, message="the missed occurrences")
    wait_all_done(conn, fired, 60, beta)
    assert beta.running(), beta.tail()
    # The orphaned jobs (the load's or the schedule's) were retried by beta after their
    # leases ran out.
    recovered = conn.execute(
        "SELECT count(*) FROM jobd.jobs_archive WHERE id = ANY(%s) AND claimed_by LIKE 'beta%%'"
        " AND errors::text LIKE '%%lease expired%%'", (ids + fired,)).fetchone()
    assert recovered is not None and recovered[0] >= 1 and orphaned >= 1, (recovered, orphaned)
    assert_invariants(conn, ids + fired, context=beta.tail())


def test_workers_of_a_killed_supervisor_give_their_jobs_to_the_other_node(
    daemons: Daemons, conn: psycopg.Connection
) -> None:
    """SIGKILL of the supervisor alone: its workers see it gone, stop claiming, finish or
    give back what they hold and exit; the other node runs the rest."""
    create_effects_table(conn)
    alpha, beta = two_nodes(daemons)
    workers = list(alpha.worker_pids(LANE).values())
    ids = enqueue_load(conn, 300, hold=0.05)
    wait_until(lambda: claimed_by_node(conn, "alpha") >= 2, 30, message="alpha to hold jobs")
    os.kill(alpha.pid, signal.SIGKILL)
    alpha.wait_exit(10)
    wait_until(lambda: not any(alive(pid) for pid in workers), 30,
               message=lambda: f"alpha's workers {workers} to exit\n{alpha.tail()}")
    # Nothing waits for a lease to run out: what alpha held was finished or given back.
    assert claimed_by_node(conn, "alpha") == 0
    wait_all_done(conn, ids, 90, beta)
    assert beta.running(), beta.tail()
    assert_invariants(conn, ids, context=alpha.tail())


def open_handler_transactions(conn: psycopg.Connection, node: str) -> int:
    """Transactional handlers of ``node`` inside their transaction: their backend carries
    the lease in application_name (jobd.recovery)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity AS a JOIN jobd.jobs AS j"
        " ON a.application_name = 'jobd job ' || j.id || ':' || j.lease_token"
        " WHERE j.claimed_by LIKE %s AND a.state = 'idle in transaction'",
        (f"{node}%",)).fetchone()
    assert row is not None
    return int(row[0])


def scheduled_jobs(conn: psycopg.Connection) -> list[int]:
    return [row[0] for row in conn.execute(
        "SELECT job_id FROM jobd.schedule_fires WHERE schedule_id = %s AND job_id IS NOT NULL",
        (CATCHING_UP["id"],))]


def test_a_node_frozen_past_its_leases_loses_its_jobs_and_its_late_results(
    daemons: Daemons, conn: psycopg.Connection
) -> None:
    create_effects_table(conn)
    alpha, beta = two_nodes(daemons)
    # Each job holds its transaction long enough for the freeze to land inside it.
    ids = enqueue_load(conn, 120, hold=0.3)
    # Frozen with a handler's transaction open: its effect written, not committed.
    wait_until(lambda: open_handler_transactions(conn, "alpha") >= 1, 30,
               message="alpha to be inside a handler's transaction")
    os.killpg(alpha.pid, signal.SIGSTOP)
    try:
        frozen = claimed_by_node(conn, "alpha")
        # Past the 3 s lease: beta's sweep takes every job alpha held back and runs it.
        wait_until(lambda: claimed_by_node(conn, "alpha") == 0, 30, interval=0.2,
                   message=lambda: f"alpha's leases to be swept\n{beta.tail()}")
        wait_all_done(conn, ids, 90, beta)
    finally:
        mark = alpha.mark()
        os.killpg(alpha.pid, signal.SIGCONT)
    assert frozen >= 1
    alpha.wait_for_log("lost the lease before finishing; result discarded", process=None,
                       since=mark, timeout=30)
    # Alpha recovers and serves the lane again.
    more = enqueue_load(conn, 40, prefix="after")
    wait_all_done(conn, more, 60, alpha, beta)
    assert alpha.running() and beta.running()
    assert_invariants(conn, ids + more, context=alpha.tail())

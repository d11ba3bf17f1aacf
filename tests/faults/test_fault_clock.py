"""Clock faults: one node whose wall clock is stepped back and forth while it runs, and three
nodes whose clocks disagree by hours. jobd decides what is due and when a lease ends by the
database clock, so neither may change which jobs run, when they may start, or whose lease
holds; the nodes run under libfaketime (Debian package faketime), with the monotonic clock
left alone as an NTP step leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, wait_until
from fault_support import (
    HANDLER,
    LANE,
    FakeClock,
    create_effects_table,
    enqueue_load,
    fault_config,
    logged_clock_skew,
    prepare,
    run_under,
    wait_all_done,
)
from invariants import assert_invariants

import jobd
from jobd.jobs import JobSpec

daemons = daemon_support.daemons

pytestmark = pytest.mark.slow

Daemons = Callable[..., Daemon]

HOUR = 3600.0

# The fallback poll is long on purpose: a delayed job must start on the node's own timer,
# which the clock step must not throw off.
TIMER_LANE: dict[str, Any] = {"poll_interval": "60s"}
# Long enough that the node does not re-measure its offset to the database clock between
# the step and the delayed jobs' due time.
SLOW_DUTIES: dict[str, Any] = {"duty_interval": "30s"}


def enqueue_delayed(conn: psycopg.Connection, count: int, delay: float, prefix: str
                    ) -> list[int]:
    """``count`` jobs due ``delay`` seconds from now by the database clock."""
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    run_at = row[0] + timedelta(seconds=delay)
    return jobd.enqueue_many(conn, [
        JobSpec(HANDLER, {"n": n}, lane=LANE, run_at=run_at, idempotency_key=f"{prefix}-{n}")
        for n in range(count)])


def started_early(conn: psycopg.Connection, ids: list[int]) -> list[tuple[Any, ...]]:
    """Jobs whose effect was written before their run_at (both by the database clock)."""
    return conn.execute(
        "SELECT j.id, j.run_at, e.at FROM jobd.all_jobs AS j JOIN public.soak_effects AS e"
        " ON e.job_id = j.id WHERE j.id = ANY(%s) AND e.at < j.run_at", (ids,)).fetchall()


def test_a_node_whose_clock_is_stepped_runs_delayed_jobs_when_the_database_says(
    daemons: Daemons, conn: psycopg.Connection, tmp_path: Any
) -> None:
    create_effects_table(conn)
    clock = FakeClock(tmp_path)
    daemon = run_under(prepare(daemons(name="stepped")), clock)
    daemon.start(fault_config(lane=TIMER_LANE, supervisor=SLOW_DUTIES))
    daemon.wait_workers_started(LANE, 2, timeout=30)
    warm = enqueue_load(conn, 10, prefix="warm")
    wait_all_done(conn, warm, 30, daemon)

    every: list[int] = list(warm)
    for step, offset in (("back", -HOUR), ("forward", +HOUR)):
        clock.set(offset)
        ids = enqueue_delayed(conn, 20, 2.0, prefix=step)
        every += ids
        # Due in 2 s by the database clock: the node's timer wakes its workers then, not the
        # fallback poll a minute later.
        wait_all_done(conn, ids, 20, daemon)
        assert started_early(conn, ids) == [], f"the clock stepped {step}"
    assert daemon.running(), daemon.tail()
    assert_invariants(conn, every, context=daemon.tail())


def nodes_that_ran(conn: psycopg.Connection, ids: list[int]) -> set[str]:
    """The nodes whose workers ran a job of ``ids`` to its end."""
    return {str(row[0]).split(":")[0] for row in conn.execute(
        "SELECT DISTINCT claimed_by FROM jobd.jobs_archive WHERE id = ANY(%s)", (ids,))}


SKEWS = {"behind": -HOUR, "ontime": 0.0, "ahead": +HOUR}
# Leases long enough that a busy machine renews them in time: any retry is then the skew's.
SKEW_LANE: dict[str, Any] = {"visibility_timeout": "6s", "heartbeat": "1s"}
EVERY_MINUTE = {"id": "every-minute", "cron": "* * * * *", "handler": HANDLER, "lane": LANE}


def test_three_nodes_with_skewed_clocks_agree_on_what_is_due_and_whose_lease_holds(
    daemons: Daemons, conn: psycopg.Connection, tmp_path: Any
) -> None:
    create_effects_table(conn)
    nodes = {}
    for name, skew in SKEWS.items():
        daemon = run_under(prepare(daemons(name=name)), FakeClock(tmp_path, skew))
        daemon.start(fault_config(name, lane=SKEW_LANE, schedules=[EVERY_MINUTE]))
        nodes[name] = daemon
    for name, daemon in nodes.items():
        daemon.wait_workers_started(LANE, 2, timeout=60)
        # The fake clock is in force: the node stamps its log lines with it.
        assert abs(logged_clock_skew(daemon) - SKEWS[name]) < 300, daemon.tail()
    now_jobs = enqueue_load(conn, 150, hold=0.1)
    later_jobs = [job_id for delay in (1.0, 2.0, 3.0, 4.0)
                  for job_id in enqueue_delayed(conn, 15, delay, prefix=f"later-{delay:g}")]
    ids = now_jobs + later_jobs
    wait_all_done(conn, ids, 120, *nodes.values())

    context = "\n".join(d.tail(10) for d in nodes.values())
    # Every node takes part: each claims by the database clock as the others do. A node that
    # a busy machine stalls for a few seconds can miss a burst that the others drain in one
    # or two, so bursts go on (a few jobs a second) until each has run some.
    more: list[int] = []

    def every_node_took_part() -> bool:
        if nodes_that_ran(conn, ids + more) == set(SKEWS):
            return True
        more.extend(enqueue_load(conn, 12, hold=0.1, prefix=f"more-{len(more)}"))
        return False

    wait_until(every_node_took_part, 60, interval=1.0,
               message=lambda: f"every node to take part: {nodes_that_ran(conn, ids + more)}"
                               f"\n{context}")
    ids += more
    wait_all_done(conn, ids, 60, *nodes.values())
    assert started_early(conn, ids) == [], context
    # A node that measured leases by its own clock would see the others' as long expired
    # (or make its own outlast them by an hour): jobs would be swept and run again.
    retried = conn.execute("SELECT id, attempts, errors FROM jobd.jobs_archive"
                           " WHERE id = ANY(%s) AND attempts > 1 LIMIT 5", (ids,)).fetchall()
    assert retried == [], context
    # Nothing was fired ahead of the database clock (the ledger check covers it too).
    fires = conn.execute("SELECT count(*) FROM jobd.schedule_fires WHERE fire_at > now()"
                         ).fetchone()
    assert fires == (0,), context
    assert all(d.running() for d in nodes.values()), context
    assert_invariants(conn, ids, context=context)

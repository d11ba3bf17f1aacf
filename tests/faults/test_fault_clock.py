"""Clock faults: one node whose wall clock is stepped back and forth while it runs, and three
nodes whose clocks disagree by hours. jobd decides what is due and when a lease ends by the
database clock, so neither may change which jobs run, when they may start, or whose lease
holds; the nodes run under libfaketime (Debian package faketime), with the monotonic clock
left alone as an NTP step leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
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
    from datetime import timedelta

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

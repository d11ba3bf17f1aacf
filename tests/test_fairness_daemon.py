"""Fairness with the real daemon: a herd of 50,000 jobs of one handler made due at once, and
another handler's jobs of the same lane enqueued just after it. With fair_by the others start
among the first claims; without, they wait for the herd. Asserted as claim order (the
archive's claimed_at against the herd's), not as wall-clock time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import daemon_support
import psycopg
import pytest
from daemon_support import Daemon, make_config, wait_until

import jobd
from jobd.db import connect

daemons = daemon_support.daemons

pytestmark = pytest.mark.slow

HERD = 50_000
OTHERS = 20
NOOP = {"herd": "jobd.examples:sleep", "mail": "jobd.examples:sleep"}


def run_herd(daemons: Callable[..., Daemon], db_url: str, fair_by: str) -> tuple[float, float]:
    """(the share of the herd claimed before the last mail job, the mail jobs' worst pickup
    in seconds)."""
    config = make_config({"default": {"workers": 1, "concurrency": 10, "fair_by": fair_by}},
                         handlers=NOOP)
    daemon = daemons(config)
    daemon.wait_workers_started("default", 1)
    with connect(db_url) as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        with conn.transaction():
            jobd.enqueue_many(conn, [jobd.JobSpec("herd", {"seconds": 0}, run_at=now
                                                  - timedelta(minutes=1))
                                     for _ in range(HERD)])
        mail = jobd.enqueue_many(conn, [jobd.JobSpec("mail", {"seconds": 0})
                                        for _ in range(OTHERS)])
        wait_until(lambda: finished(conn) == HERD + OTHERS, timeout=180)
        row = conn.execute(
            """WITH last_mail AS (SELECT max(claimed_at) AS at FROM jobs_archive
                                   WHERE id = ANY(%s))
               SELECT avg((claimed_at < (SELECT at FROM last_mail))::int)::float8,
                      (SELECT extract(epoch FROM max(claimed_at - run_at))::float8
                         FROM jobs_archive WHERE id = ANY(%s))
                 FROM jobs_archive WHERE handler = 'herd'""", (mail, mail)).fetchone()
    assert row is not None
    return row[0], row[1]


def finished(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT count(*) FROM jobs_archive").fetchone()
    assert row is not None
    return int(row[0])


def test_with_fair_by_the_other_handler_starts_among_the_first_claims(
    daemons: Callable[..., Daemon], db_url: str,
) -> None:
    herd_before, pickup = run_herd(daemons, db_url, "handler")
    # A claim of up to 40 jobs gives the mail jobs half of it: they are done within the
    # first few claims, while nearly all of the herd still waits.
    assert herd_before < 0.02, f"{herd_before:.1%} of the herd went first (pickup {pickup:.2f}s)"


def test_without_fair_by_the_other_handler_waits_for_the_herd(
    daemons: Callable[..., Daemon], db_url: str,
) -> None:
    herd_before, pickup = run_herd(daemons, db_url, "none")
    assert herd_before > 0.98, f"only {herd_before:.1%} of the herd went first ({pickup:.2f}s)"

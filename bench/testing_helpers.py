"""What ``jobd.testing.run_jobs`` costs per job, so a suite can budget for it.

Usage::

    .venv/bin/python bench/testing_helpers.py --database-url URL [--jobs N]

URL is a database that ``jobd migrate`` set up. For a plain and a transactional handler that
do nothing, it enqueues N jobs and runs them: once on a connection inside an open
transaction (rolled back after: the test's own connection) and once through the URL
(committed jobs; every claim and completion commits). Prints milliseconds per job.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psycopg

import jobd
from jobd.testing import run_jobs


@jobd.transactional
def transactional(job: jobd.Job, conn: psycopg.Connection) -> None:
    conn.execute("SELECT 1")


def plain(job: jobd.Job) -> None:
    pass


def in_transaction(url: str, name: str, handler: Callable[..., Any], jobs: int) -> float:
    with psycopg.connect(url) as conn:
        conn.execute("SELECT 1")  # the transaction is open before enqueue_many's savepoint
        jobd.enqueue_many(conn, [jobd.JobSpec(name) for _ in range(jobs)])
        started = time.perf_counter()
        summary = run_jobs(conn, handlers={name: handler})
        took = time.perf_counter() - started
        conn.rollback()
    assert summary.done == jobs, str(summary)
    return took


def through_url(url: str, name: str, handler: Callable[..., Any], jobs: int) -> float:
    with psycopg.connect(url, autocommit=True) as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec(name) for _ in range(jobs)])
    started = time.perf_counter()
    summary = run_jobs(url, handlers={name: handler})
    took = time.perf_counter() - started
    assert summary.done == jobs, str(summary)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--jobs", type=int, default=500)
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    for name, handler in (("plain", plain), ("transactional", transactional)):
        for mode, measure in (("connection", in_transaction), ("url", through_url)):
            took = measure(args.database_url, name, handler, args.jobs)
            print(f"{mode:10} {name:13} {args.jobs} jobs in {took:.2f}s: "
                  f"{took / args.jobs * 1000:.2f} ms/job")


if __name__ == "__main__":
    main()

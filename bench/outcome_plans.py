"""A batch of outcomes written alone: its custom plan against its generic plan, by batch size.

Usage (from the repository root)::

    .venv/bin/python -m bench.outcome_plans                      # batches of 1 to 500
    .venv/bin/python -m bench.outcome_plans --sizes 5,200 --jobs 30000

A worker writes its finished jobs' outcomes with ``complete_jobs``, a prepared statement.
Left to choose, PostgreSQL planned it afresh for most small batches (a custom plan that
probes the primary key for each id), so ``queue.settle_and_claim`` has outcomes written in a
transaction of their own, fewer than ``queue.GENERIC_PLANS_BELOW``, run the generic plan
(a bitmap scan of the primary key and a hash join). This benchmark is the measurement behind
that threshold. It starts a throwaway PostgreSQL cluster, migrates a scratch database, and
for each batch size enqueues ``--jobs`` jobs, claims them batch by batch, and completes
each batch through ``jobd.fastpath`` as a worker does, its plan forced custom and generic in
turn (``plan_cache_mode``, set for the session between batches). The session runs as a
worker's does (sequential scans off) and commits asynchronously, so that the WAL flush,
the same for both plans, does not drown the difference. It prints the median time a job
of the completion's round trip took, per plan.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import log
from jobd import fastpath, queue
from jobd.db import connect
from jobd.localpg import throwaway_cluster
from jobd.migrate import migrate

DBNAME = "outcome_plans"
LANE = "outcomes"
PLANS = ("force_custom_plan", "force_generic_plan")
WARM_UP = 2  # batches of each plan left out of the median (the first plans are made then)


def measure(conn: psycopg.Connection, size: int, jobs: int) -> dict[str, float]:
    """Median µs a job of completing batches of ``size``, per plan."""
    conn.execute("TRUNCATE jobd.jobs")
    jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE) for _ in range(jobs)])
    conn.execute("VACUUM ANALYZE jobd.jobs")
    times: dict[str, list[float]] = {plan: [] for plan in PLANS}
    turn = 0
    while len(claimed := queue.claim(conn, LANE, "bench", size, 300.0)) == size:
        plan = PLANS[turn % len(PLANS)]
        turn += 1
        conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.Identifier(plan)))
        params = {**queue.lease_arrays([job.lease for job in claimed]), "now": None}
        started = time.perf_counter()
        fastpath.run(conn, [(fastpath.BEGIN, None), ("complete_jobs", params),
                            (fastpath.COMMIT, None)])
        times[plan].append((time.perf_counter() - started) * 1e6 / size)
    conn.execute("RESET plan_cache_mode")
    if min(len(t) for t in times.values()) <= WARM_UP:
        raise SystemExit(f"--jobs {jobs} gives too few batches of {size}: raise it")
    return {plan: statistics.median(t[WARM_UP:]) for plan, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,50,100,200,500",
                        help="batch sizes, comma-separated (default 1,5,50,100,200,500)")
    parser.add_argument("--jobs", type=int, default=20_000,
                        help="jobs completed at each size (default 20000)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: not a list of numbers: {args.sizes!r}")
    if min(*sizes, args.jobs) < 1:
        parser.error("--sizes and --jobs must be at least 1")
    with throwaway_cluster("jobd-outcome-plans-", log=log) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
        url = make_conninfo(cluster.url, dbname=DBNAME)
        with connect(url, "jobd") as conn:
            migrate(conn, "jobd")
        with connect(url, "jobd") as conn:
            conn.autocommit = True
            conn.execute("SET enable_seqscan = off")  # as a worker's session (db.worker_session)
            conn.execute("SET synchronous_commit = off")
            print(f"complete_jobs, µs a job (median), {args.jobs} jobs at each size; jobd "
                  f"runs the generic plan below {queue.GENERIC_PLANS_BELOW}")
            print(f"{'batch':>6}  {'custom':>8}  {'generic':>8}  generic/custom")
            for size in sizes:
                figures = measure(conn, size, args.jobs)
                custom, generic = figures["force_custom_plan"], figures["force_generic_plan"]
                print(f"{size:>6}  {custom:8.1f}  {generic:8.1f}  {generic / custom:.2f}",
                      flush=True)


if __name__ == "__main__":
    main()

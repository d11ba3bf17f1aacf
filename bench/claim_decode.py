"""A claim's rows turned into Python values, by the zone the session reports.

Usage (from the repository root)::

    .venv/bin/python -m bench.claim_decode                    # a claim of 510, 200 loads
    .venv/bin/python -m bench.claim_decode --rows 100 --zones UTC,Asia/Kolkata

A worker's claim comes back in binary (``queue._BINARY_RESULTS``), and psycopg makes each of
a row's three timestamptz columns a datetime in the zone the session reports: for the zone
named ``UTC`` with ``datetime.timezone.utc``, for any other through ``zoneinfo``. A worker's
own sessions therefore run in UTC (``db.worker_session``). This benchmark is the measurement
behind that. It starts a throwaway PostgreSQL cluster, migrates a scratch database, enqueues
``--rows`` jobs and claims them once, in binary, through ``jobd.fastpath`` as a worker does;
then, for each zone, it loads the claim's result into rows ``--loads`` times with a
``Transformer`` of a session in that zone and prints the best time a row took. The rows are
the same each time: only the conversion differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psycopg
from psycopg import pq, sql
from psycopg.adapt import Transformer
from psycopg.conninfo import make_conninfo

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import log
from jobd import db, queue
from jobd.localpg import throwaway_cluster
from jobd.migrate import migrate
from jobd.queries import query

DBNAME = "claim_decode"
LANE = "decode"
DEFAULT_ZONES = "UTC,Etc/UTC,Europe/Berlin"


def claim_result(conn: psycopg.Connection, rows: int) -> pq.abc.PGresult:
    """The binary result of one claim of ``rows`` jobs, as the worker's statement sends it."""
    jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE) for _ in range(rows)])
    # The statement and parameters a worker's claim sends (a plain lane, from the head).
    [(name, params)] = queue._claim_steps(queue.ClaimRequest(LANE, "bench", rows, 300.0), None)
    with conn.cursor(binary=True) as cursor:
        cursor.execute(query(name), params)
        result = cursor.pgresult
    assert result is not None and result.ntuples == rows, "the claim took too few jobs"
    return result


def best_us_a_row(conn: psycopg.Connection, result: pq.abc.PGresult, loads: int) -> float:
    best = float("inf")
    for _ in range(loads):
        transformer = Transformer(conn)
        transformer.set_pgresult(result)
        started = time.perf_counter()
        transformer.load_rows(0, result.ntuples, tuple)
        best = min(best, time.perf_counter() - started)
    return best * 1e6 / result.ntuples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=510,
                        help="jobs in the claim (default 510, a full claim at 1 x 10)")
    parser.add_argument("--loads", type=int, default=200,
                        help="times the result is loaded in each zone (default 200)")
    parser.add_argument("--zones", default=DEFAULT_ZONES,
                        help=f"session zones, comma-separated (default {DEFAULT_ZONES})")
    args = parser.parse_args(argv)
    if min(args.rows, args.loads) < 1:
        parser.error("--rows and --loads must be at least 1")
    zones = [zone.strip() for zone in args.zones.split(",") if zone.strip()]
    if not zones:
        parser.error("--zones: name at least one zone")
    with throwaway_cluster("jobd-claim-decode-", log=log) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
        url = make_conninfo(cluster.url, dbname=DBNAME)
        with db.connect(url, "jobd") as conn:
            migrate(conn, "jobd")
        with db.connect(url, "jobd") as conn:
            result = claim_result(conn, args.rows)
            print(f"a claim of {args.rows} rows loaded {args.loads} times, best µs a row")
            for zone in zones:
                try:
                    conn.execute("SELECT set_config('TimeZone', %s, false)", (zone,))
                except psycopg.errors.InvalidParameterValue:
                    parser.error(f"--zones: PostgreSQL knows no zone {zone!r}")
                print(f"{zone:>20}  {best_us_a_row(conn, result, args.loads):6.2f}", flush=True)


if __name__ == "__main__":
    main()

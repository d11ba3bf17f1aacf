"""Single-job enqueue, part by part: the server's CPU per call and the rate, against a bare INSERT.

Usage (from the repository root)::

    .venv/bin/python -m bench.enqueue_parts                     # 4 and 8 connections, 3 rounds
    .venv/bin/python -m bench.enqueue_parts --connections 8 --rounds 5 --seconds 6
    .venv/bin/python -m bench.enqueue_parts --one-call-transactions --rounds 6

Issue 13 asks single-job ``jobd.enqueue`` to reach 0.8 x the rate of a bare ``INSERT``
(bench/pressure.py, scenario ``enqueue``). This benchmark shows what stands between the two.
It starts a throwaway PostgreSQL cluster (``synchronous_commit=on``, the server's defaults
otherwise), migrates a scratch database with jobd's migrations, adds the contenders of
bench/sql/enqueue_parts.sql, and runs ``pgbench -n -M prepared -j 2`` with one single-row
statement per transaction for each contender in turn (the order reversed every other round,
so drift favours none), every table emptied and vacuumed before each run:

bare
    ``INSERT ... RETURNING id`` into a trigger-less copy of jobd.jobs (``LIKE ... INCLUDING
    ALL``): pressure.py's yardstick.
collected
    The same ``INSERT`` into a copy with a statement trigger that collects the inserted rows
    (a transition table, as jobd.jobs's insert trigger has) and never fires: what the
    collecting costs an insert the trigger steps aside for.
plain_function
    The bare ``INSERT`` from a PL/pgSQL function run with the caller's rights.
least_privilege
    That function with ``SECURITY DEFINER`` and a pinned ``search_path``, still into the
    trigger-less copy.
jobs_insert
    The same ``INSERT`` into ``jobd.jobs`` itself: what a caller's own insert costs. Its
    statement trigger announces the job (no worker waits here, so it sends no NOTIFY).
insert_only
    A least-privilege PL/pgSQL function (``SECURITY DEFINER``, a pinned ``search_path``) that
    only inserts into jobd.jobs, the trigger stepping aside as for ``jobd.enqueue``.
wake_core
    That plus the wake-up protocol's core: the lane's shared wake-up lock, the waiters read
    in a snapshot taken after it, a NOTIFY only when one waits. No entry rules, payload limit
    or priority bookkeeping.
enqueue
    ``SELECT jobd.enqueue('noop', '{}', 'x')``: all of it.

The jobs go to a lane no worker waits on. Per contender and round it prints transactions/s
and the server's CPU per transaction: the user and system time of the postmaster and every
process below it, the backends that ended meanwhile included, over the run, divided by the
transactions. pgbench runs on the same cores, so the rate also carries its own cost.

With ``--one-call-transactions`` there is no pgbench: each contender is called from a
PL/pgSQL procedure that commits after every call (``--calls`` a round, one session,
``synchronous_commit = off`` so that no flush is waited for), and the procedure times
itself by the server's clock. Every call pays what a transaction of its own costs (the
relation locks, the executor and the function's expressions set up again, the commit) with
nothing else running beside it, so the microseconds a transaction spread far less than the
pgbench rounds' CPU figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_bench import descendants, log, own_cpu_seconds
from bench.pressure_scenarios import parse_pgbench
from jobd.db import connect
from jobd.localpg import find_bindir, throwaway_cluster
from jobd.migrate import migrate

CONTENDERS = {
    "bare": "INSERT INTO enqueue_parts.bare_jobs (lane, handler, payload) "
            "VALUES ('x', 'noop', '{}') RETURNING id;",
    "collected": "INSERT INTO enqueue_parts.collected_jobs (lane, handler, payload) "
                 "VALUES ('x', 'noop', '{}') RETURNING id;",
    "plain_function": "SELECT enqueue_parts.plain_function('noop', '{}', 'x');",
    "least_privilege": "SELECT enqueue_parts.least_privilege('noop', '{}', 'x');",
    "jobs_insert": "INSERT INTO jobd.jobs (lane, handler, payload) "
                   "VALUES ('x', 'noop', '{}') RETURNING id;",
    "insert_only": "SELECT enqueue_parts.insert_only('noop', '{}', 'x');",
    "wake_core": "SELECT enqueue_parts.wake_core('noop', '{}', 'x');",
    "enqueue": "SELECT jobd.enqueue('noop', '{}', 'x');",
}
# A contender's statement as a step of the procedure below: its result into a variable.
ONE_CALL_LOOP = sql.SQL("""
CREATE PROCEDURE enqueue_parts.{procedure}(calls integer, INOUT us float8 DEFAULT 0)
LANGUAGE plpgsql AS $body$
DECLARE
    started timestamptz := clock_timestamp();
    ignored bigint;
BEGIN
    FOR i IN 1..calls LOOP
        {step}
        COMMIT;
    END LOOP;
    us := extract(epoch FROM clock_timestamp() - started) * 1e6 / calls;
END
$body$""")
EMPTY = ("TRUNCATE enqueue_parts.bare_jobs, enqueue_parts.collected_jobs, jobd.jobs, "
         "jobd.lane_priorities")
PARTS_SQL = Path(__file__).with_name("sql") / "enqueue_parts.sql"
DBNAME = "enqueue_parts"


def run_contender(url: str, pgbench: Path, script: Path, postmaster: int,
                  clients: int, seconds: int) -> tuple[float, float]:
    """(transactions/s, server CPU µs per transaction) of one pgbench run of ``script``."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(EMPTY)
        conn.execute("VACUUM ANALYZE")
    cpu_before = own_cpu_seconds(descendants(postmaster))
    done = subprocess.run(
        [str(pgbench), "-n", "-M", "prepared", "-j", "2", "-c", str(clients),
         "-T", str(seconds), "-f", str(script), url],
        capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pgbench failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    time.sleep(0.3)  # the backends exit and are reaped: their time moves to the postmaster
    cpu = own_cpu_seconds(descendants(postmaster)) - cpu_before
    figures = parse_pgbench(done.stdout)
    if not figures.get("processed") or "tps" not in figures:
        raise SystemExit(f"pgbench reported no transactions:\n{done.stdout}{done.stderr}")
    return figures["tps"], cpu / figures["processed"] * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", default="4,8",
                        help="pgbench clients, comma-separated (default 4,8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--seconds", type=int, default=4, help="seconds a run (default 4)")
    parser.add_argument("--one-call-transactions", action="store_true",
                        help="time each contender from a procedure that commits after every "
                             "call, instead of pgbench (--connections and --seconds unused)")
    parser.add_argument("--calls", type=int, default=3000,
                        help="calls a round with --one-call-transactions (default 3000)")
    args = parser.parse_args(argv)
    try:
        connections = [int(c) for c in args.connections.split(",")]
    except ValueError:
        parser.error(f"--connections: not a list of numbers: {args.connections!r}")
    if min(*connections, args.rounds, args.seconds, args.calls) < 1:
        parser.error("--connections, --rounds, --seconds and --calls must be at least 1")
    with throwaway_cluster("jobd-enqueue-parts-", log=log) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
        url = make_conninfo(cluster.url, dbname=DBNAME)
        with connect(url, "jobd") as conn:
            migrate(conn, "jobd")
            conn.execute(PARTS_SQL.read_text())
        if args.one_call_transactions:
            report_one_call(args.calls, time_one_call_transactions(url, args.rounds, args.calls))
            return
        postmaster = int((cluster.datadir / "postmaster.pid").read_text().split()[0])
        pgbench = find_bindir() / "pgbench"
        scripts = {}
        for name, statement in CONTENDERS.items():
            scripts[name] = cluster.datadir.parent / f"{name}.sql"
            scripts[name].write_text(statement + "\n")
        for clients in connections:
            figures: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
            for round_no in range(args.rounds):
                order = list(CONTENDERS) if round_no % 2 == 0 else list(reversed(CONTENDERS))
                for name in order:
                    figures[name].append(run_contender(url, pgbench, scripts[name], postmaster,
                                                       clients, args.seconds))
                    log(f"{clients} connections, round {round_no + 1}, {name}: "
                        f"{figures[name][-1][0]:,.0f} tx/s, {figures[name][-1][1]:.0f} µs")
            report(clients, figures)


def one_call_step(statement: str) -> str:
    """A contender's statement with its result kept: ``x := f(...)`` or ``... INTO x``."""
    body = statement.rstrip(";")
    if body.startswith("SELECT "):
        return f"ignored := {body.removeprefix('SELECT ')};"
    return f"{body} INTO ignored;"


def time_one_call_transactions(url: str, rounds: int, calls: int) -> dict[str, list[float]]:
    """Microseconds a transaction of each contender, each round, one call a transaction."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for name, statement in CONTENDERS.items():
            conn.execute(ONE_CALL_LOOP.format(procedure=sql.Identifier(f"one_call_{name}"),
                                              step=sql.SQL(one_call_step(statement))))
        timings: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for round_no in range(rounds):
            conn.execute(EMPTY)
            conn.execute("VACUUM ANALYZE")
            order = list(CONTENDERS) if round_no % 2 == 0 else list(reversed(CONTENDERS))
            for name in order:
                procedure = sql.Identifier("enqueue_parts", f"one_call_{name}")
                row = conn.execute(sql.SQL("CALL {}(%s)").format(procedure), (calls,)).fetchone()
                assert row is not None
                timings[name].append(float(row[0]))
                log(f"round {round_no + 1}, {name}: {timings[name][-1]:.1f} µs a transaction")
    return timings


def report_one_call(calls: int, timings: dict[str, list[float]]) -> None:
    print(f"\none call a transaction, {calls:,} calls a round | µs, each round | "
          "min | median | ÷ bare, medians")
    print("|---|---|---:|---:|---:|")
    bare = statistics.median(timings["bare"])
    for name, runs in timings.items():
        each = " / ".join(f"{us:.1f}" for us in runs)
        median = statistics.median(runs)
        print(f"| {name} | {each} | {min(runs):.1f} | {median:.1f} | {median / bare:.2f} |")


def report(clients: int, figures: dict[str, list[tuple[float, float]]]) -> None:
    bare = [rate for rate, _cpu in figures["bare"]]
    print(f"\n{clients} connections | tx/s, each round | ÷ bare, each round | "
          "server CPU µs per tx, median")
    print("|---|---|---|---:|")
    for name, runs in figures.items():
        rates = " / ".join(f"{rate:,.0f}" for rate, _cpu in runs)
        ratios = " / ".join(f"{rate / base:.2f}"
                            for (rate, _cpu), base in zip(runs, bare, strict=True))
        cpu = statistics.median(cpu for _rate, cpu in runs)
        print(f"| {name} | {rates} | {ratios} | {cpu:.0f} |")


if __name__ == "__main__":
    main()

"""What a one-row statement on ``jobd.jobs`` pays for the table's CHECK constraints.

Usage (from the repository root)::

    .venv/bin/python -m bench.check_constraints                 # 5 rounds of 20,000 statements
    .venv/bin/python -m bench.check_constraints --rounds 7 --statements 50000

PostgreSQL keeps a table's CHECK constraints as node trees in text form and, at the start of
every statement that inserts or updates a row, reads them back (``stringToNode``), plans and
compiles them; the rows themselves are then checked cheaply. A single-job enqueue, a claim of
one job, a retry and a heartbeat each pay that once. This benchmark prices it. It starts a
throwaway cluster and migrates one scratch database into three schemas:

jobd
    as migrated: the five CHECK constraints of ``jobs``.
unchecked
    the same with the five dropped (what the statements would cost without the rules).
domains
    the rules of single columns as domains over the contract's types, the three-column lease
    rule still a table constraint (bench/sql/check_constraints_domains.sql): a domain's
    constraints are read and planned once a session, in PostgreSQL's type cache.

Each contender runs ``--statements`` one-row statements in a ``DO`` loop (one backend, one
transaction, so neither commits nor round trips are measured) and the loop's time per
statement is printed, per round and as the median, with its ratio to ``jobd``. The schemas
take turns, the order reversed every other round, so drift favours none. Contenders:
``INSERT`` of one job (the insert trigger steps aside, as for ``jobd.enqueue``), ``UPDATE``
of one job's ``attempts`` (a claim's, a retry's statement shape) and ``jobd.enqueue``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_bench import log
from jobd.db import connect
from jobd.localpg import throwaway_cluster
from jobd.migrate import migrate

DBNAME = "check_constraints"
SCHEMAS = ("jobd", "unchecked", "domains")
DOMAINS_SQL = Path(__file__).with_name("sql") / "check_constraints_domains.sql"

# One-row statements, {schema} the contender's schema. The loop sets the setting with which
# jobd.enqueue makes the insert trigger step aside, so that the insert alone is timed.
STATEMENTS = {
    "insert": "INSERT INTO {schema}.jobs (lane, handler, payload) VALUES ('x', 'noop', '{{}}')",
    "update": "UPDATE {schema}.jobs SET attempts = attempts + 1 WHERE id = first_id + i",
    "enqueue": "PERFORM {schema}.enqueue('noop', '{{}}', 'x')",
}
LOOP = """
DO $$
DECLARE
    first_id bigint := (SELECT min(id) FROM {schema}.jobs);
    started timestamptz;
BEGIN
    PERFORM set_config('jobd.enqueue_announces', 'on', true);
    started := clock_timestamp();
    FOR i IN 1..{statements} LOOP
        {statement};
    END LOOP;
    PERFORM set_config('bench.us_a_statement',
                       (extract(epoch FROM clock_timestamp() - started) * 1e6
                        / {statements})::text, false);
END
$$
"""


def prepare(url: str) -> None:
    """The three schemas, each migrated from scratch."""
    with connect(url) as conn:
        for schema in SCHEMAS:
            migrate(conn, schema)
        conn.execute("SET search_path TO unchecked")
        conn.execute("""
            DO $$
            DECLARE rule name;
            BEGIN
                FOR rule IN SELECT conname FROM pg_constraint
                             WHERE conrelid = 'jobs'::regclass AND contype = 'c' LOOP
                    EXECUTE format('ALTER TABLE jobs DROP CONSTRAINT %I', rule);
                END LOOP;
            END
            $$""")
        conn.execute("SET search_path TO domains")
        conn.execute(DOMAINS_SQL.read_text())
        conn.execute("RESET search_path")


def us_a_statement(url: str, schema: str, kind: str, statements: int) -> float:
    """One loop of ``statements`` statements of ``kind`` on ``schema``: µs a statement."""
    identifier = sql.Identifier(schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {schema}.jobs, {schema}.lane_priorities").format(
            schema=identifier))
        # The jobs the update loop changes, one each: no statement follows another's version.
        conn.execute(sql.SQL("SELECT {}.enqueue('noop', '{{}}', 'x') FROM generate_series(0, %s)")
                     .format(identifier), (statements,))
        conn.execute(sql.SQL("VACUUM ANALYZE {}.jobs").format(identifier))
        statement = sql.SQL(STATEMENTS[kind]).format(schema=identifier)
        conn.execute(sql.SQL(LOOP).format(schema=identifier, statement=statement,
                                          statements=sql.Literal(statements)))
        row = conn.execute("SELECT current_setting('bench.us_a_statement')::float8").fetchone()
    assert row is not None
    return float(row[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--statements", type=int, default=20_000,
                        help="statements a loop (default 20,000)")
    args = parser.parse_args(argv)
    if min(args.rounds, args.statements) < 1:
        parser.error("--rounds and --statements must be at least 1")
    with throwaway_cluster("jobd-check-constraints-", log=log) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
        url = make_conninfo(cluster.url, dbname=DBNAME)
        prepare(url)
        timings: dict[tuple[str, str], list[float]] = {
            (kind, schema): [] for kind in STATEMENTS for schema in SCHEMAS}
        for round_no in range(args.rounds):
            order = SCHEMAS if round_no % 2 == 0 else tuple(reversed(SCHEMAS))
            for kind in STATEMENTS:
                for schema in order:
                    timings[kind, schema].append(
                        us_a_statement(url, schema, kind, args.statements))
                log(f"round {round_no + 1}, {kind}: " + ", ".join(
                    f"{schema} {timings[kind, schema][-1]:.1f} µs" for schema in SCHEMAS))
        report(timings)


def report(timings: dict[tuple[str, str], list[float]]) -> None:
    print("\nstatement | schema | µs a statement, each round | median | ÷ jobd")
    print("|---|---|---|---:|---:|")
    for kind in STATEMENTS:
        base = statistics.median(timings[kind, "jobd"])
        for schema in SCHEMAS:
            runs = timings[kind, schema]
            median = statistics.median(runs)
            each = " / ".join(f"{us:.1f}" for us in runs)
            print(f"| {kind} | {schema} | {each} | {median:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()

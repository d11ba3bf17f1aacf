"""What fairness within a lane (``lanes.<l>.max_wait``, ``lanes.<l>.fair_by``) costs the claim
and the drain, and what it does to the waits of a saturated lane.

Usage::

    .venv/bin/python -m bench.fairness_bench [--explain] [--drain] [--waits] [--rounds N]
                                             [--drain-jobs N] [--json PATH] [--keep]

Without a mode it runs all three. Everything runs on bench/daemon_bench.py's private throwaway
cluster (``synchronous_commit = on``, a freshly migrated ``jobd`` schema), with its daemon
runner and drain measurement.

--explain
    1,000,000 jobs in one lane: 100,000 due (run_at spread over the last 10 minutes) and
    900,000 scheduled from an hour ahead, 10,000 distinct fairness keys (job n has key
    n mod 10,000), priorities 0-9 at random; then VACUUM ANALYZE. Per claim kind (plain,
    max_wait only, fair_by only, both), 20 consecutive claims of 100 through the worker's own
    path (``queue.settle_and_claim``, the worker's claim floors and key cursor as
    ``jobd.claimer`` keeps them), each committed: the claim's wall time (median, p95) and its
    execution time on the server (pg_stat_statements). Then one more claim with auto_explain
    (``log_analyze``, ``log_buffers``, ``log_nested_statements``, ``log_level = notice``: the
    plans arrive as notices on the claiming connection), which prints EXPLAIN (ANALYZE,
    BUFFERS) of every statement the claim ran, nested ones included, and checks every scan
    of ``jobs`` in them: claimable jobs must be read through an Index Scan on jobs_fair_idx
    or jobs_claimable_idx, the picked ids through the primary key, the suspect probe through
    jobs_suspect_idx, and no scan may read more than 10 x 100 rows; PASS or FAIL. The claimed
    jobs are put back (pending) and the table vacuumed before the next kind.
    Then the same for the plain and the fair claim on the drain's table: 20,000 due jobs of
    one key enqueued at once into a lane analyzed while empty (a burst after an idle spell),
    and the same burst over 10 keys, which the fair claim walks from key to key.
--drain
    bench/daemon_bench.py's drain (20,000 no-op jobs committed at once while the daemon idles;
    jobs/s from the first handler start to the last finished_at) at 1x10 and 2x10 (workers x
    concurrency), with the jobs' fairness_key spread over 1, 10 and 1,000 keys: fair_by none
    (off) and fair_by handler (on: shares by fairness_key) in alternating order, and max_wait
    1s (fair_by none; it binds from the drain's second second on) at 1 key. Medians of
    --rounds rounds (default 2); the ratio on/off per key count, and beside it the claim
    statement's mean execution time on the server over each drain (pg_stat_statements).
--waits
    A saturated lane: 1 worker x concurrency 2 running a handler that sleeps 5 ms (at most
    400 jobs/s), offered 600 jobs/s for 10 s by one enqueuer (a batch every 10 ms);
    priorities 9 / 5 / 0 for 20 / 30 / 50 % of the jobs, fairness key ``herd`` for 80 % and
    ``small-1`` .. ``small-4`` for 5 % each (seeded, the same jobs for every contender).
    Contenders: both off; max_wait 3s alone; max_wait 3s and fair_by handler. After the offer
    the daemon gets 45 s to empty the queue; jobs still unclaimed then count with the wait
    they had (a lower bound) and are listed as unclaimed. The wait of a job is
    claimed_at - run_at (jobs_archive); p50, p95, p99, max and count per priority and per key.

Output: a header, the figures on stdout, progress on stderr; with --json, every figure and
setting as one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import (
    LANE,
    SERVER_SETTINGS,
    VISIBILITY_TIMEOUT_S,
    Daemon,
    Env,
    environment,
    log,
    measure_drain,
    percentile,
    reset_queue,
    source_revision,
    write_config,
)
from jobd import queue
from jobd.claim_floors import ClaimFloors
from jobd.claimer import next_key_cursor
from jobd.config import LaneConfig
from jobd.db import connect

# --- --explain -----------------------------------------------------------------------------

EXPLAIN_JOBS = 1_000_000
EXPLAIN_DUE = 100_000
EXPLAIN_KEYS = 10_000
EXPLAIN_DUE_SPAN_S = 600  # due jobs' run_at: spread over this many seconds before now
EXPLAIN_MAX_WAIT_S = 300.0  # so about half of the due jobs are overdue
CLAIM_BATCH = 100
CLAIMS_PER_KIND = 20
# A scan of jobs that reads more rows than this in one claim of CLAIM_BATCH fails the check:
# the claim's probes read about one row per key or per job taken.
MAX_ROWS_READ = 10 * CLAIM_BATCH

CLAIM_KINDS: dict[str, LaneConfig] = {
    "plain (claim_jobs)": LaneConfig(LANE),
    f"max_wait {EXPLAIN_MAX_WAIT_S:g}s": LaneConfig(LANE, max_wait=EXPLAIN_MAX_WAIT_S),
    "fair_by fairness_key": LaneConfig(LANE, fair_by="fairness_key"),
    f"fair_by fairness_key + max_wait {EXPLAIN_MAX_WAIT_S:g}s":
        LaneConfig(LANE, fair_by="fairness_key", max_wait=EXPLAIN_MAX_WAIT_S),
}

BURST_JOBS = 20_000
BURST_KEYS = (1, 10)  # the burst scenarios of --explain: one key, and keys to walk
BURST_KINDS: dict[str, LaneConfig] = {
    "plain (claim_jobs)": LaneConfig(LANE),
    "fair_by fairness_key": LaneConfig(LANE, fair_by="fairness_key"),
}

# How the claim statements (claim_jobs, claim_jobs_ordered) begin in pg_stat_statements.
CLAIM_STATEMENTS = ("-- Claims up to $1 due jobs of one lane", "-- claim_jobs for a lane with")

# Which index may read jobs, and what for. Everything else (a Seq Scan, a bitmap scan, another
# index) fails the check.
CLAIM_INDEXES = {"jobs_fair_idx", "jobs_claimable_idx"}
OTHER_INDEXES = {"jobs_pkey": "the picked ids (the claiming UPDATE)",
                 "jobs_suspect_idx": "the suspect probe", "jobs_lease_idx": "the suspect probe"}

_SCAN = re.compile(
    r"(?P<node>Seq Scan|Index Only Scan(?: Backward)?|Index Scan(?: Backward)?|"
    r"Bitmap Heap Scan|Bitmap Index Scan|Tid Scan|Tid Range Scan|Sample Scan)"
    r"(?: using (?P<index>\S+))? on (?P<relation>\S+)")
_ACTUAL = re.compile(r"actual time=[\d.]+\.\.(?P<ms>[\d.]+) rows=(?P<rows>\d+) "
                     r"loops=(?P<loops>\d+)|(?P<never>never executed)")
_BITMAP_INDEX = re.compile(r"Bitmap Index Scan on (?P<index>\S+)")
_BUFFERS = re.compile(r"^\s*Buffers: (?P<buffers>.*)$")

# The 1M-row table in one statement: ids from the table's sequence, job n's key n mod KEYS,
# priorities at random (seeded by setseed in the same session).
FILL_SQL = """
INSERT INTO jobs (id, lane, handler, payload, priority, run_at, created_at, fairness_key)
SELECT nextval('job_id_seq'), %(lane)s, 'noop', '{}'::jsonb, floor(random() * 10)::int,
       CASE WHEN g <= %(due)s
            THEN now() - random() * make_interval(secs => %(span)s)
            ELSE now() + interval '1 hour' + random() * interval '1 day' END,
       now(), 'tenant-' || lpad((g %% %(keys)s)::text, 5, '0')
  FROM generate_series(1, %(total)s) AS g
"""

# Claimed jobs back to what they were, so every claim kind starts from the same table.
RESTORE_SQL = """
UPDATE jobs SET state = 'pending', attempts = attempts - 1, claimed_by = NULL,
                claimed_at = NULL, lease_until = NULL, lease_token = NULL
 WHERE state = 'claimed'
"""

# --- --drain -------------------------------------------------------------------------------

DRAIN_JOBS = 20_000  # --drain-jobs
DRAIN_SETTINGS = ((1, 10), (2, 10))
DRAIN_KEY_COUNTS = (1, 10, 1000)
DRAIN_MAX_WAIT_S = 1.0
DRAIN_TARGET_RATIO = 0.90  # fair on / off at one key

# --- --waits -------------------------------------------------------------------------------

WAIT_WORKERS = 1
WAIT_CONCURRENCY = 2
WAIT_HANDLER_MS = 5.0
WAIT_OFFERED_PER_S = 600
WAIT_SECONDS = 10.0
WAIT_TICK_S = 0.01
WAIT_MAX_WAIT_S = 3.0
WAIT_PRIORITIES = {9: 0.2, 5: 0.3, 0: 0.5}
WAIT_KEYS = {"herd": 0.8, "small-1": 0.05, "small-2": 0.05, "small-3": 0.05, "small-4": 0.05}
WAIT_SEED = 20261201
# After the offer, the daemon gets this long to empty the queue; what it has not claimed by
# then is reported as unclaimed (a fair lane may need far longer, see docs/performance.md).
WAIT_DRAIN_WINDOW_S = 45.0
WAIT_CONTENDERS: dict[str, dict[str, Any]] = {
    "off": {},
    "max_wait": {"max_wait": f"{WAIT_MAX_WAIT_S:g}s"},
    "on": {"max_wait": f"{WAIT_MAX_WAIT_S:g}s", "fair_by": "handler"},
}

WAIT_HANDLER_MODULE = "fairness_bench_handlers"
WAIT_HANDLER_SOURCE = '''\
"""Handlers for bench/fairness_bench.py."""

import time


def nap(job):
    """Sleeps payload["ms"] milliseconds: a lane whose capacity is known."""
    time.sleep(job.payload["ms"] / 1000.0)
'''


def median_p95(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p95": percentile(ordered, 95),
            "min": ordered[0], "max": ordered[-1], "count": len(ordered)}


# --- --explain: the claim at 1M rows -------------------------------------------------------


class ClaimLoop:
    """One worker's claims without the daemon: the request, floors and key cursor exactly as
    jobd.claimer builds them, sent through the worker's path (queue.settle_and_claim)."""

    def __init__(self, lane: LaneConfig, worker: str):
        self.lane = lane
        self.worker = worker
        self.floors = ClaimFloors()
        self.cursor: str | None = None

    def claim(self, conn: psycopg.Connection, limit: int) -> list[jobd.Job]:
        now = time.monotonic()
        floors = self.floors.params(now)
        request = queue.ClaimRequest(
            LANE, self.worker, limit, VISIBILITY_TIMEOUT_S, floors=floors,
            order=self.lane.claim_order(self.cursor) if self.lane.ordered else None)
        _, _, claimed = queue.settle_and_claim(conn, [], [], request)
        fair = self.lane.fair_by != "none"
        self.floors.claimed(floors, [(j.priority, j.run_at, j.id) for j in claimed.jobs],
                            limit, now, fair=fair, aged=self.lane.max_wait is not None)
        if fair and claimed.jobs:
            self.cursor = next_key_cursor(self.cursor, claimed.jobs)
            self.floors.keys.claimed([(j.priority, j.fairness_key or j.handler, j.run_at, j.id)
                                      for j in claimed.jobs], limit)
        return claimed.jobs


def fill_million(env: Env) -> dict[str, Any]:
    started = time.monotonic()
    with env.bench_conn() as conn:
        conn.execute("SELECT setseed(0.5)")
        conn.execute(FILL_SQL, {"lane": LANE, "due": EXPLAIN_DUE, "span": EXPLAIN_DUE_SPAN_S,
                                "keys": EXPLAIN_KEYS, "total": EXPLAIN_JOBS})
        filled = time.monotonic() - started
        conn.execute("VACUUM (ANALYZE) jobs")
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE run_at <= now()),"
            "       count(DISTINCT fairness_key), count(DISTINCT priority),"
            "       pg_size_pretty(pg_relation_size('jobs')),"
            "       pg_size_pretty(pg_relation_size('jobs_fair_idx')),"
            "       pg_size_pretty(pg_relation_size('jobs_claimable_idx'))"
            "  FROM jobs").fetchone()
    assert row is not None
    table = dict(zip(["jobs", "due", "keys", "priorities", "table_size", "fair_idx_size",
                      "claimable_idx_size"], row, strict=True))
    table["fill_seconds"] = round(filled, 1)
    table["fill_and_vacuum_seconds"] = round(time.monotonic() - started, 1)
    log(f"explain: {table}")
    return table


@contextmanager
def auto_explained(conn: psycopg.Connection) -> Iterator[list[str]]:
    """Every statement run meanwhile on ``conn``, nested ones included: its EXPLAIN (ANALYZE,
    BUFFERS), as auto_explain sends it (a notice per statement, innermost first)."""
    plans: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "plan:" in diag.message_primary:
            plans.append(diag.message_primary)

    for statement in ("LOAD 'auto_explain'", "SET auto_explain.log_analyze = on",
                      "SET auto_explain.log_buffers = on", "SET auto_explain.log_timing = on",
                      "SET auto_explain.log_nested_statements = on",
                      "SET auto_explain.log_level = notice",
                      "SET client_min_messages = notice"):
        conn.execute(statement)
    conn.add_notice_handler(keep)
    conn.execute("SET auto_explain.log_min_duration = 0")
    try:
        yield plans
    finally:
        conn.execute("SET auto_explain.log_min_duration = -1")
        conn.remove_notice_handler(keep)


@dataclass
class Scan:
    statement: int
    node: str
    index: str | None
    rows: int
    loops: int
    buffers: str
    ok: bool
    role: str


def scans_of_jobs(plans: Sequence[str]) -> list[Scan]:
    """Every scan of the jobs table in ``plans``, judged against the claim's index rules."""
    found = []
    for number, plan in enumerate(plans, 1):
        lines = plan.splitlines()
        for at, line in enumerate(lines):
            match = _SCAN.search(line)
            if not match or match["relation"] not in ("jobs", "jobd.jobs"):
                continue
            actual = _ACTUAL.search(line)
            rows, loops = ((0, 0) if actual is None or actual["never"]
                           else (int(actual["rows"]), int(actual["loops"])))
            buffers = next((b["buffers"] for b in (_BUFFERS.match(n) for n in lines[at + 1:
                                                                                 at + 4]) if b),
                           "")
            node = match["node"]
            indexes = ({match["index"]} if node.startswith("Index")
                       else bitmap_indexes(lines, at) if node == "Bitmap Heap Scan" else set())
            role, ok = judge(node, indexes, rows * loops)
            found.append(Scan(number, node, "+".join(sorted(indexes)) or None, rows, loops,
                              buffers, ok, role))
    return found


def bitmap_indexes(lines: Sequence[str], at: int) -> set[str]:
    """The indexes of the Bitmap Index Scans below the Bitmap Heap Scan at ``lines[at]``."""
    depth = len(lines[at]) - len(lines[at].lstrip())
    found = set()
    for line in lines[at + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            break
        if (child := _BITMAP_INDEX.search(line)) is not None:
            found.add(child["index"])
    return found


def judge(node: str, indexes: set[str], rows_read: int) -> tuple[str, bool]:
    """What a scan of jobs is for, and whether the claim may run it. Claimable jobs are read
    in index order, by probes of an Index Scan; the picked ids and the suspect probe (rows
    by id, claimed rows) may also come through a bitmap of their own small indexes."""
    if not indexes:
        return f"NOT ALLOWED: {node} without an index", False
    if node.startswith("Index") and indexes <= CLAIM_INDEXES:
        role = "claimable jobs"
    elif indexes <= OTHER_INDEXES.keys():
        role = "; ".join(sorted({OTHER_INDEXES[index] for index in indexes}))
    else:
        return f"NOT ALLOWED: {node} on {', '.join(sorted(indexes))}", False
    # An index scan that reads far more rows than the claim takes is a range scan, not the
    # probes the claim is written as (EXPLAIN's rows are per loop, rounded).
    if rows_read > MAX_ROWS_READ:
        return f"NOT ALLOWED: {rows_read:,} rows read ({role})", False
    return role, True


def server_times(conn: psycopg.Connection) -> dict[str, float]:
    """The claim statement's execution time on the server since the last reset
    (pg_stat_statements: no round trip, no commit)."""
    rows = [row for row in conn.execute(
        "SELECT s.query, s.calls, s.total_exec_time, s.min_exec_time, s.max_exec_time"
        "  FROM public.pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
        " WHERE d.datname = current_database()").fetchall()
        if row[0].startswith(CLAIM_STATEMENTS)]
    calls = sum(row[1] for row in rows)
    if calls != CLAIMS_PER_KIND:
        raise RuntimeError(f"pg_stat_statements counted {calls} claims, not {CLAIMS_PER_KIND}")
    return {"calls": calls, "mean": sum(row[2] for row in rows) / calls,
            "min": min(row[3] for row in rows), "max": max(row[4] for row in rows)}


def claim_kind(env: Env, name: str, lane: LaneConfig, restore: bool) -> dict[str, Any]:
    """CLAIMS_PER_KIND timed claims of CLAIM_BATCH, then one with its plans; with
    ``restore``, the table put back as it was and vacuumed (with ANALYZE) after them."""
    loop = ClaimLoop(lane, worker="explain-worker")
    times_ms, taken, keys = [], [], []
    with env.bench_conn() as conn:
        conn.execute("SELECT public.pg_stat_statements_reset()")
        for _ in range(CLAIMS_PER_KIND):
            started = time.perf_counter()
            jobs = loop.claim(conn, CLAIM_BATCH)
            times_ms.append((time.perf_counter() - started) * 1000.0)
            taken.append(len(jobs))
            keys.append(len({j.fairness_key or j.handler for j in jobs}))
        server = server_times(conn)
        with auto_explained(conn) as plans:
            explained = loop.claim(conn, CLAIM_BATCH)
        if restore:
            conn.execute(RESTORE_SQL)
            conn.execute("VACUUM (ANALYZE) jobs")
    scans = scans_of_jobs(plans)
    fair_path = lane.fair_by != "none"
    passed = (bool(scans) and all(s.ok for s in scans)
              and (not fair_path or any(s.index == "jobs_fair_idx" for s in scans)))
    result = {"kind": name, "lane": {"max_wait": lane.max_wait, "fair_by": lane.fair_by},
              "claim_ms": median_p95(times_ms), "claim_ms_each": [round(t, 3) for t in times_ms],
              "server_ms": server,
              "jobs_per_claim": taken, "keys_per_claim": keys,
              "explained_claim_took": len(explained), "statements": len(plans),
              "plans": plans, "scans": [s.__dict__ for s in scans],
              "verdict": "PASS" if passed else "FAIL"}
    log(f"explain {name}: claim median {result['claim_ms']['median']:.2f} ms, p95 "
        f"{result['claim_ms']['p95']:.2f} ms; {len(plans)} statements; {result['verdict']}")
    return result


def merged(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One kind over its rounds: the plans of the last, the times of all."""
    servers = [r["server_ms"] for r in results]
    return {**results[-1],
            "claim_ms": median_p95([t for r in results for t in r["claim_ms_each"]]),
            "claim_ms_round_medians": [round(r["claim_ms"]["median"], 3) for r in results],
            "server_ms": {"calls": sum(x["calls"] for x in servers),
                          "mean": statistics.mean(x["mean"] for x in servers),
                          "min": min(x["min"] for x in servers),
                          "max": max(x["max"] for x in servers)},
            "server_ms_round_means": [round(x["mean"], 3) for x in servers],
            "verdict": "PASS" if all(r["verdict"] == "PASS" for r in results) else "FAIL"}


def million_scenario(env: Env, rounds: int) -> dict[str, Any]:
    reset_queue(env)
    table = fill_million(env)
    # Rounds interleave the kinds, so that drift on the machine spreads over all of them.
    per_kind: dict[str, list[dict[str, Any]]] = {name: [] for name in CLAIM_KINDS}
    for _ in range(rounds):
        for name, lane in CLAIM_KINDS.items():
            per_kind[name].append(claim_kind(env, name, lane, restore=True))
    t = table
    return {"name": "1M rows",
            "description": (
                f"jobs {t['jobs']:,} (due {t['due']:,}, run_at over the last "
                f"{EXPLAIN_DUE_SPAN_S // 60} minutes; {t['keys']:,} fairness keys; "
                f"{t['priorities']} priorities); table {t['table_size']}, jobs_fair_idx "
                f"{t['fair_idx_size']}, jobs_claimable_idx {t['claimable_idx_size']}; VACUUM "
                f"ANALYZE after the fill and after each kind (its claimed jobs put back); "
                f"{rounds} round(s) of the kinds"),
            "table": table, "rounds": rounds,
            "kinds": [merged(results) for results in per_kind.values()]}


def burst_scenario(env: Env, keys: int) -> dict[str, Any]:
    """The table the drain benchmark claims from: a burst of BURST_JOBS due jobs over ``keys``
    fairness keys committed into a lane whose statistics were taken while it was empty
    (reset_queue), as after an idle spell; autovacuum analyzes it within its naptime (a
    minute) at the soonest. The kinds run one after the other on what the previous left,
    nothing is put back. With several keys the fair claim walks from key to key (due_keys),
    whose plan such statistics once turned into a sort of every due job at each step."""
    reset_queue(env)
    with env.bench_conn() as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE,
                                              fairness_key=f"tenant-{n % keys:04d}")
                                 for n in range(BURST_JOBS)])
    kinds = [claim_kind(env, name, lane, restore=False) for name, lane in BURST_KINDS.items()]
    spread = "one fairness key" if keys == 1 else f"{keys} fairness keys"
    return {"name": "burst" if keys == 1 else f"burst over {keys} keys",
            "description": (f"{BURST_JOBS:,} due jobs of {spread} enqueued at once "
                            "into the empty lane after VACUUM ANALYZE of the empty table "
                            "(no ANALYZE since: the drain's table); one round, the kinds in "
                            "turn on what the previous one left"),
            "rounds": 1, "kinds": kinds}


def run_explain(env: Env, args: Args) -> dict[str, Any]:
    rounds = args.rounds["explain"]
    return {"claims_per_round": CLAIMS_PER_KIND, "batch": CLAIM_BATCH,
            "max_wait_s": EXPLAIN_MAX_WAIT_S, "max_rows_read": MAX_ROWS_READ,
            "scenarios": [million_scenario(env, rounds),
                          *(burst_scenario(env, keys) for keys in BURST_KEYS)]}


def print_explain(result: dict[str, Any]) -> None:
    print("== --explain: what a claim of 100 runs, and what it costs ==")
    print(f"Each kind: {result['claims_per_round']} consecutive claims of {result['batch']}, "
          "each committed, through the worker's path (queue.settle_and_claim with the "
          "worker's floors and key cursor), then one more with auto_explain (ANALYZE, "
          "BUFFERS, nested statements). The check: every scan of jobs is an Index Scan or "
          "Index Only Scan on jobs_fair_idx / jobs_claimable_idx (claimable jobs), jobs_pkey "
          "(the picked ids) or jobs_suspect_idx (the suspect probe), and reads at most "
          f"{result['max_rows_read']:,} rows (rows x loops).")
    print()
    for scenario in result["scenarios"]:
        print_scenario(scenario, result["claims_per_round"])


def print_scenario(scenario: dict[str, Any], claims: int) -> None:
    print(f"=== {scenario['name']}: {scenario['description']} ===")
    print()
    for kind in scenario["kinds"]:
        print(f"-- plans: {kind['kind']} (claim no. {claims + 1}, {kind['explained_claim_took']}"
              f" jobs, {kind['statements']} statements, innermost first) --")
        for number, plan in enumerate(kind["plans"], 1):
            print(f"[statement {number}] {plan}")
            print()
    print(f"-- {scenario['name']}: every scan of jobs in those plans --")
    print(f"{'kind':<44} {'stmt':>4}  {'node':<16} {'index':<18} {'rows':>6} {'loops':>5}  "
          f"{'ok':<3} role; buffers")
    for kind in scenario["kinds"]:
        for s in kind["scans"]:
            print(f"{kind['kind']:<44} {s['statement']:>4}  {s['node']:<16} "
                  f"{s['index'] or '-':<18} {s['rows']:>6} {s['loops']:>5}  "
                  f"{'ok' if s['ok'] else 'BAD':<3} {s['role']}; {s['buffers'] or '-'}")
    print()
    print(f"-- {scenario['name']}: the claim's time (ms). wall: round trip with its commit "
          "(synchronous_commit on), client side, median/p95/max; server: the claim "
          "statement's execution (pg_stat_statements), mean/max --")
    print(f"{'claim of 100':<44} {'wall p50':>8} {'p95':>6} {'max':>6}  {'server':>6} "
          f"{'max':>6} {'claims':>6} {'jobs/claim':>10} {'keys/claim':>10}  check")
    for kind in scenario["kinds"]:
        c, sv = kind["claim_ms"], kind["server_ms"]
        jobs = f"{min(kind['jobs_per_claim'])}-{max(kind['jobs_per_claim'])}"
        keys = f"{min(kind['keys_per_claim'])}-{max(kind['keys_per_claim'])}"
        print(f"{kind['kind']:<44} {c['median']:>8.2f} {c['p95']:>6.2f} {c['max']:>6.1f}  "
              f"{sv['mean']:>6.2f} {sv['max']:>6.1f} {c['count']:>6} {jobs:>10} {keys:>10}  "
              f"{kind['verdict']}")
    print(flush=True)


# --- --drain: fairness on vs off -----------------------------------------------------------


def drain_specs(keys: int, jobs: int) -> list[jobd.JobSpec]:
    return [jobd.JobSpec("noop", {}, LANE, fairness_key=f"tenant-{n % keys:04d}")
            for n in range(jobs)]


def drain_contenders(round_no: int) -> list[tuple[str, int, dict[str, Any]]]:
    """(name, keys, lane options) in this round's order: off and on alternate which goes first
    from one key count to the next and from round to round."""
    order = []
    for position, keys in enumerate(DRAIN_KEY_COUNTS):
        pair = [(f"off-k{keys}", keys, {"fair_by": "none"}),
                (f"on-k{keys}", keys, {"fair_by": "handler"})]
        if (position + round_no) % 2:
            pair.reverse()
        order += pair
    order.append(("max_wait-k1", 1, {"max_wait": f"{DRAIN_MAX_WAIT_S:g}s"}))
    return order


def claim_statement(statements: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The drain's claims on the server: how many, their mean execution time, jobs each."""
    for row in statements:
        if row["query"].startswith(CLAIM_STATEMENTS) and row["calls"]:
            return {"claims": row["calls"], "claim_mean_ms": row["total_ms"] / row["calls"],
                    "jobs_per_claim": row["rows"] / row["calls"]}
    raise RuntimeError("no claim statement in pg_stat_statements")


def run_drain(env: Env, args: Args) -> dict[str, Any]:
    rounds = args.rounds["drain"]
    specs = {keys: drain_specs(keys, args.drain_jobs) for keys in DRAIN_KEY_COUNTS}
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_no in range(1, rounds + 1):
        for workers, concurrency in DRAIN_SETTINGS:
            for name, keys, options in drain_contenders(round_no):
                label = f"{workers}x{concurrency}-{name}"
                result = measure_drain(env, workers, concurrency, round_no,
                                       lane_options=options, specs=specs[keys], label=label)
                if result["daemon_warnings"]:
                    raise RuntimeError(f"the daemon of {label} logged warnings")
                runs.setdefault(label, []).append(
                    {**{k: result[k] for k in ("jobs_per_s", "seconds", "workers_that_claimed",
                                               "other_load_cores", "own_cpu_cores")},
                     **claim_statement(result.get("statements", []))})
    settings = []
    for workers, concurrency in DRAIN_SETTINGS:
        prefix = f"{workers}x{concurrency}"
        rows = [contender_row(runs, prefix, f"{state}-k{keys}", keys)
                for keys in DRAIN_KEY_COUNTS for state in ("off", "on")]
        rows.append(contender_row(runs, prefix, "max_wait-k1", 1))
        settings.append({"setting": prefix, "workers": workers, "concurrency": concurrency,
                         "contenders": rows})
    return {"jobs": args.drain_jobs, "rounds": rounds, "max_wait_s": DRAIN_MAX_WAIT_S,
            "target": f"on/off >= {DRAIN_TARGET_RATIO:g} at 1 key", "settings": settings,
            "runs": runs}


def contender_row(runs: dict[str, list[dict[str, Any]]], prefix: str, name: str,
                  keys: int) -> dict[str, Any]:
    """Medians over rounds, and the ratio to fair_by none at the same key count."""
    mine, off = runs[f"{prefix}-{name}"], runs[f"{prefix}-off-k{keys}"]

    def med(results: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in results)

    return {"contender": name, "keys": keys, "jobs_per_s": med(mine, "jobs_per_s"),
            "ratio_to_off": med(mine, "jobs_per_s") / med(off, "jobs_per_s"),
            "claim_mean_ms": med(mine, "claim_mean_ms"),
            "claim_ms_ratio_to_off": med(mine, "claim_mean_ms") / med(off, "claim_mean_ms"),
            "jobs_per_claim": med(mine, "jobs_per_claim"),
            "rounds_jobs_per_s": [round(r["jobs_per_s"]) for r in mine],
            "other_load_cores": [r["other_load_cores"] for r in mine]}


def print_drain(result: dict[str, Any]) -> None:
    print(f"== --drain: {result['jobs']:,} no-op jobs committed at once, medians of "
          f"{result['rounds']} round(s) ==")
    print("off: fair_by none; on: fair_by handler (shares by the jobs' fairness_key); "
          f"max_wait: {result['max_wait_s']:g}s, fair_by none. Target: {result['target']}. "
          "claim ms: the claim statement's mean execution on the server (pg_stat_statements) "
          "over the drain")
    print(f"{'setting':<8} {'contender':<12} {'keys':>5} {'jobs/s':>8} {'/ off':>6}  "
          f"{'verdict':<7} {'claim ms':>8} {'/ off':>6} {'jobs/claim':>10}  rounds jobs/s; "
          "other load (cores)")
    for s in result["settings"]:
        for row in s["contenders"]:
            verdict = ""
            if row["contender"] == "on-k1":
                verdict = "ok" if row["ratio_to_off"] >= DRAIN_TARGET_RATIO else "MISSED"
            rounds = ", ".join(f"{v:,}" for v in row["rounds_jobs_per_s"])
            loads = ", ".join(f"{v:.2f}" for v in row["other_load_cores"])
            print(f"{s['setting']:<8} {row['contender']:<12} {row['keys']:>5} "
                  f"{row['jobs_per_s']:>8,.0f} {row['ratio_to_off']:>6.2f}  {verdict:<7} "
                  f"{row['claim_mean_ms']:>8.2f} {row['claim_ms_ratio_to_off']:>6.2f} "
                  f"{row['jobs_per_claim']:>10.1f}  {rounds}; {loads}")
    loads = [r["other_load_cores"] for runs in result["runs"].values() for r in runs]
    print(f"other load on the machine during the drains: up to {max(loads):.2f} cores "
          f"(median {statistics.median(loads):.2f})")
    print(flush=True)


# --- --waits: a saturated lane --------------------------------------------------------------


def wait_jobs() -> list[list[jobd.JobSpec]]:
    """The offered jobs, one batch per tick: the same for every contender."""
    rng = random.Random(WAIT_SEED)
    per_tick = round(WAIT_OFFERED_PER_S * WAIT_TICK_S)
    priorities, p_weights = zip(*WAIT_PRIORITIES.items(), strict=True)
    keys, k_weights = zip(*WAIT_KEYS.items(), strict=True)
    batches = []
    for _ in range(round(WAIT_SECONDS / WAIT_TICK_S)):
        batches.append([
            jobd.JobSpec("nap", {"ms": WAIT_HANDLER_MS}, LANE,
                         priority=rng.choices(priorities, p_weights)[0],
                         fairness_key=rng.choices(keys, k_weights)[0])
            for _ in range(per_tick)])
    return batches


def offer(env: Env, batches: Sequence[Sequence[jobd.JobSpec]]) -> dict[str, float]:
    """Each batch in a transaction of its own at a fixed schedule; behind it, no sleep."""
    worst_lag = 0.0
    with connect(env.url, "jobd", application_name="fairness-bench-enqueuer") as conn:
        begin = time.perf_counter() + 0.05
        for number, batch in enumerate(batches):
            wait = begin + number * WAIT_TICK_S - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            else:
                worst_lag = max(worst_lag, -wait)
            jobd.enqueue_many(conn, batch)
        offered = time.perf_counter() - begin
    total = sum(len(b) for b in batches)
    return {"offered_jobs": total, "offered_seconds": round(offered, 2),
            "offered_per_s": round(total / offered, 1),
            "enqueuer_worst_lag_ms": round(worst_lag * 1000.0, 1)}


def wait_stats(waits: list[tuple[float, bool]]) -> dict[str, float]:
    """Percentiles of (wait, claimed) pairs; unclaimed jobs count with their wait so far."""
    ordered = sorted(wait for wait, _claimed in waits)
    return {"p50": percentile(ordered, 50), "p95": percentile(ordered, 95),
            "p99": percentile(ordered, 99), "max": ordered[-1], "count": len(ordered),
            "unclaimed": sum(1 for _wait, claimed in waits if not claimed)}


def wait_for_drain(env: Env, window: float) -> float:
    """Until the queue is empty or ``window`` seconds have passed; returns the seconds taken."""
    started = time.monotonic()
    with env.bench_conn() as conn:
        while time.monotonic() - started < window:
            row = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM jobs)").fetchone()
            if row is not None and row[0]:
                break
            time.sleep(0.2)
    return time.monotonic() - started


def measure_waits(env: Env, name: str, options: dict[str, Any], round_no: int,
                  batches: Sequence[Sequence[jobd.JobSpec]]) -> dict[str, Any]:
    reset_queue(env)
    stamps = env.scratch(f"waits-{name}-{round_no}")
    config = bench_config(env, f"waits-{name}", options)
    with Daemon(env, config, stamps, workers=WAIT_WORKERS) as daemon:
        time.sleep(2.0)
        log(f"waits {name} round {round_no}: offering {WAIT_OFFERED_PER_S}/s for "
            f"{WAIT_SECONDS:g}s")
        offered = offer(env, batches)
        drain_seconds = wait_for_drain(env, WAIT_DRAIN_WINDOW_S)
        problems = daemon.problems()
    if problems:
        raise RuntimeError(f"the daemon of waits {name} logged warnings: {problems[:3]}")
    # Jobs not claimed when the window closed (the daemon stopped, its buffer given back)
    # count with the wait they had by then: a lower bound, listed as "unclaimed".
    with env.bench_conn() as conn:
        rows = conn.execute(
            "SELECT priority, fairness_key, extract(epoch FROM claimed_at - run_at)::float8,"
            "       true FROM jobs_archive"
            " UNION ALL "
            "SELECT priority, fairness_key,"
            "       extract(epoch FROM statement_timestamp() - run_at)::float8, false"
            "  FROM jobs WHERE state IN ('pending', 'failed')").fetchall()
        span = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at))"
                            "::float8 FROM jobs_archive").fetchone()
    assert span is not None
    groups: dict[str, dict[str, list[tuple[float, bool]]]] = {"priority": {}, "key": {}}
    for priority, key, wait, claimed in rows:
        groups["priority"].setdefault(str(priority), []).append((wait, claimed))
        groups["key"].setdefault(key, []).append((wait, claimed))
    claimed_count = sum(1 for r in rows if r[3])
    result = {**offered, "drain_window_s": WAIT_DRAIN_WINDOW_S,
              "seconds_to_empty": (round(drain_seconds, 1)
                                   if claimed_count == len(rows) else None),
              "claimed": claimed_count, "unclaimed": len(rows) - claimed_count,
              "drained_per_s": round(claimed_count / span[0], 1),
              "all": wait_stats([(r[2], r[3]) for r in rows]),
              "by_priority": {p: wait_stats(v) for p, v in sorted(groups["priority"].items(),
                                                                  key=lambda i: -int(i[0]))},
              "by_key": {k: wait_stats(v) for k, v in sorted(groups["key"].items())}}
    log(f"waits {name} round {round_no}: offered {offered['offered_per_s']}/s, drained "
        f"{result['drained_per_s']}/s, {result['unclaimed']} unclaimed after the window; "
        f"wait p50 {result['all']['p50']:.2f}s, max {result['all']['max']:.2f}s")
    return result


def bench_config(env: Env, name: str, options: dict[str, Any]) -> Path:
    return write_config(env, name, {LANE: (WAIT_WORKERS, WAIT_CONCURRENCY)},
                        lane_options={LANE: options},
                        handlers={"nap": f"{WAIT_HANDLER_MODULE}:nap"})


def run_waits(env: Env, args: Args) -> dict[str, Any]:
    rounds = args.rounds["waits"]
    (env.handler_dir / f"{WAIT_HANDLER_MODULE}.py").write_text(WAIT_HANDLER_SOURCE)
    batches = wait_jobs()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in WAIT_CONTENDERS}
    for round_no in range(1, rounds + 1):
        names = list(WAIT_CONTENDERS)
        if round_no % 2 == 0:
            names.reverse()
        for name in names:
            results[name].append(measure_waits(env, name, WAIT_CONTENDERS[name], round_no,
                                               batches))
    return {"lane": {"workers": WAIT_WORKERS, "concurrency": WAIT_CONCURRENCY,
                     "handler_ms": WAIT_HANDLER_MS},
            "offered_per_s": WAIT_OFFERED_PER_S, "seconds": WAIT_SECONDS,
            "drain_window_s": WAIT_DRAIN_WINDOW_S, "priorities": WAIT_PRIORITIES,
            "keys": WAIT_KEYS, "rounds": rounds,
            "contenders": WAIT_CONTENDERS, "results": results}


def print_waits(result: dict[str, Any]) -> None:
    lane = result["lane"]
    names = list(result["contenders"])
    print(f"== --waits: a saturated lane ({lane['workers']} worker x concurrency "
          f"{lane['concurrency']}, handler sleeps {lane['handler_ms']:g} ms; offered "
          f"{result['offered_per_s']:,}/s for {result['seconds']:g}s, then "
          f"{result['drain_window_s']:g}s to empty the queue) ==")
    print("priorities " + ", ".join(f"{p}: {w:.0%}" for p, w in result["priorities"].items())
          + "; keys " + ", ".join(f"{k}: {w:.0%}" for k, w in result["keys"].items()))
    print("; ".join(f"{name}: " + (", ".join(f"{k} {v}" for k, v in options.items())
                                   or "max_wait and fair_by off")
                    for name, options in result["contenders"].items()))
    print("wait = claimed_at - run_at in seconds; a job still unclaimed when the window "
          "closed counts with its wait so far (a lower bound), and in 'uncl.'")
    for round_no in range(result["rounds"]):
        runs = {name: result["results"][name][round_no] for name in names}
        print(f"round {round_no + 1}: " + "; ".join(
            f"{name}: offered {r['offered_per_s']:,}/s, claimed {r['drained_per_s']:,}/s, "
            + (f"empty {r['seconds_to_empty']:g}s after the offer" if r["unclaimed"] == 0
               else f"{r['unclaimed']:,} of {r['offered_jobs']:,} unclaimed")
            for name, r in runs.items()))
        stats = ("p50", "p95", "p99", "max", "unclaimed")
        print(f"{'':<12}" + "".join(f"{name:^45}" for name in names) + f"{'jobs':>7}")
        print(f"{'group':<12}" + "".join(f"{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}{'uncl.':>9}"
                                        for _ in names) + f"{'':>7}")
        first = runs[names[0]]
        groups = [("all", "all", None)]
        groups += [(f"priority {p}", "by_priority", p) for p in first["by_priority"]]
        groups += [(f"key {k}", "by_key", k) for k in first["by_key"]]
        for label, section, key in groups:
            cells = []
            for name in names:
                entry = runs[name][section] if key is None else runs[name][section][key]
                cells += [f"{entry[stat]:>9.3f}" if stat != "unclaimed"
                          else f"{entry[stat]:>9,}" for stat in stats]
            count = first[section]["count"] if key is None else first[section][key]["count"]
            print(f"{label:<12}" + "".join(cells) + f"{count:>7,}")
    print(flush=True)


# --- the run -------------------------------------------------------------------------------


MODES: dict[str, tuple[Callable[[Env, Args], dict[str, Any]],
                       Callable[[dict[str, Any]], None]]] = {
    "explain": (run_explain, print_explain),
    "drain": (run_drain, print_drain),
    "waits": (run_waits, print_waits),
}


@dataclass
class Args:
    modes: list[str]
    rounds: dict[str, int] = field(default_factory=dict)
    json_path: str | None = None
    keep: bool = False
    drain_jobs: int = DRAIN_JOBS


def parse_args(argv: Sequence[str] | None) -> Args:
    parser = argparse.ArgumentParser(
        description="The cost and the effect of fairness within a lane (max_wait, fair_by).")
    for mode in MODES:
        parser.add_argument(f"--{mode}", action="store_true", help=f"run the {mode} part")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of each part (default: explain 3, drain 2, waits 1)")
    parser.add_argument("--drain-jobs", type=int, default=DRAIN_JOBS,
                        help=f"jobs per drain (default {DRAIN_JOBS:,})")
    parser.add_argument("--json", dest="json_path", metavar="PATH",
                        help="write every figure and setting to PATH as JSON")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (daemon logs, cluster)")
    ns = parser.parse_args(argv)
    if ns.rounds is not None and ns.rounds < 1:
        parser.error("--rounds must be at least 1")
    if ns.drain_jobs < 1:
        parser.error("--drain-jobs must be at least 1")
    modes = [mode for mode in MODES if getattr(ns, mode)] or list(MODES)
    defaults = {"explain": 3, "drain": 2, "waits": 1}
    rounds = {mode: ns.rounds or defaults[mode] for mode in modes}
    return Args(modes, rounds, ns.json_path, ns.keep, ns.drain_jobs)


def print_header(env: Env) -> dict[str, Any]:
    header = {"at": f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC", "cores": os.cpu_count(),
              "python": sys.version.split()[0], "jobd": jobd.__version__,
              "psycopg": psycopg.__version__, "source": source_revision(),
              "server": {name: env.settings[name] for name in SERVER_SETTINGS}}
    print(f"jobd fairness benchmark, {header['at']}; {header['cores']} cores; Python "
          f"{header['python']}; jobd {header['jobd']}; psycopg {header['psycopg']}")
    print(f"source: {header['source']}")
    print(f"PostgreSQL {env.settings['server_version']} (private cluster); "
          + "; ".join(f"{name}={env.settings[name]}" for name in SERVER_SETTINGS[1:]))
    print(flush=True)
    return header


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    document: dict[str, Any] = {"benchmark": "fairness"}
    for mode in args.modes:
        # A fresh cluster per part: the 1M rows of --explain stay out of the drains. Every
        # part loads pg_stat_statements, for the claim's time on the server (the same small
        # overhead for every contender).
        with environment(statements=True, keep=args.keep) as env:
            if "header" not in document:
                document["header"] = print_header(env)
            run, show = MODES[mode]
            mode_started = time.monotonic()
            document[mode] = run(env, args)
            document[mode]["seconds_taken"] = round(time.monotonic() - mode_started, 1)
            document[mode]["server_settings"] = dict(env.settings)
            show(document[mode])
            log(f"{mode}: {document[mode]['seconds_taken']:.0f}s")
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump(document, out, indent=1, default=str)
            out.write("\n")
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

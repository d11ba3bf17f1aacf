"""What the Prometheus metrics cost: the drain rate with metrics on and off, and the database
time of the metrics sampler as history and backlog grow.

Usage::

    .venv/bin/python -m bench.metrics_cost [--rounds N] [--settings 1x10,2x10]
        [--archived N] [--scheduled N] [--samples N] [--idle] [--only drain|worker|sampler]

(from the repository's top directory, like ``python -m bench``).

Everything runs on a private throwaway cluster (``bench/daemon_bench.py``'s environment:
``synchronous_commit=on``, a fresh database, the no-op handlers).

drain
    ``daemon_bench.measure_drain`` at each setting (worker processes x concurrency, default
    1x10 and 2x10): 20,000 no-op jobs committed at once, jobs/s from the first handler start
    to the last ``finished_at``. "on" runs the daemon with ``metrics.listen`` and scrapes its
    ``/metrics`` every second during the drain, as Prometheus would; "off" runs it without
    (workers then count nothing per handler and no sampler runs). On and off alternate within
    each round, the order swapped every round. Reported: the median of each and the
    slowdown of the medians (target <= 3 %), and the CPU time per job (from /proc) of the
    daemon, the cluster and this script together, and of the daemon's processes alone, on
    and off: on a machine shared with other work the rate swings with their load, the CPU
    per job less.
sampler
    The sampler's two statements (``jobd.duties.metrics_sampler.take_sample``) on a
    connection set up like the supervisor's, for three lanes, in three states of the
    database: a small live queue (1,000 due, 100 retrying, 100 claimed jobs, 1,000 dead);
    the same with ``--archived`` finished jobs in ``jobd.jobs_archive`` (default 1,000,000);
    then also ``--scheduled`` jobs waiting for a later ``run_at`` (default 100,000). After
    each fill: VACUUM ANALYZE (autovacuum's job on a live system), then ``--samples`` samples
    (default 50): client-side time per sample (median, p95) and the shared buffers one
    sample touches (EXPLAIN ANALYZE BUFFERS). With the 5 s interval the time is also given
    as a share of one database backend.
worker
    The worker-side code that metrics add to, in-process and without a database: claims of
    100 jobs counted, their outcomes added, batched and written (``Counters``,
    ``Completer``), with and without the per-handler observer: CPU time per job, the lower
    quartile of 40 runs. Deterministic where the drain is not: on a loaded machine the
    drain's rounds spread far wider than the metrics' cost.
idle (--idle)
    ``daemon_bench.measure_idle`` with and without metrics: database transactions per second
    of an idle node (2 lanes x 2 workers, 60 s window; about 75 s each).

Figures from a shared machine are disturbed by whatever else runs: each drain line says how
many cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.daemon_bench import (
    Env,
    drain_name,
    environment,
    log,
    measure_drain,
    measure_idle,
    percentile,
    reset_queue,
)
from bench.settings import Setting, parse_settings
from jobd.completer import Completer, Counters
from jobd.config import LaneConfig
from jobd.db import DEFAULT_SESSION, connect, supervisor_session
from jobd.duties.metrics_sampler import SAMPLE_INTERVAL, take_sample
from jobd.jobs import Job
from jobd.localpg import free_port
from jobd.outcomes import Outcome
from jobd.queries import query
from jobd.queue import FailOutcome, WriteOutcome
from jobd.worker_metrics import WorkObserver

SETTINGS = "1x10,2x10"
ROUNDS = 3
ARCHIVED = 1_000_000
SCHEDULED = 100_000
SAMPLES = 50
LANES = ["default", "mail", "reports"]
SLOWDOWN_TARGET_PCT = 3.0


# --- drain ---------------------------------------------------------------------------------


def run_drains(env: Env, settings: Sequence[Setting], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for setting in settings:
        workers, concurrency = setting.workers, setting.concurrency
        on: list[dict[str, Any]] = []
        off: list[dict[str, Any]] = []
        for round_no in range(1, rounds + 1):
            order = ("off", "on") if round_no % 2 else ("on", "off")
            for mode in order:
                listen = f"127.0.0.1:{free_port()}" if mode == "on" else None
                result = measure_drain(env, workers, concurrency, round_no, listen)
                (on if mode == "on" else off).append(result)
        on_rate = statistics.median(r["jobs_per_s"] for r in on)
        off_rate = statistics.median(r["jobs_per_s"] for r in off)
        # CPU of the whole tree (daemon, cluster, this script) per job: less disturbed by
        # other load on the machine than the rate is.
        on_cpu = statistics.median(cpu_us_per_job(r, "own_cpu_seconds") for r in on)
        off_cpu = statistics.median(cpu_us_per_job(r, "own_cpu_seconds") for r in off)
        # The daemon's processes alone (supervisor and workers): what metrics change.
        on_daemon = statistics.median(cpu_us_per_job(r, "daemon_cpu_seconds") for r in on)
        off_daemon = statistics.median(cpu_us_per_job(r, "daemon_cpu_seconds") for r in off)
        rows.append({
            "setting": f"{workers}x{concurrency}", "name": drain_name(workers, concurrency),
            "off_jobs_per_s": off_rate, "on_jobs_per_s": on_rate,
            "slowdown_pct": 100.0 * (off_rate - on_rate) / off_rate,
            "off_cpu_us_per_job": off_cpu, "on_cpu_us_per_job": on_cpu,
            "cpu_increase_pct": 100.0 * (on_cpu - off_cpu) / off_cpu,
            "off_daemon_cpu_us_per_job": off_daemon, "on_daemon_cpu_us_per_job": on_daemon,
            "daemon_cpu_increase_pct": 100.0 * (on_daemon - off_daemon) / off_daemon,
            "off_rounds": [round(r["jobs_per_s"]) for r in off],
            "on_rounds": [round(r["jobs_per_s"]) for r in on],
            "scrapes": [r["scrapes"] for r in on],
            "other_load_cores": max(r["other_load_cores"] for r in on + off),
        })
    return rows


def cpu_us_per_job(result: dict[str, Any], key: str) -> float:
    return 1e6 * result[key] / result["jobs"]


def print_drains(rows: list[dict[str, Any]]) -> None:
    print("drain, 20,000 no-op jobs; median jobs/s of the rounds (rounds in brackets); "
          "metrics on: scraped every 1 s")
    for row in rows:
        verdict = "ok" if row["slowdown_pct"] <= SLOWDOWN_TARGET_PCT else "MISSED"
        print(f"  {row['setting']:>6}: off {row['off_jobs_per_s']:8,.0f} {row['off_rounds']}"
              f"   on {row['on_jobs_per_s']:8,.0f} {row['on_rounds']}"
              f"   slowdown {row['slowdown_pct']:+.1f} % (target <= {SLOWDOWN_TARGET_PCT:g} %:"
              f" {verdict}); other load up to {row['other_load_cores']:.2f} cores")
        print(f"          CPU per job, daemon + cluster + bench: off "
              f"{row['off_cpu_us_per_job']:.0f} us, on {row['on_cpu_us_per_job']:.0f} us "
              f"({row['cpu_increase_pct']:+.1f} %); daemon alone: off "
              f"{row['off_daemon_cpu_us_per_job']:.1f} us, on "
              f"{row['on_daemon_cpu_us_per_job']:.1f} us "
              f"({row['daemon_cpu_increase_pct']:+.1f} %)")
    print(flush=True)


# --- the worker's code path ---------------------------------------------------------------


def worker_path_cpu(counters_of: Callable[[], Counters], repeats: int) -> float:
    """CPU microseconds per job of a worker's counting and settling code (claims of 100,
    outcomes added, batched and written), the lower quartile of ``repeats`` runs."""
    lane = LaneConfig("default", concurrency=10)
    now = datetime.now(UTC)
    lease = now + timedelta(seconds=lane.visibility_timeout)
    batches = [[Job.from_row((100 * b + i, 1, "default", "noop", "{}", 0, now, 1, None, None,
                              now, lease)) for i in range(100)] for b in range(50)]
    runs = []
    for _ in range(repeats):
        counters = counters_of()
        completer = Completer(lane, counters)
        started = time.process_time()
        for claimed in batches:
            counters.count_claimed(claimed)
            for job in claimed:
                completer.add(Outcome(job, None, seconds=0.0001))
            completer.written(completer.batch(), WriteOutcome([j.id for j in claimed], []),
                              FailOutcome())
        runs.append(time.process_time() - started)
    runs.sort()
    return 1e6 * runs[len(runs) // 4] / sum(len(b) for b in batches)


def run_worker_path(repeats: int = 40) -> dict[str, float]:
    off = worker_path_cpu(Counters, repeats)
    on = worker_path_cpu(lambda: Counters(work=WorkObserver(["noop"], 30.0)), repeats)
    print("worker code path, in-process (count claims, add, batch and write outcomes; no "
          "database): CPU per job, lower quartile of 40 runs of 5,000 jobs")
    print(f"  off {off:.2f} us   on {on:.2f} us   metrics add {on - off:.2f} us per job")
    print(flush=True)
    return {"off_us": off, "on_us": on}


# --- sampler -------------------------------------------------------------------------------


def fill_live(conn: psycopg.Connection) -> None:
    """A small live queue over three lanes: due, retrying, claimed, and a DLQ."""
    conn.execute(
        """INSERT INTO jobs (lane, handler, priority, run_at)
           SELECT (%(lanes)s::text[])[1 + i %% 3], 'noop', i %% 3,
                  now() - make_interval(secs => i)
             FROM generate_series(1, 1000) AS i""", {"lanes": LANES})
    conn.execute(
        """INSERT INTO jobs (lane, handler, state, run_at, attempts)
           SELECT (%(lanes)s::text[])[1 + i %% 3], 'noop', 'failed',
                  now() + make_interval(secs => 60 + i), 1
             FROM generate_series(1, 100) AS i""", {"lanes": LANES})
    conn.execute(
        """INSERT INTO jobs (lane, handler, state, run_at, attempts, claimed_by, lease_token,
                             lease_until)
           SELECT (%(lanes)s::text[])[1 + i %% 3], 'noop', 'claimed', now(), 1, 'bench',
                  nextval('lease_token_seq'), now() + interval '1 hour'
             FROM generate_series(1, 100) AS i""", {"lanes": LANES})
    conn.execute(
        """INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,
                                    created_at, errors)
           SELECT -i, (%(lanes)s::text[])[1 + i %% 3], 'noop', '{}', 0, now(), 8, now(), '[]'
             FROM generate_series(1, 1000) AS i""", {"lanes": LANES})


def fill_archive(conn: psycopg.Connection, rows: int) -> None:
    """Finished jobs over the last week, into the archive's daily partitions."""
    conn.execute("SELECT ensure_archive_partitions(1)")
    conn.execute(
        """INSERT INTO jobs_archive (id, lane, handler, payload, state, priority, run_at,
                                     attempts, created_at, errors, finished_at)
           SELECT 1000000000 + i, (%(lanes)s::text[])[1 + i %% 3], 'noop', '{}', 'done', 0,
                  t, 1, t, '[]', t
             FROM generate_series(1, %(rows)s) AS i,
                  LATERAL (SELECT now() - make_interval(secs => i %% 518400) AS t) AS at""",
        {"lanes": LANES, "rows": rows})


def fill_scheduled(conn: psycopg.Connection, rows: int) -> None:
    conn.execute(
        """INSERT INTO jobs (lane, handler, priority, run_at)
           SELECT (%(lanes)s::text[])[1 + i %% 3], 'noop', i %% 3,
                  now() + make_interval(secs => 60 + i %% 86400)
             FROM generate_series(1, %(rows)s) AS i""", {"lanes": LANES, "rows": rows})


def sample_cost(env: Env, title: str, samples: int) -> dict[str, Any]:
    with connect(env.url, "jobd", application_name="jobd supervisor") as conn:
        conn.execute("VACUUM (ANALYZE) jobs")
        conn.execute("VACUUM (ANALYZE) dead_letter")
    # The supervisor's session: timeouts, no JIT.
    with connect(env.url, "jobd", application_name="jobd supervisor",
                 session=supervisor_session(DEFAULT_SESSION)) as conn:
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM jobs_archive), "
            "(SELECT count(*) FROM dead_letter)").fetchone()
        assert counts is not None
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            take_sample(conn, LANES)
            times.append(time.perf_counter() - started)
        buffers = 0
        for name, params in (("metrics_queue_state", {"lanes": LANES, "now": None}),
                             ("metrics_database_hazards", {})):
            row = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query(name)}",
                               params).fetchone()
            assert row is not None
            plan = row[0][0]["Plan"]
            buffers += int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    times.sort()
    median = statistics.median(times)
    result = {"state": title, "live_jobs": counts[0], "archived_jobs": counts[1],
              "dead_jobs": counts[2], "samples": samples,
              "median_ms": 1000 * median, "p95_ms": 1000 * percentile(times, 95),
              "buffers_per_sample": buffers,
              "backend_share_pct": 100 * median / SAMPLE_INTERVAL}
    log(f"sampler, {title}: median {result['median_ms']:.2f} ms, p95 {result['p95_ms']:.2f} ms,"
        f" {buffers} buffers")
    return result


def run_sampler(env: Env, archived: int, scheduled: int, samples: int) -> list[dict[str, Any]]:
    reset_queue(env)
    results = []
    with connect(env.url, "jobd") as conn:
        fill_live(conn)
    results.append(sample_cost(env, "small live queue", samples))
    log(f"sampler: archiving {archived:,} finished jobs")
    with connect(env.url, "jobd") as conn:
        fill_archive(conn, archived)
    results.append(sample_cost(env, f"+ {archived:,} archived", samples))
    log(f"sampler: scheduling {scheduled:,} jobs for later")
    with connect(env.url, "jobd") as conn:
        fill_scheduled(conn, scheduled)
    results.append(sample_cost(env, f"+ {scheduled:,} scheduled", samples))
    return results


def print_sampler(results: list[dict[str, Any]]) -> None:
    print(f"sampler: {len(LANES)} lanes, one sample = both statements in one transaction; "
          f"share of one backend at one sample per {SAMPLE_INTERVAL:g} s")
    print(f"  {'state':<24} {'live':>9} {'archived':>10} {'dead':>6} {'median ms':>10} "
          f"{'p95 ms':>8} {'buffers':>8} {'share':>7}")
    for r in results:
        print(f"  {r['state']:<24} {r['live_jobs']:>9,} {r['archived_jobs']:>10,} "
              f"{r['dead_jobs']:>6,} {r['median_ms']:>10.2f} {r['p95_ms']:>8.2f} "
              f"{r['buffers_per_sample']:>8,} {r['backend_share_pct']:>6.2f}%")
    print(flush=True)


# --- idle ----------------------------------------------------------------------------------


def run_idle(env: Env) -> None:
    off = measure_idle(env)
    on = measure_idle(env, f"127.0.0.1:{free_port()}")
    print("idle node, 2 lanes x 2 workers, 60 s: database transactions/s")
    print(f"  off {off['txn_per_s']:.2f}   on {on['txn_per_s']:.2f} (not scraped)")
    print(flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="The cost of jobd's Prometheus metrics.")
    parser.add_argument("--only", choices=["drain", "worker", "sampler"],
                        help="one part (default: all three)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"drain rounds per setting and mode (default {ROUNDS})")
    parser.add_argument("--settings", type=parse_settings, default=parse_settings(SETTINGS),
                        metavar="WxC,...", help=f"drain settings (default {SETTINGS})")
    parser.add_argument("--archived", type=int, default=ARCHIVED,
                        help=f"finished jobs in the archive (default {ARCHIVED:,})")
    parser.add_argument("--scheduled", type=int, default=SCHEDULED,
                        help=f"jobs scheduled for later (default {SCHEDULED:,})")
    parser.add_argument("--samples", type=int, default=SAMPLES,
                        help=f"samples timed per database state (default {SAMPLES})")
    parser.add_argument("--idle", action="store_true",
                        help="also measure an idle node's transactions with and without")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory")
    args = parser.parse_args(argv)
    if min(args.rounds, args.samples) < 1 or min(args.archived, args.scheduled) < 0:
        parser.error("--rounds and --samples must be at least 1, row counts at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with environment(statements=False, keep=args.keep) as env:
        print(f"metrics cost; PostgreSQL {env.settings['server_version']}, "
              f"synchronous_commit={env.settings['synchronous_commit']}, "
              f"shared_buffers={env.settings['shared_buffers']}", flush=True)
        if args.only in (None, "drain"):
            print_drains(run_drains(env, args.settings, args.rounds))
        if args.only in (None, "worker"):
            run_worker_path()
        if args.only in (None, "sampler"):
            print_sampler(run_sampler(env, args.archived, args.scheduled, args.samples))
        if args.idle:
            run_idle(env)
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

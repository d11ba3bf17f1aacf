"""What an idle fleet costs the database: transactions/s for 1, 4 and 8 daemons on one database.

Usage::

    .venv/bin/python bench/fleet_idle.py [--sizes 1,4,8] [--settle 15] [--window 60]
                                         [--duty-interval 10s] [--metrics] [--backlog N]

A throwaway PostgreSQL cluster (jobd.localpg: a free port, a temp directory) holds one
migrated database. For each fleet size the benchmark starts that many daemons (``python -m
jobd run``), each with its own node name, one lane of one worker and nothing to do, lets them
settle (their start-up burst stays out of the window), then counts ``xact_commit +
xact_rollback`` of that database in ``pg_stat_database`` over the window, sampled from a
connection to *another* database so the sampling is not counted. Autovacuum is off in the
throwaway cluster meanwhile (each of its visits costs transactions that no daemon made). The
fleet is stopped with SIGTERM (exit code 0 required) before the next size starts.

``--metrics`` gives every daemon a metrics endpoint (so each runs the metrics sampler);
``--backlog N`` enqueues N jobs due a day later first, which no daemon runs but every sampler
counts: what that sampling costs a fleet shows in the rows read.

Printed: one line per size with transactions/s in all, per node, and rows read per second
(``tup_returned + tup_fetched``: what the duties scan), then one JSON line per size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import yaml

import jobd
from jobd.db import connect
from jobd.localpg import free_port, throwaway_cluster
from jobd.migrate import migrate
from jobd.yamlcheck import positive_duration

DBNAME = "jobd_fleet_idle"
HANDLERS = "def noop(job):\n    pass\n"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_config(directory: Path, node: str, duty_interval: str, metrics: bool) -> Path:
    path = directory / f"{node}.yaml"
    config: dict[str, Any] = {
        "node": {"name": node},
        "handlers": {"noop": "fleethandlers:noop"},
        "supervisor": {"duty_interval": duty_interval, "shutdown_timeout": "5s"},
        "lanes": {"default": {"workers": 1, "concurrency": 1}},
    }
    if metrics:
        config["metrics"] = {"listen": f"127.0.0.1:{free_port()}"}
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def fleet(directory: Path, url: str, size: int, duty_interval: str,
          metrics: bool) -> Iterator[list[int]]:
    """``size`` daemons running; stopped with SIGTERM on the way out (exit 0 required)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory),
                                                    os.environ.get("PYTHONPATH", "")) if p)
    procs = []
    try:
        for index in range(size):
            config = write_config(directory, f"node-{index + 1}", duty_interval, metrics)
            stderr = open(directory / f"node-{index + 1}.stderr", "ab")  # noqa: SIM115
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jobd", "run", "-c", str(config), "--database-url", url],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                cwd=directory, start_new_session=True))
            stderr.close()
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in procs]
    if any(codes):
        raise RuntimeError(f"a daemon exited with {codes}; logs in {directory}")


def counters(admin: psycopg.Connection) -> tuple[int, int]:
    """(transactions, rows read) of the benchmark database so far."""
    row = admin.execute(
        "SELECT xact_commit + xact_rollback, tup_returned + tup_fetched"
        "  FROM pg_stat_database WHERE datname = %s", (DBNAME,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def live_nodes(url: str) -> int:
    with connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM nodes WHERE seen_at > now() - interval '1 minute'"
                           ).fetchone()
    assert row is not None
    return int(row[0])


def measure(admin_url: str, url: str, directory: Path, size: int, settle: float,
            window: float, duty_interval: str, metrics: bool) -> dict[str, Any]:
    with fleet(directory, url, size, duty_interval, metrics) as pids:
        deadline = time.monotonic() + 60
        while live_nodes(url) < size:
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-5:])
                    for path in sorted(directory.glob("*.stderr")))
                raise RuntimeError(f"only {live_nodes(url)} of {size} nodes came up\n{tails}")
            time.sleep(0.2)
        log(f"{size} node(s) up (pids {pids}); settling {settle:g}s")
        time.sleep(settle)
        with psycopg.connect(admin_url, autocommit=True) as admin:
            # Statistics are flushed by each backend at most every second or so; a snapshot
            # per read keeps the figures fresh.
            admin.execute("SET stats_fetch_consistency = none")
            (tx0, rows0), t0 = counters(admin), time.monotonic()
            log(f"counting for {window:g}s")
            time.sleep(window)
            (tx1, rows1), t1 = counters(admin), time.monotonic()
    seconds = t1 - t0
    result = {"nodes": size, "seconds": round(seconds, 1), "transactions": tx1 - tx0,
              "txn_per_s": round((tx1 - tx0) / seconds, 3),
              "txn_per_s_per_node": round((tx1 - tx0) / seconds / size, 3),
              "rows_read_per_s": round((rows1 - rows0) / seconds, 1),
              "duty_interval": duty_interval, "metrics": metrics}
    log(f"{size} node(s): {result['txn_per_s']:.2f} txn/s, {result['txn_per_s_per_node']:.3f}"
        f" per node, {result['rows_read_per_s']:.0f} rows read/s")
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,8", help="fleet sizes (default 1,4,8)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds (default 15)")
    parser.add_argument("--window", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--duty-interval", default="10s", help="supervisor.duty_interval "
                        "(default 10s, the shipped default)")
    parser.add_argument("--metrics", action="store_true",
                        help="a metrics endpoint on every daemon (default: none)")
    parser.add_argument("--backlog", type=int, default=0,
                        help="jobs due a day later, enqueued first (default 0)")
    args = parser.parse_args(argv)
    # Checked before the cluster starts: a mistake found at the end of a run costs the run.
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: not a list of numbers: {args.sizes!r}")
    if min(args.sizes) < 1 or args.backlog < 0:
        parser.error("--sizes must be at least 1 node, --backlog at least 0 jobs")
    if not (math.isfinite(args.settle) and args.settle >= 0
            and math.isfinite(args.window) and args.window > 0):
        parser.error("--settle must be a number of seconds, --window a positive one")
    try:
        positive_duration(args.duty_interval)
    except ValueError as exc:
        parser.error(f"--duty-interval: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.sizes
    results = []
    with throwaway_cluster("jobd-fleet-pg-") as cluster, \
            tempfile.TemporaryDirectory(prefix="jobd-fleet-") as scratch:
        directory = Path(scratch)
        (directory / "fleethandlers.py").write_text(HANDLERS)
        with psycopg.connect(cluster.url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET autovacuum = off")
            admin.execute("SELECT pg_reload_conf()")
            admin.execute(f"CREATE DATABASE {DBNAME}")
        url = psycopg.conninfo.make_conninfo(cluster.url, dbname=DBNAME)
        with connect(url) as conn:
            migrate(conn, "jobd")
            if args.backlog:
                later = conn.execute("SELECT now() + interval '1 day'").fetchone()
                assert later is not None
                jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, run_at=later[0])
                                         for _ in range(args.backlog)])
                conn.execute("VACUUM ANALYZE jobs")
        for size in sizes:
            result = measure(cluster.url, url, directory, size, args.settle, args.window,
                             args.duty_interval, args.metrics)
            results.append({**result, "backlog": args.backlog})
    print(f"{'nodes':>5}  {'txn/s':>7}  {'per node':>8}  {'rows read/s':>11}")
    for r in results:
        print(f"{r['nodes']:>5}  {r['txn_per_s']:>7.2f}  {r['txn_per_s_per_node']:>8.3f}"
              f"  {r['rows_read_per_s']:>11.0f}")
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

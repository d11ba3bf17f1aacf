"""What one crashed worker costs its lane: a worker killed while it holds running and
claimed-ahead jobs.

Usage (from the repository root)::

    .venv/bin/python -m bench.crash_stall                   # 2 rounds, about 2 minutes
    .venv/bin/python -m bench.crash_stall --rounds 3 --jobs 60

On a throwaway PostgreSQL cluster it runs ``jobd run`` with one lane of 2 workers x
concurrency 8 and ``prefetch: 24``, enqueues ``--jobs`` jobs that sleep 3 s, kills one
worker with SIGKILL one second later, and enqueues one ``echo`` job two seconds after the
kill. It prints how long the lane took to finish every job (from the enqueue), how long the
echo job waited to be claimed (its ``claimed_at - run_at``, by the database clock) and the
attempts the jobs spent. Without the kill the sleeping jobs take about 6 s (2 x 8 slots).

Crash attribution makes the jobs the dead worker was running suspects, each run alone;
with the run board (``jobd/run_board.py``) the jobs it held unstarted go back unharmed,
where before every job it held was a suspect.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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

CONFIG = """\
handlers: {sleep: 'jobd.examples:sleep', echo: 'jobd.examples:echo'}
lanes:
  default: {workers: 2, concurrency: 8, prefetch: 24, visibility_timeout: 60s}
"""


def worker_pid(supervisor: int) -> int:
    """A worker process of ``supervisor``: a child whose title names it (setproctitle)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            title = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == supervisor and b"worker" in title:
            return int(stat.parent.name)
    raise SystemExit("no worker process found")


def wait_for(done: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout:.0f} s")
        time.sleep(0.05)


def one_round(url: str, config: Path, jobs: int) -> tuple[float, float, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE jobd.jobs, jobd.jobs_archive, jobd.job_keys")
        daemon = subprocess.Popen([sys.executable, "-m", "jobd", "--database-url", url, "run",
                                   "-c", str(config)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: conn.execute("SELECT count(*) FROM jobd.lane_waiters")
                     .fetchone() == (2,), "both workers to wait for work")
            conn.execute("SELECT jobd.enqueue('sleep', '{\"seconds\": 3}') "
                         "FROM generate_series(1, %s)", (jobs,))
            started = time.monotonic()
            time.sleep(1)
            os.kill(worker_pid(daemon.pid), signal.SIGKILL)
            time.sleep(2)
            conn.execute("SELECT jobd.enqueue('echo', '{}')")
            wait_for(lambda: conn.execute("SELECT count(*) FROM jobd.jobs").fetchone() == (0,),
                     "every job to finish", timeout=300)
            drained = time.monotonic() - started
            row = conn.execute(
                "SELECT (SELECT extract(epoch FROM claimed_at - run_at) FROM jobd.jobs_archive"
                "         WHERE handler = 'echo'),"
                "       (SELECT sum(attempts) FROM jobd.all_jobs WHERE handler = 'sleep')"
            ).fetchone()
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
    assert row is not None
    return drained, float(row[0]), int(row[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--jobs", type=int, default=30, help="3 s jobs (default 30)")
    args = parser.parse_args(argv)
    if min(args.rounds, args.jobs) < 1:
        parser.error("--rounds and --jobs must be at least 1")
    with throwaway_cluster("jobd-crash-stall-", log=log) as cluster:
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier("crash_stall")))
        url = make_conninfo(cluster.url, dbname="crash_stall")
        with connect(url, "jobd") as conn:
            migrate(conn, "jobd")
        config = cluster.datadir.parent / "jobd.yaml"
        config.write_text(CONFIG)
        for round_no in range(args.rounds):
            drained, echo_wait, attempts = one_round(url, config, args.jobs)
            print(f"round {round_no + 1}: {args.jobs} jobs done {drained:.1f} s after the "
                  f"enqueue; the echo job waited {echo_wait:.1f} s; attempts spent "
                  f"{attempts}", flush=True)


if __name__ == "__main__":
    main()

"""The daemon's drain rate directly and through PgBouncer in transaction mode, side by side.

Usage::

    .venv/bin/python bench/pooler_bench.py [--rounds N] [--jobs N]

A private PostgreSQL cluster (bench/daemon_bench.py's environment: synchronous_commit=on, a
migrated database) and a PgBouncer 1.18+ in front of it (tests/pgbouncer_support.py: pool_mode
transaction, PgBouncer's defaults otherwise). Each round runs every setting, workers x
concurrency 1x10 and 2x10, against three targets:

direct
    the server, ``database.pooler: none``: named prepared statements, settings at connect;
pgbouncer
    PgBouncer, ``database.pooler: transaction``, ``database.listen_url`` direct;
direct-unnamed
    the server with ``pooler: transaction``: unnamed statements and the per-transaction
    settings without the hop through PgBouncer (what the mode itself costs).

The order of the targets rotates per round, so all see the same machine. Each drain starts
its own daemon, waits until its workers have started and its listener holds its LISTEN,
commits ``--jobs`` no-op jobs in one ``jobd.enqueue_many`` (visible at once, one
notification), waits until every job is archived done, and stops the daemon with SIGTERM
(exit 0 required). Jobs/s is the job count over the span from the first claim to the last
finish (``claimed_at``, ``finished_at`` in ``jobd.jobs_archive``: the database clock).

Beside the drains, one exchange of the worker's fast path, timed in this process: an empty
claim (``queue.settle_and_claim`` on an empty lane) and an empty exchange (no statements:
in the pooler's mode, the session settings alone), median over EXCHANGES runs after a
warm-up, per target. Output: progress on stderr, the tables, then one JSON line per drain
and per exchange measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The daemon benchmark's environment is reused, and the tests' PgBouncer starter (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pgbouncer_support import PgBouncer, pgbouncer_binary, running_pgbouncer

import jobd
from bench import daemon_bench as bench
from jobd import db, fastpath, queue

SETTINGS = [(1, 10), (2, 10)]  # workers x concurrency
# direct-unnamed: the server itself with pooler: transaction (what the mode costs without
# the hop through PgBouncer).
TARGETS = ("direct", "pgbouncer", "direct-unnamed")
DEFAULT_ROUNDS = 3
DEFAULT_JOBS = 10_000
EXCHANGES = 500
READY_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 300.0
HANDLER_MODULE = "pooler_bench_handlers"
HANDLER_SOURCE = '"""A handler that does nothing (bench/pooler_bench.py)."""\n\n\n' \
                 "def noop(job):\n    pass\n"


def write_config(env: bench.Env, name: str, workers: int, concurrency: int,
                 pooled: bool) -> Path:
    database = ["database:", f"  schema: {bench.SCHEMA}",
                f"  pooler: {'transaction' if pooled else 'none'}"]
    if pooled:
        database += [f"  listen_url: {json.dumps(env.url)}"]
    lines = [*database, "node:", "  name: bench", "supervisor:", "  shutdown_timeout: 30s",
             "  log_level: info", "handlers:", f"  noop: {HANDLER_MODULE}:noop", "lanes:",
             f"  {bench.LANE}:", f"    workers: {workers}", f"    concurrency: {concurrency}",
             f"    visibility_timeout: {bench.VISIBILITY_TIMEOUT_S:g}s"]
    path = env.config_dir / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Daemon:
    """``jobd run`` in a session of its own; its JSON log lines in a file."""

    def __init__(self, config: Path, url: str, log_path: Path, handler_dir: Path) -> None:
        environ = {k: v for k, v in os.environ.items()
                   if k not in ("JOBD_DATABASE_URL", "JOBD_CONFIG")}
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(handler_dir), environ.get("PYTHONPATH")) if p)
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobd", "run", "-c", str(config), "--database-url", url],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=environ,
                start_new_session=True)

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return found

    def wait_ready(self, workers: int, env: bench.Env) -> None:
        """Until the workers said they started and the listener holds its LISTEN."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        with env.admin() as admin:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n"
                                       f"{self.tail()}")
                started = sum(e.get("event") == "worker started" for e in self.events())
                row = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                    " AND application_name LIKE 'jobd listener%%' AND query LIKE 'LISTEN %%'",
                    (env.dbname,)).fetchone()
                if started >= workers and row is not None and row[0] >= 1:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not get ready:\n{self.tail()}")
                time.sleep(0.05)

    def problems(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("level") in ("warning", "error", "critical")]

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=bench.DAEMON_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"the daemon did not stop on SIGTERM:\n{self.tail()}") from None
        if code != 0:
            raise RuntimeError(f"the daemon exited with {code} after SIGTERM:\n{self.tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def drain(env: bench.Env, bouncer: PgBouncer, target: str, workers: int, concurrency: int,
          jobs: int, round_no: int) -> dict[str, Any]:
    bench.reset_queue(env)
    name = f"{target}-{workers}x{concurrency}"
    config = write_config(env, name, workers, concurrency, target != "direct")
    url = bouncer.url_for(env.url) if target == "pgbouncer" else env.url
    scratch = env.scratch(f"{name}-{round_no}")
    daemon = Daemon(config, url, scratch / "daemon.log", env.handler_dir)
    try:
        daemon.wait_ready(workers, env)
        with env.bench_conn() as conn:
            jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, bench.LANE)
                                     for _ in range(jobs)])
        bench.wait_drained(env, jobs, DRAIN_TIMEOUT_S, interval=0.05)
        problems = daemon.problems()
        daemon.stop()
    except BaseException:
        daemon.kill()
        raise
    with env.bench_conn() as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(finished_at) - min(claimed_at))::float8,"
            "       count(*) FILTER (WHERE state <> 'done'), max(attempts)"
            "  FROM jobd.jobs_archive").fetchone()
    assert row is not None
    seconds, not_done, attempts = row
    if not_done or attempts != 1:
        raise RuntimeError(f"{name}: {not_done} jobs not done, max attempts {attempts}")
    result = {"target": target, "workers": workers, "concurrency": concurrency, "jobs": jobs,
              "round": round_no, "seconds": round(seconds, 3), "jobs_per_s": jobs / seconds,
              "daemon_warnings": len(problems)}
    bench.log(f"{name} round {round_no}: {result['jobs_per_s']:,.0f} jobs/s ({seconds:.2f}s)"
              + (f", {len(problems)} warnings: {problems[:2]}" if problems else ""))
    return result


def exchange_cost(env: bench.Env, bouncer: PgBouncer, target: str) -> dict[str, Any]:
    """Median milliseconds of an empty claim and of an empty exchange on ``target``."""
    bench.reset_queue(env)
    url = bouncer.url_for(env.url) if target == "pgbouncer" else env.url
    session = db.SessionSettings(pooler="none" if target == "direct" else "transaction")
    request = queue.ClaimRequest(bench.LANE, "bench-exchange", 10, 30.0)
    result: dict[str, Any] = {"target": target, "exchanges": EXCHANGES}
    with db.connect(url, bench.SCHEMA, session=session) as conn:
        for name, exchange in (
                ("empty_claim_ms", lambda: queue.settle_and_claim(conn, [], [], request)),
                ("empty_exchange_ms", lambda: fastpath.run(conn, []))):
            for _ in range(20):  # warm-up: prepared statements, caches
                exchange()
            times = []
            for _ in range(EXCHANGES):
                started = time.perf_counter()
                exchange()
                times.append(time.perf_counter() - started)
            result[name] = round(statistics.median(times) * 1000, 3)
    bench.log(f"exchange {target}: empty claim {result['empty_claim_ms']} ms, "
              f"empty exchange {result['empty_exchange_ms']} ms")
    return result


def exchange_table(costs: list[dict[str, Any]]) -> None:
    print(f"{'target':<14} {'empty claim ms':>14} {'empty exchange ms':>18}")
    for target in TARGETS:
        claims = [c["empty_claim_ms"] for c in costs if c["target"] == target]
        empties = [c["empty_exchange_ms"] for c in costs if c["target"] == target]
        print(f"{target:<14} {statistics.median(claims):>14.3f} "
              f"{statistics.median(empties):>18.3f}")


def table(results: list[dict[str, Any]]) -> None:
    print(f"{'setting':<8} {'target':<14} {'median jobs/s':>14}  rounds")
    for workers, concurrency in SETTINGS:
        medians = {}
        for target in TARGETS:
            rates = [r["jobs_per_s"] for r in results if r["target"] == target
                     and (r["workers"], r["concurrency"]) == (workers, concurrency)]
            medians[target] = statistics.median(rates)
            print(f"{workers}x{concurrency:<6} {target:<14} {medians[target]:>14,.0f}  "
                  + ", ".join(f"{rate:,.0f}" for rate in rates))
        for target in TARGETS[1:]:
            print(f"{'':<8} {'ratio':<14} {medians[target] / medians['direct']:>14.2f}"
                  f"  ({target} / direct)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS)
    args = parser.parse_args()
    if min(args.rounds, args.jobs) < 1:
        parser.error("--rounds and --jobs must be at least 1")
    if pgbouncer_binary() is None:
        print("pooler_bench: needs pgbouncer (Debian package pgbouncer)", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    with bench.environment(statements=False, keep=False) as env:
        (env.handler_dir / f"{HANDLER_MODULE}.py").write_text(HANDLER_SOURCE)
        with running_pgbouncer(env.admin_url) as bouncer:
            version = subprocess.run([pgbouncer_binary() or "pgbouncer", "--version"],
                                     capture_output=True, text=True).stdout.splitlines()[0]
            bench.log(f"{version} on port {bouncer.port}; server {env.settings['server_version']}")
            for round_no in range(1, args.rounds + 1):
                for workers, concurrency in SETTINGS:
                    # Rotate which target goes first, so none always follows another.
                    shift = (round_no - 1) % len(TARGETS)
                    for target in TARGETS[shift:] + TARGETS[:shift]:
                        results.append(drain(env, bouncer, target, workers, concurrency,
                                             args.jobs, round_no))
                costs += [exchange_cost(env, bouncer, target) for target in TARGETS]
    table(results)
    print()
    exchange_table(costs)
    for result in results + costs:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""jobd next to its peers, the SQL ceiling, and how jobd's cost grows with its history.

Usage (from the repository root, in jobd's venv)::

    python -m bench                          # everything, about 15 minutes
    python -m bench --only drain,latency     # some workloads: enqueue/drain, latency, idle, growth
    python -m bench --only drain --settings 1x10 --rounds 1   # a quick look at one setting
    python -m bench --rounds 5 --systems jobd,pgqueuer
    python -m bench --growth-sizes 10000,1000000     # skip the 10M step

The drain runs every system at each in-flight setting of ``--settings`` (W worker processes x
C jobs in flight per process; default 1x10, 2x10, 4x100), next to a pgbench ceiling that
claims and completes in batches of W x C; bench/settings.py says which knob of each system
W and C become.

One throwaway PostgreSQL cluster (jobd.localpg, a free port, synchronous_commit=on) holds one
database per system. Systems run in turn, their order rotated every round, and each round of
each workload prints one JSON line per system. At the end: a Markdown table, a chart, and
bench/results/<date>.json / .md / .png. bench/README_suite.md describes every measurement and
every peer setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jobd
from bench.daemon_bench import descendants, rss_kb
from bench.peers.install import Peers, install
from bench.result_files import free_stem
from bench.settings import DEFAULT_SETTINGS, KNOBS, Setting, parse_settings
from jobd.archive import drop_before
from jobd.db import connect
from jobd.localpg import find_bindir, throwaway_cluster
from jobd.migrate import migrate
from jobd.queue import claim, complete

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / "peers"
RESULTS_DIR = HERE / "results"

ALL_SYSTEMS = ["jobd", "procrastinate", "pgqueuer", "graphile", "pgboss"]
WORKLOADS = ["drain", "latency", "idle", "growth"]
LABELS = {"jobd": "jobd", "procrastinate": "Procrastinate", "pgqueuer": "PgQueuer",
          "graphile": "Graphile Worker", "pgboss": "pg-boss"}

# Latency, idle and growth run at one setting each unless told otherwise (--latency-settings,
# --idle-settings); the growth drain always at GROWTH_SETTING.
LATENCY_SETTINGS = "4x100"
IDLE_SETTINGS = "4x100"
GROWTH_SETTING = Setting(4, 100)
DRAIN_JOBS = 20_000
DRAIN_CAP_S = 15.0  # a drain still running after this is stopped; the rate covers what finished
LATENCY_RATE = 200
LATENCY_SECONDS = 20.0
IDLE_SETTLE_S = 15.0
IDLE_WINDOW_S = 60.0
# The ceiling claims and completes this many jobs (pre-filled): at ~90k jobs/s the drain's
# 20,000 would be over in 0.2 s, too short to time well.
CEILING_JOBS = 60_000
CEILING_MIN_TRANSACTIONS = 10  # per pgbench client, however large the batch
GROWTH_SIZES = (10_000, 1_000_000, 10_000_000)
GROWTH_DAYS = 20  # history spread over this many past days, one archive partition each
GROWTH_FUTURE_SHARE = 0.01  # of each size: pending jobs scheduled in the future
GROWTH_CLAIMS = 2_000
SETTLE_S = 1.5
READY_TIMEOUT_S = 60.0

TARGETS = {
    "drain_vs_best_peer": 2.0, "drain_vs_ceiling": 0.50, "latency_p50_ms": 2.0,
    "latency_p99_ms": 5.0, "idle_txn_per_s_per_node": 1.0, "growth_claim_p99_ratio": 1.5,
    "rss_mb": 300.0,
}

SERVER_SETTINGS = [
    "server_version", "synchronous_commit", "fsync", "wal_sync_method", "full_page_writes",
    "wal_level", "shared_buffers", "max_connections", "max_wal_size", "checkpoint_timeout",
    "autovacuum", "work_mem",
]

# The ceiling: the least SQL that does a queue's work on jobd's own tables. Claim a batch of
# due jobs with FOR UPDATE SKIP LOCKED, then mark them done by moving them to the archive;
# two transactions per batch, as a worker has (bench/sql/, shared by the benchmarks).
_CEILING_SQL = Path(__file__).resolve().parent / "sql"
PGBENCH_SCRIPT = ((_CEILING_SQL / "ceiling_claim.sql").read_text()
                  + (_CEILING_SQL / "ceiling_done_archive.sql").read_text())


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(record: dict[str, Any]) -> None:
    """One JSON line per system and round, on stdout."""
    print(json.dumps(record, default=str), flush=True)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered), max(1, math.ceil(p / 100 * len(ordered)))) - 1]


# --- the systems ----------------------------------------------------------------------------


@dataclass
class System:
    name: str
    url: str
    reset_sql: list[str]
    remaining_sql: str  # jobs not finished yet
    finished_sql: str  # (count, epoch of the last completion), from the system's own tables
    setup_sql: list[str] = field(default_factory=list)  # after install (measurement only)


SYSTEM_SQL: dict[str, dict[str, Any]] = {
    "jobd": {
        "reset_sql": ["TRUNCATE jobd.jobs, jobd.jobs_archive, jobd.dead_letter, jobd.nodes, "
                      "jobd.job_keys"],
        "remaining_sql": "SELECT count(*) FROM jobd.jobs",
        "finished_sql": "SELECT count(*), extract(epoch FROM max(finished_at))::float8 "
                        "FROM jobd.jobs_archive",
    },
    "procrastinate": {
        "reset_sql": ["TRUNCATE procrastinate_jobs CASCADE"],
        "remaining_sql": "SELECT count(*) FROM procrastinate_jobs "
                         "WHERE status IN ('todo', 'doing')",
        "finished_sql": "SELECT count(*), extract(epoch FROM max(at))::float8 "
                        "FROM procrastinate_events WHERE type = 'succeeded'",
    },
    "pgqueuer": {
        "reset_sql": ["TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics"],
        "remaining_sql": "SELECT count(*) FROM pgqueuer",
        "finished_sql": "SELECT count(*), extract(epoch FROM max(created))::float8 "
                        "FROM pgqueuer_log WHERE status = 'successful'",
    },
    "graphile": {
        # Graphile Worker deletes a finished job and keeps no record of when; a statement-level
        # trigger (one row per completion batch, in an unlogged table) notes the time.
        "setup_sql": [
            "CREATE UNLOGGED TABLE IF NOT EXISTS public.bench_done (at timestamptz, n bigint)",
            "CREATE OR REPLACE FUNCTION public.bench_mark_done() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO public.bench_done "
            "SELECT clock_timestamp(), count(*) FROM gone; RETURN NULL; END $$",
            "DROP TRIGGER IF EXISTS bench_done ON graphile_worker._private_jobs",
            "CREATE TRIGGER bench_done AFTER DELETE ON graphile_worker._private_jobs "
            "REFERENCING OLD TABLE AS gone FOR EACH STATEMENT "
            "EXECUTE FUNCTION public.bench_mark_done()",
        ],
        "reset_sql": ["TRUNCATE graphile_worker._private_jobs, public.bench_done"],
        "remaining_sql": "SELECT count(*) FROM graphile_worker._private_jobs",
        "finished_sql": "SELECT coalesce(sum(n), 0)::bigint, extract(epoch FROM max(at))::float8 "
                        "FROM public.bench_done",
    },
    "pgboss": {
        "reset_sql": ["TRUNCATE pgboss.job"],
        "remaining_sql": "SELECT count(*) FROM pgboss.job "
                         "WHERE state IN ('created', 'retry', 'active')",
        "finished_sql": "SELECT count(*), extract(epoch FROM max(completed_on))::float8 "
                        "FROM pgboss.job WHERE state = 'completed'",
    },
}


@dataclass
class Env:
    root: Path
    admin_url: str
    urls: dict[str, str]
    systems: list[str]
    peers: Peers
    pgbench: Path
    postmaster_pid: int = 0
    settings: dict[str, str] = field(default_factory=dict)
    counter: int = 0

    def scratch(self, name: str) -> Path:
        self.counter += 1
        path = self.root / f"{self.counter:03d}-{name}"
        path.mkdir()
        path.chmod(0o777)
        return path

    def sql(self, system: str, statement: str, params: Any = None) -> list[tuple]:
        with psycopg.connect(self.urls[system], autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else []


def command_for(env: Env, system: str, action: str, *args: str) -> list[str]:
    url = env.urls[system]
    if system == "jobd":
        return [sys.executable, str(PEERS_DIR / "jobd_peer.py"), action, url, *args]
    if system in ("procrastinate", "pgqueuer"):
        assert env.peers.python is not None
        return [str(env.peers.python), str(PEERS_DIR / "py_peer.py"), system, action, url, *args]
    assert env.peers.node is not None and env.peers.node_dir is not None
    return [str(env.peers.node), str(env.peers.node_dir / "node_peer.mjs"), system, action,
            url, *args]


def run_json(command: list[str], timeout: float = 300) -> dict[str, Any]:
    """Run a peer command and return the last JSON line it printed."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed ({result.returncode}):\n"
                           f"{result.stderr[-2000:]}")
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def reset(env: Env, system: str) -> None:
    with psycopg.connect(env.urls[system], autocommit=True) as conn:
        for statement in SYSTEM_SQL[system]["reset_sql"]:
            conn.execute(statement)
        # No ANALYZE here: statistics taken of an empty table mislead the planner once the
        # backlog arrives (Procrastinate's fetch then scans for seconds per job); TRUNCATE
        # leaves fresh files and no statistics, as a new installation has.
        conn.execute("CHECKPOINT")


# --- worker fleets --------------------------------------------------------------------------


class Fleet:
    """A system's workers at one setting (W x C): jobd's daemon (a supervisor and W workers of
    concurrency C) or W peer worker processes with C jobs in flight each, every process in its
    own session so it can be stopped whole."""

    def __init__(self, env: Env, system: str, stamps: Path, setting: Setting):
        self.env, self.system, self.stamps, self.setting = env, system, stamps, setting
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def __enter__(self) -> Fleet:
        environ = dict(os.environ, PYTHONPATH=f"{PEERS_DIR}{os.pathsep}{HERE.parent}",
                       JOBD_BENCH_STAMPS=str(self.stamps))
        environ.pop("JOBD_DATABASE_URL", None)
        if self.system == "jobd":
            config = self.stamps / "jobd.yaml"
            config.write_text(jobd_config(self.setting.workers, self.setting.concurrency))
            commands = [[sys.executable, "-m", "jobd", "run", "-c", str(config),
                         "--database-url", self.env.urls["jobd"]]]
        else:
            commands = [command_for(self.env, self.system, "worker", str(self.stamps),
                                    str(self.setting.concurrency))
                        for _ in range(self.setting.workers)]
        for n, command in enumerate(commands):
            log_path = self.stamps / f"worker-{n}.log"
            with open(log_path, "wb") as out:
                self.procs.append(subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=environ,
                    start_new_session=True))
            self.logs.append(log_path)
        try:
            self.wait_ready()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.stop(check=exc_type is None)

    def tail(self) -> str:
        return "\n".join(path.read_text(errors="replace")[-1500:] for path in self.logs[:2])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.system} worker exited with {proc.returncode} "
                                       f"while starting:\n{self.tail()}")
            if self.system == "jobd":
                rows = self.env.sql("jobd", (
                    "SELECT count(*) FILTER (WHERE application_name LIKE 'jobd worker %%'), "
                    "count(*) FILTER (WHERE application_name LIKE 'jobd supervisor%%' "
                    "OR application_name LIKE 'jobd listener%%') FROM pg_stat_activity "
                    "WHERE datname = current_database() AND state = 'idle'"))
                ready = rows[0][0] >= self.setting.workers and rows[0][1] >= 2
            else:
                ready = all("ready" in path.read_text(errors="replace") for path in self.logs)
            if ready:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.system} workers not ready in {READY_TIMEOUT_S:g}s:\n"
                                   f"{self.tail()}")
            time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        return [pid for proc in self.procs for pid in descendants(proc.pid)]

    def stop(self, check: bool = True) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        problems = []
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                problems.append("did not stop within 30 s of SIGTERM")
        if check and problems:
            raise RuntimeError(f"{self.system}: {problems[0]}:\n{self.tail()}")


def jobd_knobs(setting: Setting) -> dict[str, Any]:
    """The lane jobd_config writes for a setting (the results record it beside the peers')."""
    return {"lanes.default.workers": setting.workers,
            "lanes.default.concurrency": setting.concurrency,
            "lanes.default.visibility_timeout": "30s", "archive.retention": "90d"}


def jobd_config(workers: int, concurrency: int) -> str:
    return "\n".join([
        "database:", "  schema: jobd",
        "node:", "  name: bench",
        "supervisor:", "  log_level: warning",
        # Longer than the growth workload's history, which the daemon must not drop itself.
        "archive:", "  retention: 90d",
        "handlers:", "  noop: jobd_handlers:noop",
        "lanes:", "  default:", f"    workers: {workers}", f"    concurrency: {concurrency}",
        "    visibility_timeout: 30s", "",
    ])


class RssSampler(threading.Thread):
    """Peak summed VmRSS of a set of process trees, every 50 ms."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.peak_kb, self.halt = roots, 0, threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            pids = [pid for root in self.roots for pid in descendants(root)]
            self.peak_kb = max(self.peak_kb, sum(rss_kb(pid) for pid in pids))
            self.halt.wait(0.05)

    def finish(self) -> float:
        self.halt.set()
        self.join()
        return self.peak_kb / 1024.0


def read_stamps(directory: Path) -> tuple[dict[int, float], list[float]]:
    starts: dict[int, float] = {}
    firsts: list[float] = []
    for path in directory.glob("starts-*.txt"):
        for line in path.read_text().splitlines():
            key, value = line.split()
            if key == "first":
                firsts.append(float(value))
            else:
                starts[int(key)] = min(float(value), starts.get(int(key), math.inf))
    return starts, firsts


def wait_until_empty(env: Env, system: str, cap: float) -> bool:
    deadline = time.monotonic() + cap
    with psycopg.connect(env.urls[system], autocommit=True) as conn:
        while True:
            row = conn.execute(SYSTEM_SQL[system]["remaining_sql"]).fetchone()
            if row is not None and row[0] == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


# --- workloads 1 and 2: bulk enqueue, then drain --------------------------------------------


def measure_drain(env: Env, system: str, setting: Setting, round_no: int,
                  jobs: int = DRAIN_JOBS) -> list[dict]:
    """Workers up and idle at ``setting``; jobs enqueued in one bulk call (timed: workload 1);
    then the drain from the first handler start to the last completion recorded in the
    database."""
    reset(env, system)
    stamps = env.scratch(f"drain-{setting.label}-{system}-{round_no}")
    with Fleet(env, system, stamps, setting) as fleet:
        time.sleep(SETTLE_S)
        sampler = RssSampler([proc.pid for proc in fleet.procs])
        sampler.start()
        enq = run_json(command_for(env, system, "enqueue", str(jobs)))
        complete_run = wait_until_empty(env, system, DRAIN_CAP_S)
        peak_mb = sampler.finish()
    ((done, last),) = env.sql(system, SYSTEM_SQL[system]["finished_sql"])
    done = int(done)
    _, firsts = read_stamps(stamps)
    result: dict[str, Any] = {
        "workload": "enqueue", "system": system, "setting": setting.label, "round": round_no,
        "jobs": jobs, "seconds": round(enq["seconds"], 4), "jobs_per_s": jobs / enq["seconds"]}
    emit(result)
    if not firsts or not done:
        raise RuntimeError(f"{system}: no job finished in the drain:\n{fleet.tail()}")
    seconds = last - min(firsts)
    drain = {"workload": "drain", "system": system, "setting": setting.label, "round": round_no,
             "jobs": int(done), "complete": complete_run, "seconds": round(seconds, 3),
             "jobs_per_s": done / seconds, "peak_rss_mb": round(peak_mb, 1),
             "processes": setting.workers, "concurrency": setting.concurrency}
    emit(drain)
    log(f"{setting.label:>6s} {system:14s} round {round_no}: enqueue "
        f"{result['jobs_per_s']:,.0f}/s, drain "
        f"{drain['jobs_per_s']:,.0f}/s ({int(done)} jobs{'' if complete_run else ', capped'}), "
        f"peak RSS {peak_mb:.0f} MB")
    return [result, drain]


_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")


def ceiling_clients(setting: Setting, how: str) -> int:
    """pgbench clients of the ceiling at a setting: ``one`` (one batch of W x C in flight, the
    setting's total) or ``workers`` (W clients, each with batches of W x C)."""
    return 1 if how == "one" else setting.workers


def measure_ceiling(env: Env, setting: Setting, round_no: int, clients: int) -> dict:
    """pgbench claiming and completing batches of the setting's total in flight (W x C) on
    jobd's tables; jobs / pgbench's own duration."""
    reset(env, "jobd")
    batch = setting.in_flight
    per_client = max(CEILING_MIN_TRANSACTIONS, CEILING_JOBS // (batch * clients))
    total = per_client * clients * batch
    with connect(env.urls["jobd"], "jobd") as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}) for _ in
                                 range(total + batch * clients)])
        conn.execute("VACUUM ANALYZE jobd.jobs")
    script = env.root / "ceiling.sql"
    script.write_text(PGBENCH_SCRIPT)
    command = [str(env.pgbench), "--no-vacuum", "--protocol=prepared", f"--file={script}",
               f"--client={clients}", f"--jobs={min(clients, os.cpu_count() or 1)}",
               f"--transactions={per_client}", f"--define=batch={batch}", env.urls["jobd"]]
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, PGOPTIONS="-c synchronous_commit=on"))
    output = done.stdout + done.stderr
    processed, tps = _PROCESSED.search(output), _TPS.search(output)
    if done.returncode != 0 or not processed or not tps:
        raise RuntimeError(f"pgbench failed ({done.returncode}):\n{output[-2000:]}")
    seconds = int(processed[1]) / float(tps[1])
    record = {"workload": "drain", "system": "sql-ceiling", "setting": setting.label,
              "round": round_no, "jobs": total, "clients": clients, "batch": batch,
              "seconds": round(seconds, 3), "jobs_per_s": total / seconds}
    emit(record)
    log(f"{setting.label:>6s} SQL ceiling    round {round_no}: batch {batch}, {clients} "
        f"client(s): {record['jobs_per_s']:,.0f} jobs/s")
    return record


# --- workload 3: latency --------------------------------------------------------------------


def measure_latency(env: Env, system: str, setting: Setting, round_no: int) -> dict:
    reset(env, system)
    stamps = env.scratch(f"latency-{setting.label}-{system}-{round_no}")
    offered = stamps / "enqueued.txt"
    total = int(LATENCY_RATE * LATENCY_SECONDS)
    with Fleet(env, system, stamps, setting):
        time.sleep(SETTLE_S)
        info = run_json(command_for(env, system, "steady", str(LATENCY_RATE),
                                    str(LATENCY_SECONDS), str(offered)),
                        timeout=LATENCY_SECONDS * 4 + 60)
        wait_until_empty(env, system, 30.0)
        time.sleep(0.2)
    starts, _ = read_stamps(stamps)
    sent = {int(i): float(t) for i, t in
            (line.split() for line in offered.read_text().splitlines())}
    latencies = [(starts[i] - sent[i]) * 1000.0 for i in sent if i in starts]
    record = {"workload": "latency", "system": system, "setting": setting.label,
              "round": round_no, "jobs": total,
              "started": len(latencies), "offered_per_s": round(info.get("offered_per_s", 0), 1),
              "enqueuer_worst_lag_ms": round(info.get("worst_lag_ms", 0), 2),
              "p50_ms": percentile(latencies, 50), "p95_ms": percentile(latencies, 95),
              "p99_ms": percentile(latencies, 99),
              "max_ms": max(latencies) if latencies else math.nan}
    emit(record)
    log(f"{setting.label:>6s} {system:14s} round {round_no}: latency p50 "
        f"{record['p50_ms']:.2f} ms, p99 "
        f"{record['p99_ms']:.2f} ms ({len(latencies)}/{total} started)")
    return record


# --- workload 4: idle -----------------------------------------------------------------------


def measure_idle(env: Env, systems: list[str], setting: Setting) -> list[dict]:
    """Every system's fleet idles at once, each in its own database; transactions per
    second per database over one window, read from pg_stat_database by a connection to the
    postgres database (not counted), autovacuum paused."""
    for system in systems:
        reset(env, system)
    with psycopg.connect(env.admin_url, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET autovacuum = off")
        admin.execute("SELECT pg_reload_conf()")
    try:
        fleets = [Fleet(env, s, env.scratch(f"idle-{setting.label}-{s}"), setting)
                  for s in systems]
        with contextmanager_stack(fleets):
            log(f"idle {setting.label}: {len(systems)} fleets up; settling "
                f"{IDLE_SETTLE_S:g}s, then {IDLE_WINDOW_S:g}s window")
            time.sleep(IDLE_SETTLE_S)
            with psycopg.connect(env.admin_url, autocommit=True) as admin:
                query = ("SELECT datname, xact_commit + xact_rollback FROM pg_stat_database "
                         "WHERE datname = ANY(%s)")
                names = [f"bench_{s}" for s in systems]
                before, t0 = dict(admin.execute(query, (names,)).fetchall()), time.monotonic()
                time.sleep(IDLE_WINDOW_S)
                after, t1 = dict(admin.execute(query, (names,)).fetchall()), time.monotonic()
    finally:
        with psycopg.connect(env.admin_url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM RESET autovacuum")
            admin.execute("SELECT pg_reload_conf()")
    records = []
    for system in systems:
        name = f"bench_{system}"
        rate = (after[name] - before[name]) / (t1 - t0)
        # jobd's fleet is one node (a supervisor and its W workers); every peer process is one.
        nodes = 1 if system == "jobd" else setting.workers
        record = {"workload": "idle", "system": system, "setting": setting.label, "round": 1,
                  "transactions": after[name] - before[name], "seconds": round(t1 - t0, 2),
                  "txn_per_s": rate, "processes": setting.workers, "nodes": nodes,
                  "txn_per_s_per_node": rate / nodes}
        emit(record)
        log(f"idle {setting.label:>6s} {system:14s}: {rate:.2f} txn/s")
        records.append(record)
    return records


@contextmanager
def contextmanager_stack(fleets: list[Fleet]) -> Iterator[None]:
    entered: list[Fleet] = []
    try:
        for fleet in fleets:
            entered.append(fleet.__enter__())
        yield
    finally:
        for fleet in reversed(entered):
            fleet.stop(check=False)


# --- workload 5: growth (jobd) --------------------------------------------------------------

HISTORY_SQL = """
INSERT INTO jobd.jobs_archive (id, lane, handler, payload, state, priority, run_at, attempts,
                               max_attempts, claimed_by, idempotency_key, created_at,
                               last_error, errors, finished_at)
SELECT nextval('jobd.job_id_seq'), 'default', 'noop', '{}'::jsonb, 'done', 0, t, 1, NULL,
       'history', NULL, t, NULL, '[]'::jsonb, t + interval '50 milliseconds'
  FROM (SELECT %(day)s::timestamptz + (g * (86400.0 / %(n)s) || ' seconds')::interval AS t
          FROM generate_series(0, %(n)s - 1) AS g) AS s
"""
FUTURE_SQL = """
INSERT INTO jobd.jobs (lane, handler, payload, run_at)
SELECT 'default', 'noop', '{}'::jsonb, now() + interval '1 day' + (g || ' seconds')::interval
  FROM generate_series(1, %(n)s) AS g
"""


def history_days() -> list[datetime]:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return [today - timedelta(days=d) for d in range(GROWTH_DAYS + 1, 1, -1)]


def grow(env: Env, rows: int) -> float:
    """Add ``rows`` rows: history spread over GROWTH_DAYS past daily partitions, plus a share
    of future-scheduled pending jobs. All in SQL. Returns seconds."""
    t0 = time.perf_counter()
    future = int(rows * GROWTH_FUTURE_SHARE)
    history = rows - future
    with connect(env.urls["jobd"], "jobd") as conn:
        for day in history_days():
            part = f"jobs_archive_{day:%Y%m%d}"
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS jobd.{part} PARTITION OF jobd.jobs_archive "
                f"FOR VALUES FROM ('{day.isoformat()}') TO "
                f"('{(day + timedelta(days=1)).isoformat()}')")
            conn.execute(HISTORY_SQL, {"day": day, "n": history // GROWTH_DAYS})
        conn.execute(FUTURE_SQL, {"n": future})
        conn.execute("VACUUM ANALYZE jobd.jobs")
        conn.execute("VACUUM ANALYZE jobd.jobs_archive")
        conn.execute("CHECKPOINT")
    return time.perf_counter() - t0


def claim_latencies(env: Env, claims: int) -> list[float]:
    """Claim one due job at a time (jobd.queue.claim), complete it in the same transaction;
    the claim statement's time in ms."""
    with connect(env.urls["jobd"], "jobd") as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}) for _ in range(claims)])
        conn.execute("VACUUM ANALYZE jobd.jobs")
        times = []
        for _ in range(claims):
            # Inside a transaction, so the time is the claim statement's own and not the
            # commit's WAL flush (a constant of the disk, paid once for claim and completion).
            with conn.transaction():
                t0 = time.perf_counter()
                got = claim(conn, "default", "bench-claimer", 1, 30.0)
                times.append((time.perf_counter() - t0) * 1000.0)
                complete(conn, [job.lease for job in got])
    return times


def measure_growth(env: Env, sizes: Sequence[int], rounds: int) -> list[dict]:
    records = []
    reset(env, "jobd")
    have = 0
    for size in sizes:
        log(f"growth: filling to {size:,} rows")
        fill_s = grow(env, size - have)
        have = size
        ((archived, pending),) = env.sql("jobd", (
            "SELECT (SELECT count(*) FROM jobd.jobs_archive), (SELECT count(*) FROM jobd.jobs)"))
        size_db = env.sql("jobd", "SELECT pg_database_size(current_database())")[0][0]
        claims = claim_latencies(env, GROWTH_CLAIMS)
        drains = []
        for round_no in range(1, rounds + 1):
            drains.append(measure_growth_drain(env, size, round_no))
        # Retention: drop the oldest day of history.
        oldest = history_days()[0]
        with connect(env.urls["jobd"], "jobd") as conn:
            rows_day = conn.execute(
                f"SELECT count(*) FROM jobd.jobs_archive_{oldest:%Y%m%d}").fetchone()[0] \
                if conn.execute("SELECT to_regclass(%s)",
                                (f"jobd.jobs_archive_{oldest:%Y%m%d}",)).fetchone()[0] else 0
            t0 = time.perf_counter()
            dropped = drop_before(conn, oldest + timedelta(days=1))
            drop_ms = (time.perf_counter() - t0) * 1000.0
            # Put the day back so every size keeps GROWTH_DAYS days of history.
            conn.execute(
                f"CREATE TABLE jobd.jobs_archive_{oldest:%Y%m%d} PARTITION OF jobd.jobs_archive "
                f"FOR VALUES FROM ('{oldest.isoformat()}') TO "
                f"('{(oldest + timedelta(days=1)).isoformat()}')")
            if rows_day:
                conn.execute(HISTORY_SQL, {"day": oldest, "n": rows_day})
        record = {"workload": "growth", "system": "jobd", "round": 1, "rows": size,
                  "archived_rows": archived, "pending_rows": pending,
                  "database_mb": round(size_db / 2**20), "fill_seconds": round(fill_s, 1),
                  "claim_p50_ms": percentile(claims, 50), "claim_p99_ms": percentile(claims, 99),
                  "claims": len(claims),
                  "drain_jobs_per_s": statistics.median(d["jobs_per_s"] for d in drains),
                  "drain_rounds": [round(d["jobs_per_s"]) for d in drains],
                  "retention_drop_ms": drop_ms, "retention_partitions": dropped,
                  "retention_rows": rows_day}
        emit(record)
        log(f"growth {size:>10,}: claim p50 {record['claim_p50_ms']:.2f} ms p99 "
            f"{record['claim_p99_ms']:.2f} ms; drain {record['drain_jobs_per_s']:,.0f}/s; "
            f"drop a day ({rows_day:,} rows) {drop_ms:.0f} ms; fill {fill_s:.0f}s")
        records.append(record)
    return records


def measure_growth_drain(env: Env, size: int, round_no: int) -> dict:
    """The drain of measure_drain, on top of the history (only the queue is emptied)."""
    with connect(env.urls["jobd"], "jobd") as conn:
        conn.execute("DELETE FROM jobd.jobs WHERE run_at <= now()")
        conn.execute("VACUUM ANALYZE jobd.jobs")
        conn.execute("CHECKPOINT")
        before = conn.execute("SELECT coalesce(max(id), 0) FROM jobd.jobs_archive "
                              "WHERE claimed_by <> 'history'").fetchone()[0]
    stamps = env.scratch(f"growth-{size}-{round_no}")
    with Fleet(env, "jobd", stamps, GROWTH_SETTING):
        time.sleep(SETTLE_S)
        run_json(command_for(env, "jobd", "enqueue", str(DRAIN_JOBS)))
        deadline = time.monotonic() + DRAIN_CAP_S * 2
        while env.sql("jobd", "SELECT count(*) FROM jobd.jobs WHERE run_at <= now()")[0][0]:
            if time.monotonic() > deadline:
                raise RuntimeError("growth drain did not finish")
            time.sleep(0.05)
    ((done, last),) = env.sql("jobd", (
        "SELECT count(*), extract(epoch FROM max(finished_at))::float8 FROM jobd.jobs_archive "
        "WHERE claimed_by <> 'history' AND id > %s"), (before,))
    _, firsts = read_stamps(stamps)
    seconds = last - min(firsts)
    return {"jobs": done, "seconds": seconds, "jobs_per_s": done / seconds}


# --- the run --------------------------------------------------------------------------------


@contextmanager
def environment(systems: list[str], peers: Peers, keep: bool) -> Iterator[Env]:
    with throwaway_cluster("jobd-suite-", keep=keep, log=log) as cluster:
        log(f"started a private cluster in {cluster.datadir} on port {cluster.port}")
        root = cluster.datadir.parent
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            conn.execute("SELECT pg_reload_conf()")
        admin_url = make_conninfo(cluster.url, options="-c synchronous_commit=on")
        urls = {}
        for system in systems:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE bench_{system}")
            # The server's own setting (ALTER SYSTEM above) applies to every client.
            urls[system] = f"postgresql://postgres@127.0.0.1:{cluster.port}/bench_{system}"
        env = Env(root, admin_url, urls, systems, peers, find_bindir() / "pgbench")
        env.postmaster_pid = int((cluster.datadir / "postmaster.pid").read_text().split()[0])
        with connect(urls["jobd"], "jobd") as conn:
            migrate(conn, "jobd")
        for system in systems:
            if system == "jobd":
                continue
            run_json(command_for(env, system, "install"), timeout=120)
            for statement in SYSTEM_SQL[system].get("setup_sql", []):
                env.sql(system, statement)
        with psycopg.connect(urls["jobd"]) as conn:
            env.settings = dict(conn.execute(
                "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name",
                (SERVER_SETTINGS,)).fetchall())
        if env.settings["synchronous_commit"] != "on":
            raise SystemExit(f"synchronous_commit is {env.settings['synchronous_commit']}")
        yield env


def rotated(items: list[str], round_no: int) -> list[str]:
    k = (round_no - 1) % len(items)
    return items[k:] + items[:k]


def hardware() -> dict[str, Any]:
    cpu = "unknown"
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with suppress(OSError, ValueError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version()}


def source_revision() -> str:
    with suppress(Exception):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jobd"], cwd=HERE.parent,
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (jobd/ modified)" if dirty else "")
    return "unknown"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help="comma-separated: drain (includes enqueue), latency, idle, growth")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                        help=f"comma-separated, of {','.join(ALL_SYSTEMS)} (default: all; jobd "
                             "always runs: the ceiling and growth use its tables)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help="drain settings, comma-separated W x C: W worker processes x C "
                             f"jobs in flight per process (default {DEFAULT_SETTINGS})")
    parser.add_argument("--latency-settings", default=LATENCY_SETTINGS,
                        help=f"settings the latency workload runs at (default {LATENCY_SETTINGS})")
    parser.add_argument("--idle-settings", default=IDLE_SETTINGS,
                        help=f"settings the idle workload runs at (default {IDLE_SETTINGS})")
    parser.add_argument("--ceiling-clients", choices=["one", "workers"], default="one",
                        help="pgbench clients of each setting's ceiling, which claims and "
                             "completes batches of W x C: one (the default: W x C in flight, "
                             "the setting's total) or workers (W clients)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="drain rounds at every setting (default 3)")
    parser.add_argument("--latency-rounds", type=int, default=3)
    parser.add_argument("--growth-sizes", default=",".join(str(s) for s in GROWTH_SIZES))
    parser.add_argument("--growth-rounds", type=int, default=3,
                        help="drain rounds at each growth size (one drain spreads widely)")
    parser.add_argument("--upgrade-peers", action="store_true",
                        help="reinstall the peers at their latest releases")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, cluster)")
    parser.add_argument("--no-save", action="store_true", help="do not write the results")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="directory of the results files (default bench/results)")
    args = parser.parse_args(argv)
    for option, given, known in (("--only", args.only, WORKLOADS),
                                 ("--systems", args.systems, ALL_SYSTEMS)):
        unknown = [name for name in given.split(",") if name not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)}; choose from "
                         f"{','.join(known)}")
    if min(args.rounds, args.latency_rounds, args.growth_rounds) < 1:
        parser.error("--rounds, --latency-rounds and --growth-rounds must be at least 1")
    # Read here, not when the growth workload comes: that is after the others have run.
    try:
        args.growth_sizes = [int(s) for s in args.growth_sizes.split(",") if s]
    except ValueError:
        parser.error(f"--growth-sizes: not a list of numbers: {args.growth_sizes!r}")
    if not args.growth_sizes or min(args.growth_sizes) < 1:
        parser.error("--growth-sizes: give one or more table sizes of at least 1 job")
    try:
        args.settings = parse_settings(args.settings)
        args.latency_settings = parse_settings(args.latency_settings)
        args.idle_settings = parse_settings(args.idle_settings)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def knob_table(env: Env, settings: Sequence[Setting]) -> list[dict[str, Any]]:
    """Every setting with the knobs each system runs it with, as the adapters report them."""
    table = []
    for setting in settings:
        knobs: dict[str, Any] = {}
        for system in env.systems:
            if system == "jobd":
                knobs[system] = jobd_knobs(setting)
            else:
                knobs[system] = {"processes": setting.workers, **run_json(
                    command_for(env, system, "knobs", str(setting.concurrency)))}
        table.append({**setting.as_dict(), "knobs": knobs})
    return table


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    from bench import report

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    only = set(args.only.split(","))
    wanted = [s for s in args.systems.split(",") if s]
    started = time.monotonic()
    log("installing / checking the peers")
    peers = install(args.upgrade_peers)
    systems = [s for s in wanted if s not in peers.problems]
    if "jobd" not in systems:
        systems.insert(0, "jobd")  # the ceiling and growth run on jobd's tables
    for system, why in peers.problems.items():
        log(f"{system}: left out: {why}")
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "revision": source_revision(), "hardware": hardware(), "versions": peers.versions,
        "left_out": peers.problems, "systems": systems,
        "parameters": {"settings": [s.label for s in args.settings],
                       "latency_settings": [s.label for s in args.latency_settings],
                       "idle_settings": [s.label for s in args.idle_settings],
                       "growth_setting": GROWTH_SETTING.label,
                       "drain_jobs": DRAIN_JOBS, "drain_cap_s": DRAIN_CAP_S,
                       "latency_rate": LATENCY_RATE, "latency_seconds": LATENCY_SECONDS,
                       "idle_window_s": IDLE_WINDOW_S, "ceiling_clients": args.ceiling_clients,
                       "rounds": args.rounds, "latency_rounds": args.latency_rounds},
        "knob_meaning": {s: KNOBS[s] for s in systems},
        "targets": TARGETS, "records": [],
    }
    records: list[dict] = results["records"]
    try:
        with environment(systems, peers, args.keep) as env:
            results["server_settings"] = env.settings
            log("server: " + ", ".join(f"{k}={v}" for k, v in env.settings.items()))
            ran = [*(args.settings if "drain" in only else []),
                   *(args.latency_settings if "latency" in only else []),
                   *(args.idle_settings if "idle" in only else []),
                   *([GROWTH_SETTING] if "growth" in only else [])]
            used = {s.label: s for s in ran}
            results["settings"] = knob_table(env, list(used.values()))
            for row in results["settings"]:
                log(f"setting {row['label']}: " + "; ".join(
                    f"{system} {json.dumps(knobs, separators=(',', ':'))}"
                    for system, knobs in row["knobs"].items()))
            if "drain" in only:
                # Every round visits every setting; the systems' order (and the ceiling's
                # place among them) rotates from round to round.
                contenders = [*systems, "sql-ceiling"]
                for round_no in range(1, args.rounds + 1):
                    for setting in args.settings:
                        for who in rotated(contenders, round_no):
                            if who == "sql-ceiling":
                                clients = ceiling_clients(setting, args.ceiling_clients)
                                records.append(measure_ceiling(env, setting, round_no, clients))
                            else:
                                records.extend(measure_drain(env, who, setting, round_no))
            if "latency" in only:
                for round_no in range(1, args.latency_rounds + 1):
                    for setting in args.latency_settings:
                        for system in rotated(systems, round_no):
                            records.append(measure_latency(env, system, setting, round_no))
            if "idle" in only:
                for setting in args.idle_settings:
                    records.extend(measure_idle(env, systems, setting))
            if "growth" in only:
                records.extend(measure_growth(env, args.growth_sizes, rounds=args.growth_rounds))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    results["elapsed_s"] = round(time.monotonic() - started)
    summary = report.summarize(results)
    results["summary"] = summary
    markdown = report.markdown(results)
    print(markdown)
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = free_stem(args.out, datetime.now(UTC).strftime("%Y-%m-%d"))
        stem.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        stem.with_suffix(".md").write_text(markdown + "\n")
        report.chart(results, stem.with_suffix(".png"), peers)
        log(f"wrote {stem}.json, .md and .png")
    log(f"done in {results['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

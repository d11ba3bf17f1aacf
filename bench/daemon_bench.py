"""What the jobd daemon costs and delivers end to end: idle load, wake-up latency, drain rate.

Usage::

    .venv/bin/python bench/daemon_bench.py [--only idle|latency|drain] [--rounds N]

The benchmark starts its own throwaway PostgreSQL cluster (jobd.localpg, a free port, a temp
directory), creates and migrates a database in it, writes a config and a module of no-op
handlers to a temp directory (put on PYTHONPATH for the daemon), and runs the daemon as
``python -m jobd run -c CONFIG --database-url URL``. Every measurement starts its own daemon
and ends it with SIGTERM, requiring exit code 0. The cluster is stopped and the temp directory
removed at the end, also on error, Ctrl-C or SIGTERM.

idle
    2 lanes x 2 workers, nothing to do. Database transactions per second over 60 s: the change
    in ``xact_commit + xact_rollback`` of the benchmark database in ``pg_stat_database``,
    sampled from a connection to *another* database (``postgres``), so the sampling itself is
    not counted; autovacuum is paused meanwhile. The daemon settles 15 s first (see
    IDLE_SETTLE_S). Target: <= 1 txn/s.
latency
    1 lane, 2 workers, concurrency 16. One enqueuer offers 200 jobs/s for 20 s with
    ``jobd.enqueue`` on an autocommit connection at a fixed schedule. The handler writes
    ``time.time()`` as its first act; enqueue-to-start is that minus the job's ``created_at``
    (the database's ``now()`` of the enqueue transaction). Both clocks are this machine's
    clock: the server runs here. Targets: p50 <= 3 ms, p99 <= 10 ms.
drain
    1 lane, concurrency 100, workers 2 and 4. 20,000 no-op jobs are committed with one
    ``jobd.enqueue_many`` while the daemon idles (all of them become visible at once); jobs/s
    from the first handler start to the last ``finished_at`` in ``jobd.jobs_archive``.
    Beside it, the claim+complete SQL ceiling on the same cluster: pgbench, 4 and 8 clients,
    each script iteration claiming 100 due rows (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE
    SKIP LOCKED LIMIT 100) RETURNING) and archiving them (DELETE ... RETURNING -> INSERT INTO
    jobd.jobs_archive), two commits per batch like the daemon, against 20,000 pre-filled
    rows. Target: daemon >= 10,000 jobs/s.
    During each daemon drain the RSS of the supervisor and its children (VmRSS from
    /proc/PID/status) is sampled every 50 ms; the peak sum is reported.
    Target: supervisor + 4 workers < 300 MB.

Every connection runs with synchronous_commit=on (set on the server with ALTER SYSTEM and
checked). Output: the server settings, progress on stderr, a table, then one JSON line per
measurement (lines starting with ``{``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import jobd
from jobd.db import connect
from jobd.localpg import find_bindir, throwaway_cluster
from jobd.migrate import migrate

SCHEMA = "jobd"
DBNAME = "jobd_daemon_bench"
LANE = "default"

# PostgreSQL 15 flushes a backend's transaction counts to pg_stat_database at most once a
# second; counts held back by that limit go out when the backend next flushes, or after 10 s
# idle. The supervisor's burst of start-up transactions would land in the window after a
# shorter settle.
IDLE_SETTLE_S = 15.0
IDLE_WINDOW_S = 60.0
IDLE_TARGET_TXN_PER_S = 1.0

LATENCY_RATE = 200  # jobs offered per second
LATENCY_SECONDS = 20.0
LATENCY_WORKERS = 2
LATENCY_CONCURRENCY = 16
LATENCY_SETTLE_S = 2.0
LATENCY_TARGETS_MS = {"p50": 3.0, "p99": 10.0}

DRAIN_JOBS = 20_000
# (worker processes, concurrency) per drain contender; --drain-settings replaces them.
DRAIN_SETTINGS = ((2, 100), (4, 100))
DRAIN_SETTLE_S = 2.0
DRAIN_TARGET_JOBS_PER_S = 10_000
CEILING_CLIENTS = (4, 8)
CEILING_BATCH = 100
RSS_SAMPLE_S = 0.05
RSS_TARGET_MB = 300.0  # supervisor + 4 workers
SCRAPE_INTERVAL_S = 1.0  # how often a drain with metrics on is scraped

DEFAULT_ROUNDS = 3
VISIBILITY_TIMEOUT_S = 30.0
DAEMON_STOP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 300.0

SERVER_SETTINGS = [
    "server_version", "synchronous_commit", "fsync", "wal_sync_method", "full_page_writes",
    "wal_level", "commit_delay", "shared_buffers", "max_connections", "max_wal_size",
    "checkpoint_timeout", "autovacuum", "shared_preload_libraries",
]

# The handlers the daemon runs. Written into the temp directory at run time and imported by
# the workers through PYTHONPATH; JOBD_BENCH_STAMPS names the directory for the timestamps.
HANDLER_MODULE = "daemon_bench_handlers"
HANDLER_SOURCE = '''\
"""Handlers for bench/daemon_bench.py: they do nothing but note when they started."""

import os
import threading
import time

_DIR = os.environ.get("JOBD_BENCH_STAMPS")
_lock = threading.Lock()
_fd = None
_started = False


def _write(line):
    global _fd
    if _DIR is None:
        return
    if _fd is None:
        with _lock:
            if _fd is None:
                path = os.path.join(_DIR, "starts-%d.txt" % os.getpid())
                _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, line.encode())


def stamp(job):
    """Records (job id, start time, lease expiry) for every job."""
    started = time.time()
    _write("%d %.6f %.6f\\n" % (job.id, started, job.lease_until.timestamp()))


def noop(job):
    """Does nothing; the first job of each process records its start time."""
    global _started
    if not _started:
        _started = True
        _write("first %.6f\\n" % time.time())
'''

# The claim+complete ceiling: the minimal SQL for a claim of a batch and its move to the
# archive, two statements (two commits) per batch (bench/sql/, shared by the benchmarks).
_CEILING_SQL = Path(__file__).resolve().parent / "sql"
PGBENCH_SCRIPT = ((_CEILING_SQL / "ceiling_claim.sql").read_text()
                  + (_CEILING_SQL / "ceiling_done_archive.sql").read_text())

_PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
_FAILED = re.compile(r"number of failed transactions: (\d+)")
_TPS = re.compile(r"tps = ([\d.]+) \(without initial connection time\)")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- statistics ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass
class Metric:
    """One reported number over rounds, with its target."""

    key: str  # stable name for JSON
    label: str  # what the table shows
    unit: str
    values: list[float] = field(default_factory=list)
    target: float | None = None
    higher_is_better: bool = False
    target_text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    other_load: list[float] = field(default_factory=list)  # cores used by others, per round

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    def meets(self) -> bool | None:
        if self.target is None or not self.values:
            return None
        if self.higher_is_better:
            return self.median >= self.target
        return self.median <= self.target if self.unit != "MB" else self.median < self.target


# --- the environment: cluster, database, files ---------------------------------------------


@dataclass
class Env:
    root: Path
    admin_url: str  # the postgres database: sampling and admin, never counted
    url: str  # the benchmark database
    config_dir: Path
    handler_dir: Path
    pgbench: Path
    statements: bool
    postmaster_pid: int = 0
    settings: dict[str, str] = field(default_factory=dict)
    counter: int = 0
    dbname: str = DBNAME  # the database the daemon serves (bench/pressure.py has one per scenario)
    # Keys every lane of the latency and drain configs gets (--lane-timeout: ``timeout``).
    lane_defaults: dict[str, Any] = field(default_factory=dict)

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.admin_url, autocommit=True,
                               application_name="daemon-bench-admin")

    def bench_conn(self) -> psycopg.Connection:
        return connect(self.url, SCHEMA, application_name="daemon-bench")

    def scratch(self, name: str) -> Path:
        self.counter += 1
        path = self.root / f"{self.counter:02d}-{name}"
        path.mkdir()
        return path


@contextmanager
def environment(statements: bool, keep: bool,
                settings: dict[str, str] | None = None) -> Iterator[Env]:
    """The private cluster, its migrated database, the handlers and a config directory;
    ``settings``: server settings for its command line (bench/burst_bench.py's
    ``track_commit_timestamp``)."""
    with throwaway_cluster("jobd-daemon-bench-", keep=keep, log=log,
                           settings=settings) as cluster:
        log(f"started a private cluster in {cluster.datadir} on port {cluster.port}")
        root = cluster.datadir.parent
        with psycopg.connect(cluster.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            if statements:
                conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            conn.execute("SELECT pg_reload_conf()")
        if statements:  # shared_preload_libraries needs a restart
            cluster.stop()
            cluster.start()
            # Known only once the library is loaded: planning time, beside execution time.
            with psycopg.connect(cluster.url, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
                conn.execute("SELECT pg_reload_conf()")
        admin_url = make_conninfo(cluster.url, options="-c synchronous_commit=on")
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
        url = make_conninfo(admin_url, dbname=DBNAME)
        with connect(url, SCHEMA) as conn:
            migrate(conn, SCHEMA)
            if statements:
                conn.execute("CREATE EXTENSION pg_stat_statements SCHEMA public")
        handler_dir = root / "handlers"
        handler_dir.mkdir()
        (handler_dir / f"{HANDLER_MODULE}.py").write_text(HANDLER_SOURCE)
        config_dir = root / "config"
        config_dir.mkdir()
        env = Env(root, admin_url, url, config_dir, handler_dir, find_bindir() / "pgbench",
                  statements)
        env.postmaster_pid = int((cluster.datadir / "postmaster.pid").read_text().split()[0])
        with env.bench_conn() as conn:
            rows = conn.execute("SELECT name, current_setting(name) FROM unnest(%s::text[]) "
                                "AS name", (SERVER_SETTINGS,)).fetchall()
        env.settings = dict(rows)
        if env.settings["synchronous_commit"] != "on":
            raise SystemExit(f"synchronous_commit is {env.settings['synchronous_commit']}")
        yield env


def write_config(env: Env, name: str, lanes: dict[str, tuple[int, int]],
                 metrics_listen: str | None = None, *,
                 lane_options: dict[str, dict[str, Any]] | None = None,
                 handlers: dict[str, str] | None = None) -> Path:
    """A config with the bench handlers and ``lanes``: name -> (workers, concurrency); with
    ``metrics_listen``, the daemon serves its Prometheus metrics there. ``lane_options``:
    lane -> further keys of that lane (``fair_by``, ``max_wait``, ...); ``handlers``: further
    handlers, name -> ``module:function`` (a module written to ``env.handler_dir``)."""
    lines = [
        "database:",
        f"  schema: {SCHEMA}",
        "node:",
        "  name: bench",
        "supervisor:",
        "  shutdown_timeout: 30s",
        "  log_level: info",
        *([f'metrics: {{listen: "{metrics_listen}"}}'] if metrics_listen else []),
        "handlers:",
        f"  stamp: {HANDLER_MODULE}:stamp",
        f"  noop: {HANDLER_MODULE}:noop",
        *(f"  {handler}: {path}" for handler, path in (handlers or {}).items()),
        "lanes:",
    ]
    for lane, (workers, concurrency) in lanes.items():
        lines += [f"  {lane}:", f"    workers: {workers}", f"    concurrency: {concurrency}",
                  f"    visibility_timeout: {VISIBILITY_TIMEOUT_S:g}s"]
        # JSON scalars are YAML.
        lines += [f"    {key}: {json.dumps(value)}"
                  for key, value in (lane_options or {}).get(lane, {}).items()]
    path = env.config_dir / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def reset_queue(env: Env) -> None:
    """Empty tables and a fresh checkpoint, so every round starts alike (not timed)."""
    with env.bench_conn() as conn:
        conn.execute("TRUNCATE jobd.jobs, jobd.jobs_archive, jobd.dead_letter, jobd.nodes")
        conn.execute("VACUUM (ANALYZE) jobd.jobs")
        conn.execute("CHECKPOINT")


def reset_statements(env: Env) -> None:
    if env.statements:
        with env.bench_conn() as conn:
            conn.execute("SELECT public.pg_stat_statements_reset()")


def report_statements(env: Env, title: str, limit: int = 8) -> list[dict[str, Any]]:
    """The busiest statements of the benchmark database since the last reset (stderr)."""
    if not env.statements:
        return []
    with env.bench_conn() as conn:
        rows = conn.execute(
            "SELECT s.calls, s.total_exec_time, s.rows, s.total_plan_time, s.plans, "
            "       regexp_replace(left(s.query, 70), '\\s+', ' ', 'g') "
            "  FROM public.pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            " WHERE d.datname = current_database() AND s.query NOT LIKE '%%pg_stat_statements%%'"
            " ORDER BY s.calls DESC LIMIT %s", (limit,)).fetchall()
    log(f"pg_stat_statements, {title}: calls  total_ms  mean_ms  rows  plans  plan_ms  query")
    result = []
    for calls, total, nrows, plan_ms, plans, text in rows:
        log(f"  {calls:8d} {total:9.1f} {total / calls:8.3f} {nrows:7d} {plans:6d} {plan_ms:8.1f}"
            f"  {text}")
        result.append({"calls": calls, "total_ms": round(total, 1), "rows": nrows,
                       "plans": plans, "plan_ms": round(plan_ms, 1), "query": text})
    return result


# --- the daemon ----------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    return status_kb(pid, "VmRSS")


def status_kb(pid: int, key: str) -> int:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM, ...) in kB; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        # A process that exits meanwhile takes its /proc directory with it, even mid-glob.
        with suppress(OSError, ValueError):
            for task in Path(f"/proc/{current}/task").glob("*/children"):
                todo += [int(child) for child in task.read_text().split()]
    return found


def own_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time of ``pids`` including their reaped children (utime+stime+cutime+cstime)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15])
    return total / ticks


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (all cores, /proc/stat), in seconds."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class LoadMeter:
    """CPU used during a window, split into this benchmark's (itself, the daemon, pgbench and
    the private cluster) and everything else on the machine (other people's work)."""

    def __init__(self, env: Env):
        self.postmaster = env.postmaster_pid
        self.start()

    def _sample(self) -> tuple[float, float, float]:
        mine = descendants(os.getpid()) + descendants(self.postmaster)
        return time.monotonic(), machine_busy_seconds(), own_cpu_seconds(mine)

    def start(self) -> None:
        self.before = self._sample()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        elapsed = after[0] - self.before[0]
        busy = (after[1] - self.before[1]) / elapsed
        mine = (after[2] - self.before[2]) / elapsed
        other = max(0.0, busy - mine)
        return {"own_cpu_cores": round(mine, 2), "other_load_cores": round(other, 2),
                "own_cpu_seconds": round(after[2] - self.before[2], 3)}


class Daemon:
    """``jobd run`` as a subprocess in its own session, its output in a log file."""

    def __init__(self, env: Env, config: Path, stamps: Path, workers: int):
        self.env = env
        self.config = config
        self.stamps = stamps
        self.workers = workers
        self.log_path = stamps / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Daemon:
        environ = dict(os.environ)
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.env.handler_dir), environ.get("PYTHONPATH")) if p)
        environ["JOBD_BENCH_STAMPS"] = str(self.stamps)
        environ.pop("JOBD_DATABASE_URL", None)
        environ.pop("JOBD_CONFIG", None)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobd", "run", "-c", str(self.config),
                 "--database-url", self.env.url],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=environ,
                start_new_session=True)
        self.wait_ready()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.stop()
        else:
            self.kill()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self) -> None:
        """Until every worker, the supervisor and the listener are connected and idle."""
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        with self.env.admin() as admin:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.proc.returncode} while "
                                       f"starting:\n{self.tail()}")
                row = admin.execute(
                    "SELECT count(*) FILTER (WHERE application_name LIKE 'jobd worker %%'), "
                    "       count(*) FILTER (WHERE application_name LIKE 'jobd supervisor%%'"
                    "                        OR application_name LIKE 'jobd listener%%') "
                    "  FROM pg_stat_activity WHERE datname = %s AND state = 'idle'",
                    (self.env.dbname,)).fetchone()
                assert row is not None
                if row[0] >= self.workers and row[1] >= 2:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not get ready in {READY_TIMEOUT_S:g}s "
                                       f"({row[0]}/{self.workers} workers):\n{self.tail()}")
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then exit code 0 within the timeout, or an error."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=DAEMON_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the daemon did not stop within {DAEMON_STOP_TIMEOUT_S:g}s "
                               f"of SIGTERM:\n{self.tail()}") from None
        if code != 0:
            raise RuntimeError(f"the daemon exited with {code} after SIGTERM:\n{self.tail()}")

    def kill(self) -> None:
        """On error: stop it and whatever it started (its own process group)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def problems(self) -> list[str]:
        """Warning and error lines of the daemon's log."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with suppress(ValueError):
                record = json.loads(line)
                if record.get("level") in ("warning", "error", "critical"):
                    found.append(line)
                continue
            if "Traceback" in line:
                found.append(line)
        return found


class RssSampler(threading.Thread):
    """Samples the summed VmRSS of a process tree every RSS_SAMPLE_S until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kb = 0
        self.peak_parts: list[int] = []
        self.samples = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            parts = [rss_kb(pid) for pid in descendants(self.pid)]
            self.samples += 1
            if sum(parts) > self.peak_kb:
                self.peak_kb = sum(parts)
                self.peak_parts = parts
            self.halt.wait(RSS_SAMPLE_S)

    def finish(self) -> None:
        self.halt.set()
        self.join()


class Scraper(threading.Thread):
    """GETs http://LISTEN/metrics every SCRAPE_INTERVAL_S until stopped, like Prometheus."""

    def __init__(self, listen: str):
        super().__init__(daemon=True)
        self.url = f"http://{listen}/metrics"
        self.scrapes = 0
        self.error: OSError | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
            except OSError as exc:
                self.error = exc  # raised by finish(): a drain whose scrapes failed is void
                return
            self.scrapes += 1
            self.halt.wait(SCRAPE_INTERVAL_S)

    def finish(self) -> None:
        self.halt.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"scraping {self.url} failed: {self.error}")


# --- idle ----------------------------------------------------------------------------------


def xacts(admin: psycopg.Connection) -> tuple[int, int]:
    """Transactions (commits + rollbacks) and sessions of the benchmark database so far."""
    row = admin.execute("SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database "
                        "WHERE datname = %s", (DBNAME,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@contextmanager
def autovacuum_paused(env: Env) -> Iterator[None]:
    """No autovacuum worker visits (each costs the database a few transactions) meanwhile."""
    with env.admin() as admin:
        admin.execute("ALTER SYSTEM SET autovacuum = off")
        admin.execute("SELECT pg_reload_conf()")
    try:
        yield
    finally:
        with env.admin() as admin:
            admin.execute("ALTER SYSTEM RESET autovacuum")
            admin.execute("SELECT pg_reload_conf()")


def measure_idle(env: Env, metrics_listen: str | None = None) -> dict[str, Any]:
    reset_queue(env)
    reset_statements(env)
    stamps = env.scratch("idle")
    config = write_config(env, "idle", {"a": (2, 8), "b": (2, 8)}, metrics_listen)
    with autovacuum_paused(env), Daemon(env, config, stamps, workers=4) as daemon:
        log(f"idle: daemon up (pid {daemon.pid}); settling {IDLE_SETTLE_S:g}s")
        time.sleep(IDLE_SETTLE_S)
        # Nothing of this benchmark touches the benchmark database during the window: the
        # sampling connection is to the postgres database, so its own transactions land
        # there, and autovacuum is paused.
        with env.admin() as admin:
            pids = descendants(daemon.pid)
            meter = LoadMeter(env)
            cpu_before = own_cpu_seconds(pids)
            (before, sessions_before), t0 = xacts(admin), time.monotonic()
            log(f"idle: counting transactions for {IDLE_WINDOW_S:g}s")
            time.sleep(IDLE_WINDOW_S)
            (after, sessions_after), t1 = xacts(admin), time.monotonic()
            cpu_after = own_cpu_seconds(pids)
            load = meter.stop()
        statements = report_statements(env, "settle and idle window")
        problems = daemon.problems()
    seconds = t1 - t0
    result = {"transactions": after - before, "seconds": round(seconds, 2),
              "txn_per_s": (after - before) / seconds,
              "new_sessions": sessions_after - sessions_before,
              "daemon_cpu_pct": 100.0 * (cpu_after - cpu_before) / seconds,
              "processes": len(pids), "daemon_warnings": len(problems), **load}
    if statements:
        result["statements"] = statements
    log(f"idle: {result['transactions']} transactions in {seconds:.1f}s = "
        f"{result['txn_per_s']:.2f}/s ({result['new_sessions']} new sessions); daemon CPU "
        f"{result['daemon_cpu_pct']:.2f}%; other load on the machine "
        f"{load['other_load_cores']:.2f} cores")
    return result


# --- latency -------------------------------------------------------------------------------


def read_stamps(directory: Path) -> tuple[dict[int, tuple[float, float]], list[float]]:
    """(job id -> (start time, claim time), the 'first' lines) from every worker's file.

    The claim time is the claim statement's now(): the lease expiry minus the lease length.
    """
    starts: dict[int, tuple[float, float]] = {}
    firsts: list[float] = []
    for path in directory.glob("starts-*.txt"):
        for line in path.read_text().splitlines():
            key, *values = line.split()
            if key == "first":
                firsts.append(float(values[0]))
                continue
            job_id = int(key)
            entry = (float(values[0]), float(values[1]) - VISIBILITY_TIMEOUT_S)
            if job_id not in starts or entry < starts[job_id]:
                starts[job_id] = entry
    return starts, firsts


def wait_drained(env: Env, expected: int, timeout: float = DRAIN_TIMEOUT_S,
                 interval: float = 0.1) -> None:
    """Until the queue is empty and the archive holds ``expected`` rows."""
    deadline = time.monotonic() + timeout
    with env.bench_conn() as conn:
        while True:
            row = conn.execute("SELECT NOT EXISTS (SELECT 1 FROM jobd.jobs)").fetchone()
            if row and row[0]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs left in the queue after {timeout:g}s")
            time.sleep(interval)
        archived = conn.execute("SELECT count(*) FROM jobd.jobs_archive").fetchone()
        dead = conn.execute("SELECT count(*) FROM jobd.dead_letter").fetchone()
    assert archived is not None and dead is not None
    if archived[0] != expected or dead[0]:
        raise RuntimeError(f"expected {expected} archived jobs, found {archived[0]} "
                           f"(and {dead[0]} dead)")


def measure_latency(env: Env, round_no: int) -> dict[str, Any]:
    reset_queue(env)
    stamps = env.scratch(f"latency-{round_no}")
    config = write_config(env, "latency", {LANE: (LATENCY_WORKERS, LATENCY_CONCURRENCY)},
                          lane_options={LANE: env.lane_defaults})
    total = int(LATENCY_RATE * LATENCY_SECONDS)
    with Daemon(env, config, stamps, workers=LATENCY_WORKERS) as daemon:
        time.sleep(LATENCY_SETTLE_S)
        reset_statements(env)
        log(f"latency round {round_no}: offering {LATENCY_RATE}/s for {LATENCY_SECONDS:g}s")
        interval = 1.0 / LATENCY_RATE
        worst_lag = 0.0
        returned: dict[int, float] = {}  # job id -> when enqueue() returned (committed)
        meter = LoadMeter(env)
        with connect(env.url, SCHEMA, application_name="daemon-bench-enqueuer") as conn:
            begin = time.perf_counter() + 0.05
            for i in range(total):
                due = begin + i * interval
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    worst_lag = max(worst_lag, -wait)
                job_id = jobd.enqueue(conn, "stamp", lane=LANE)
                returned[job_id] = time.time()
            offered_seconds = time.perf_counter() - begin
        load = meter.stop()
        wait_drained(env, total, timeout=60.0)
        statements = report_statements(env, f"latency round {round_no}")
        problems = daemon.problems()
    starts, _ = read_stamps(stamps)
    with env.bench_conn() as conn:
        created = dict(conn.execute(
            "SELECT id, extract(epoch FROM created_at)::float8 FROM jobd.jobs_archive"
        ).fetchall())
    missing = set(created) - set(starts)
    if missing:
        raise RuntimeError(f"{len(missing)} jobs have no recorded start")
    latencies = sorted((starts[i][0] - created[i]) * 1000.0 for i in created)
    # Where the time goes: enqueue commit (created_at to enqueue() returning), the wake-up
    # (to the claim statement's now()), and the hand-off to a handler thread.
    phases = {
        "commit": sorted((returned[i] - created[i]) * 1000.0 for i in created),
        "to_claim": sorted((starts[i][1] - created[i]) * 1000.0 for i in created),
        "claim_to_start": sorted((starts[i][0] - starts[i][1]) * 1000.0 for i in created),
    }
    breakdown = {f"{name}_{p}_ms": round(percentile(values, q), 3)
                 for name, values in phases.items() for p, q in (("p50", 50), ("p99", 99))}
    result = {
        "jobs": len(latencies),
        "offered_per_s": round(total / offered_seconds, 1),
        "enqueuer_worst_lag_ms": round(worst_lag * 1000.0, 2),
        "p50_ms": percentile(latencies, 50), "p95_ms": percentile(latencies, 95),
        "p99_ms": percentile(latencies, 99), "max_ms": latencies[-1],
        "min_ms": latencies[0], "daemon_warnings": len(problems), "breakdown": breakdown,
        **load,
    }
    if statements:
        result["statements"] = statements
    log(f"latency round {round_no}: p50 {result['p50_ms']:.2f} ms, p95 "
        f"{result['p95_ms']:.2f}, p99 {result['p99_ms']:.2f}, max {result['max_ms']:.2f} "
        f"({result['jobs']} jobs at {result['offered_per_s']}/s; other load "
        f"{load['other_load_cores']:.2f} cores)")
    log(f"latency round {round_no}: phases (ms) " + ", ".join(
        f"{k.removesuffix('_ms')} {v:.2f}" for k, v in breakdown.items()))
    return result


# --- drain and its ceiling -----------------------------------------------------------------


def drain_name(workers: int, concurrency: int) -> str:
    return f"w{workers}" if concurrency == 100 else f"w{workers}c{concurrency}"


def measure_drain(env: Env, workers: int, concurrency: int, round_no: int,
                  metrics_listen: str | None = None, *,
                  lane_options: dict[str, Any] | None = None,
                  specs: Sequence[jobd.JobSpec] | None = None,
                  label: str | None = None,
                  handlers: dict[str, str] | None = None) -> dict[str, Any]:
    """With ``metrics_listen`` the daemon serves metrics and is scraped every second during
    the drain, as Prometheus would. ``lane_options`` adds keys to the lane's config,
    ``specs`` replaces the DRAIN_JOBS no-op jobs (bench/fairness_bench.py: fair lanes and
    jobs with fairness keys), ``label`` names the contender in files and the log,
    ``handlers`` adds handlers to the config (name -> ``module:function``)."""
    reset_queue(env)
    name = label or drain_name(workers, concurrency)
    stamps = env.scratch(f"drain-{name}-{round_no}")
    config = write_config(env, f"drain-{name}", {LANE: (workers, concurrency)},
                          metrics_listen,
                          lane_options={LANE: {**env.lane_defaults, **(lane_options or {})}},
                          handlers=handlers)
    if specs is None:
        specs = [jobd.JobSpec("noop", {}, LANE) for _ in range(DRAIN_JOBS)]
    total = len(specs)
    with Daemon(env, config, stamps, workers=workers) as daemon:
        time.sleep(DRAIN_SETTLE_S)
        reset_statements(env)
        idle_kb = sum(rss_kb(pid) for pid in descendants(daemon.pid))
        sampler = RssSampler(daemon.pid)
        sampler.start()
        scraper = Scraper(metrics_listen) if metrics_listen else None
        if scraper is not None:
            scraper.start()
        meter = LoadMeter(env)
        daemon_pids = descendants(daemon.pid)
        daemon_cpu = own_cpu_seconds(daemon_pids)
        try:
            with env.bench_conn() as conn:
                # One transaction: the whole backlog becomes visible at once, with one
                # wake-up notification at commit.
                jobd.enqueue_many(conn, specs)
            wait_drained(env, total, interval=0.05)
        finally:
            sampler.finish()
            if scraper is not None:
                scraper.finish()
        daemon_cpu = own_cpu_seconds(daemon_pids) - daemon_cpu
        load = meter.stop()
        statements = report_statements(env, f"drain {workers}x{concurrency} round {round_no}")
        problems = daemon.problems()
    _, firsts = read_stamps(stamps)
    with env.bench_conn() as conn:
        row = conn.execute("SELECT extract(epoch FROM max(finished_at))::float8, "
                           "count(DISTINCT claimed_by) FROM jobd.jobs_archive").fetchone()
    assert row is not None
    last_finished, claimers = row
    first_start = min(firsts)
    seconds = last_finished - first_start
    result = {
        "workers": workers, "concurrency": concurrency, "jobs": total,
        "seconds": round(seconds, 3), "jobs_per_s": total / seconds,
        "workers_that_claimed": claimers,
        "peak_rss_mb": sampler.peak_kb / 1024.0,
        "peak_rss_parts_mb": [round(kb / 1024.0, 1) for kb in sampler.peak_parts],
        "idle_rss_mb": round(idle_kb / 1024.0, 1), "rss_samples": sampler.samples,
        "daemon_warnings": len(problems), "daemon_cpu_seconds": round(daemon_cpu, 3), **load,
    }
    if scraper is not None:
        result["scrapes"] = scraper.scrapes
    if statements:
        result["statements"] = statements
    log(f"drain {name} {workers}x{concurrency} round {round_no}: "
        f"{result['jobs_per_s']:,.0f} jobs/s "
        f"({seconds:.2f}s), peak RSS {result['peak_rss_mb']:.0f} MB "
        f"{result['peak_rss_parts_mb']}; other load {load['other_load_cores']:.2f} cores")
    return result


def measure_ceiling(env: Env, clients: int, round_no: int) -> dict[str, Any]:
    reset_queue(env)
    per_client = DRAIN_JOBS // (CEILING_BATCH * clients)
    backlog = DRAIN_JOBS + CEILING_BATCH * clients  # slack: every claim finds a full batch
    with env.bench_conn() as conn:
        jobd.enqueue_many(conn, [jobd.JobSpec("noop", {}, LANE) for _ in range(backlog)])
        conn.execute("VACUUM (ANALYZE) jobd.jobs")
    script = env.config_dir / "claim_archive.sql"
    script.write_text(PGBENCH_SCRIPT)
    reset_statements(env)
    environ = dict(os.environ, PGOPTIONS="-c synchronous_commit=on")
    command = [str(env.pgbench), "--no-vacuum", "--protocol=prepared", f"--file={script}",
               f"--client={clients}", f"--jobs={min(clients, os.cpu_count() or 1)}",
               f"--transactions={per_client}", f"--define=batch={CEILING_BATCH}", env.url]
    meter = LoadMeter(env)
    completed = subprocess.run(command, capture_output=True, text=True, env=environ)
    load = meter.stop()
    output = completed.stdout + completed.stderr
    processed, failed, tps = (p.search(output) for p in (_PROCESSED, _FAILED, _TPS))
    if completed.returncode != 0 or not (processed and tps) or (failed and int(failed[1])):
        raise RuntimeError(f"pgbench failed (exit {completed.returncode}):\n{output}")
    with env.bench_conn() as conn:
        row = conn.execute("SELECT count(*) FROM jobd.jobs_archive").fetchone()
    assert row is not None
    jobs = per_client * clients * CEILING_BATCH
    if row[0] != jobs:
        raise RuntimeError(f"pgbench archived {row[0]} jobs, expected {jobs}")
    statements = report_statements(env, f"ceiling clients={clients} round {round_no}")
    seconds = int(processed[1]) / float(tps[1])
    result = {"clients": clients, "batch": CEILING_BATCH, "jobs": jobs,
              "seconds": round(seconds, 3), "jobs_per_s": jobs / seconds, **load}
    if statements:
        result["statements"] = statements
    log(f"ceiling clients={clients} round {round_no}: {result['jobs_per_s']:,.0f} jobs/s "
        f"({seconds:.2f}s); other load {load['other_load_cores']:.2f} cores")
    return result


# --- the run -------------------------------------------------------------------------------


@dataclass
class Report:
    metrics: list[Metric] = field(default_factory=list)

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric


def run_idle(env: Env, report: Report) -> None:
    result = measure_idle(env)
    report.add(Metric(
        "idle.txn_per_s", "idle: transactions/s (2 lanes x 2 workers, 60 s)", "txn/s",
        [result["txn_per_s"]], IDLE_TARGET_TXN_PER_S, target_text="<= ~1",
        extra={k: v for k, v in result.items() if k != "txn_per_s"},
        other_load=[result["other_load_cores"]]))
    report.add(Metric("idle.daemon_cpu_pct", "idle: daemon CPU (sum of processes)", "% core",
                      [result["daemon_cpu_pct"]], other_load=[result["other_load_cores"]]))


def run_latency(env: Env, report: Report, rounds: int) -> None:
    results = [measure_latency(env, r + 1) for r in range(rounds)]
    base = f"latency: enqueue-to-start {{}} ({LATENCY_RATE}/s, {LATENCY_WORKERS} workers x " \
           f"{LATENCY_CONCURRENCY})"
    extra = {"jobs_per_round": results[0]["jobs"],
             "offered_per_s": [r["offered_per_s"] for r in results],
             "enqueuer_worst_lag_ms": [r["enqueuer_worst_lag_ms"] for r in results],
             "daemon_warnings": [r["daemon_warnings"] for r in results],
             "breakdown": [r["breakdown"] for r in results]}
    for name in ("p50", "p95", "p99", "max"):
        target = LATENCY_TARGETS_MS.get(name)
        report.add(Metric(f"latency.{name}_ms", base.format(name), "ms",
                          [r[f"{name}_ms"] for r in results], target,
                          target_text=f"<= {target:g}" if target else "", extra=extra,
                          other_load=[r["other_load_cores"] for r in results]))


def run_drain(env: Env, report: Report, rounds: int,
              settings: Sequence[tuple[int, int]] = DRAIN_SETTINGS) -> None:
    contenders: list[tuple[str, Callable[[int], dict[str, Any]]]] = []
    for workers, concurrency in settings:
        contenders.append((f"daemon-{drain_name(workers, concurrency)}",
                           lambda r, w=workers, c=concurrency: measure_drain(env, w, c, r)))
    for clients in CEILING_CLIENTS:
        contenders.append((f"pgbench-c{clients}",
                           lambda r, c=clients: measure_ceiling(env, c, r)))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in contenders}
    for r in range(rounds):
        # Rotate the order from round to round so drift does not favour one contender.
        shift = r % len(contenders)
        for name, run in contenders[shift:] + contenders[:shift]:
            results[name].append(run(r + 1))
    for workers, concurrency in settings:
        rs = results[f"daemon-{drain_name(workers, concurrency)}"]
        report.add(Metric(
            f"drain.{drain_name(workers, concurrency)}.jobs_per_s",
            f"drain: daemon jobs/s, {workers} workers x {concurrency}", "jobs/s",
            [r["jobs_per_s"] for r in rs], DRAIN_TARGET_JOBS_PER_S, higher_is_better=True,
            target_text=f">= {DRAIN_TARGET_JOBS_PER_S:,}",
            extra={"jobs": DRAIN_JOBS,
                   "workers_that_claimed": [r["workers_that_claimed"] for r in rs],
                   "daemon_warnings": [r["daemon_warnings"] for r in rs]},
            other_load=[r["other_load_cores"] for r in rs]))
    for clients in CEILING_CLIENTS:
        rs = results[f"pgbench-c{clients}"]
        report.add(Metric(
            f"ceiling.c{clients}.jobs_per_s",
            f"ceiling: claim+archive SQL jobs/s, pgbench {clients} clients", "jobs/s",
            [r["jobs_per_s"] for r in rs], extra={"jobs": rs[0]["jobs"], "batch": CEILING_BATCH},
            other_load=[r["other_load_cores"] for r in rs]))
    for workers, concurrency in settings:
        rs = results[f"daemon-{drain_name(workers, concurrency)}"]
        target = RSS_TARGET_MB if workers == 4 else None
        report.add(Metric(
            f"rss.{drain_name(workers, concurrency)}.peak_mb",
            f"memory: peak RSS during drain, supervisor + {workers} workers", "MB",
            [r["peak_rss_mb"] for r in rs], target,
            target_text=f"< {RSS_TARGET_MB:g}" if target else "",
            extra={"peak_parts_mb": [r["peak_rss_parts_mb"] for r in rs],
                   "idle_rss_mb": [r["idle_rss_mb"] for r in rs]},
            other_load=[r["other_load_cores"] for r in rs]))


def fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "-"
    if unit == "jobs/s":
        return f"{value:,.0f}"
    if unit == "MB":
        return f"{value:.0f}"
    return f"{value:.2f}"


def source_revision() -> str:
    """The commit of the tree under test, and whether jobd's files differ from it."""
    top = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(top), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--",
                                "jobd", "migrations"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"commit {head}" + (" with uncommitted changes in jobd/ or migrations/"
                               if dirty else "")


def print_header(env: Env, rounds: int) -> None:
    s = env.settings
    print(f"jobd daemon benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC; "
          f"{os.cpu_count()} cores; Python {sys.version.split()[0]}; jobd {jobd.__version__}; "
          f"psycopg {psycopg.__version__}; rounds {rounds}")
    print(f"source: {source_revision()}")
    if env.lane_defaults:
        print("every lane of the latency and drain runs: "
              + ", ".join(f"{key}: {value}" for key, value in env.lane_defaults.items()))
    print(f"PostgreSQL {s['server_version']} (private cluster); "
          + "; ".join(f"{name}={s[name]}" for name in SERVER_SETTINGS[1:]))
    print(flush=True)


def print_table(report: Report) -> None:
    header = ["measurement", "unit", "median", "min", "max", "target", "verdict",
              "other load"]
    rows = []
    for m in report.metrics:
        met = m.meets()
        verdict = "" if met is None else ("ok" if met else "MISSED")
        rows.append([m.label, m.unit, fmt(m.median, m.unit),
                     fmt(min(m.values), m.unit) if m.values else "-",
                     fmt(max(m.values), m.unit) if m.values else "-", m.target_text, verdict,
                     f"{max(m.other_load):.2f}" if m.other_load else ""])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4, 7}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    print("median, min and max over rounds; other load: the most CPU (in cores) that processes "
          "outside this benchmark used during any round of the row")
    print(line(header))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    print(flush=True)


def print_json(report: Report, env: Env) -> None:
    for m in report.metrics:
        record: dict[str, Any] = {
            "benchmark": "daemon", "measurement": m.key, "unit": m.unit,
            "rounds": len(m.values), "median": round(m.median, 3),
            "min": round(min(m.values), 3), "max": round(max(m.values), 3),
            "samples": [round(v, 3) for v in m.values],
        }
        if m.target is not None:
            record["target"] = m.target_text
            record["meets_target"] = m.meets()
        record.update(m.extra)
        record["other_load_cores"] = m.other_load
        record.update(server_version=env.settings["server_version"],
                      synchronous_commit=env.settings["synchronous_commit"],
                      cores=os.cpu_count())
        print(json.dumps(record, default=str))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Idle cost, wake-up latency, drain throughput and memory of the jobd "
                    "daemon, on a private PostgreSQL cluster.")
    parser.add_argument("--only", choices=["idle", "latency", "drain"],
                        help="run one measurement (default: all three)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help=f"rounds of latency and drain (default {DEFAULT_ROUNDS}; idle "
                             "runs one 60 s window)")
    parser.add_argument("--statements", action="store_true",
                        help="enable pg_stat_statements and print the busiest statements of "
                             "each measurement on stderr (adds a little overhead)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (daemon logs, stamps, cluster)")
    parser.add_argument("--drain-settings", type=_drain_settings, default=DRAIN_SETTINGS,
                        metavar="WxC,...",
                        help="drain contenders as worker processes x concurrency, e.g. "
                             "1x10,2x10,4x100 (default: 2x100,4x100)")
    parser.add_argument("--lane-timeout", type=float, metavar="SECONDS",
                        help="give the lane of the latency and drain runs this `timeout` "
                             "(default: none, jobd's default; config/jobd.example.yaml sets "
                             "one)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.lane_timeout is not None and not args.lane_timeout > 0:
        parser.error("--lane-timeout must be a positive number of seconds")
    return args


def _drain_settings(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(n) for n in item.split("x")) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxC,... such as 1x10,4x100: {text!r}"
                                         ) from None
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected WxC,... such as 1x10,4x100: {text!r}")
    return pairs  # type: ignore[return-value]


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    parts = [args.only] if args.only else ["idle", "latency", "drain"]
    started = time.monotonic()
    report = Report()
    with environment(args.statements, args.keep) as env:
        if args.lane_timeout is not None:
            env.lane_defaults["timeout"] = f"{args.lane_timeout:g}s"
        print_header(env, args.rounds)
        if "idle" in parts:
            run_idle(env, report)
        if "latency" in parts:
            run_latency(env, report, args.rounds)
        if "drain" in parts:
            run_drain(env, report, args.rounds, args.drain_settings)
    print_table(report)
    print_json(report, env)
    log(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

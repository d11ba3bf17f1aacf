"""A scenario of bench/pressure.py in progress: the cluster, a database and a daemon per
scenario, and the phases, each with its statistics snapshots and its checks of the load.

``Run.begin`` / ``Run.end`` bracket a phase: they tag the producer's sends and the wait
sampler's counts with the phase, restart the producer's schedule, and snapshot the database's
statistics and clock at both edges; ``Run.hold`` lets a phase run while it checks every load
thread and the daemon and takes a statistics snapshot every ``SNAPSHOT_S``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from bench.daemon_bench import Daemon, Env, LoadMeter, log
from bench.pressure_load import HANDLER, LANE, Producer, WaitSampler
from bench.pressure_stats import Monitor, RunFiles
from jobd.localpg import find_bindir, throwaway_cluster

REPO = Path(__file__).resolve().parent.parent
HANDLER_PATH = f"bench.pressure_handlers:{HANDLER}"
WORKERS, CONCURRENCY = 2, 10
VISIBILITY_TIMEOUT_S = 30.0
SNAPSHOT_S = 5.0  # statistics snapshots within a phase (the index-read timeline)
PROGRESS_S = 10.0
POLL_S = 0.5
DRAIN_TIMEOUT_S = 300.0

SERVER_SETTINGS = ["server_version", "synchronous_commit", "fsync", "wal_sync_method",
                   "shared_buffers", "max_wal_size", "max_connections", "autovacuum",
                   "autovacuum_naptime", "shared_preload_libraries"]


@dataclass(frozen=True)
class Durations:
    baseline: float = 60.0
    held: float = 180.0
    overload: float = 60.0
    recovery: float = 60.0
    lead: float = 30.0
    warmup: float = 5.0
    open_loop: float = 30.0
    closed: float = 10.0
    closed_rounds: int = 2
    drain_jobs: int = 20_000


# --- the cluster and a database per scenario -----------------------------------------------


@dataclass
class Cluster:
    root: Path
    admin_url: str
    pgbench: Path
    postmaster_pid: int
    statements: bool
    settings: dict[str, str]


@contextmanager
def cluster(args: argparse.Namespace) -> Iterator[Cluster]:
    with throwaway_cluster("jobd-pressure-", keep=args.keep, log=log,
                           settings=dict(args.server_settings)) as local:
        log(f"started a private cluster in {local.datadir} on port {local.port}")
        with psycopg.connect(local.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
            if args.statements:
                conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        local.stop()  # shared_preload_libraries needs a restart
        local.start()
        admin_url = make_conninfo(local.url, options="-c synchronous_commit=on")
        with psycopg.connect(admin_url, autocommit=True) as conn:
            rows = conn.execute("SELECT name, current_setting(name) FROM unnest(%s::text[]) "
                                "AS name", (SERVER_SETTINGS,)).fetchall()
        settings = dict(rows)
        if settings["synchronous_commit"] != "on":
            raise SystemExit(f"synchronous_commit is {settings['synchronous_commit']}")
        pid = int((local.datadir / "postmaster.pid").read_text().split()[0])
        yield Cluster(local.datadir.parent, admin_url, find_bindir() / "pgbench", pid,
                      args.statements, settings)


def scenario_env(cl: Cluster, name: str) -> Env:
    """A fresh database migrated by ``jobd migrate``, with the benchmark's own schema."""
    dbname = f"pressure_{name}"
    with psycopg.connect(cl.admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    url = make_conninfo(cl.admin_url, dbname=dbname)
    migrated = subprocess.run([sys.executable, "-m", "jobd", "migrate", "--database-url", url],
                              capture_output=True, text=True)
    if migrated.returncode != 0:
        raise RuntimeError(f"jobd migrate failed: {migrated.stderr.strip()}")
    with psycopg.connect(url, autocommit=True) as conn:
        if cl.statements:
            conn.execute("CREATE EXTENSION pg_stat_statements SCHEMA public")
        conn.execute("CREATE SCHEMA pressure")
        conn.execute("CREATE TABLE pressure.plain_jobs (LIKE jobd.jobs INCLUDING ALL)")
    root = cl.root / name
    (root / "config").mkdir(parents=True)
    return Env(root=root, admin_url=cl.admin_url, url=url, config_dir=root / "config",
               handler_dir=REPO, pgbench=cl.pgbench, statements=cl.statements,
               postmaster_pid=cl.postmaster_pid, settings=cl.settings, dbname=dbname)


def write_config(env: Env) -> Path:
    path = env.config_dir / "jobd.yaml"
    path.write_text("\n".join([
        "database:", "  schema: jobd",
        "node:", "  name: pressure",
        "supervisor:", "  shutdown_timeout: 30s", "  log_level: info",
        "handlers:", f"  {HANDLER}: {HANDLER_PATH}",
        "lanes:", f"  {LANE}:", f"    workers: {WORKERS}", f"    concurrency: {CONCURRENCY}",
        f"    visibility_timeout: {VISIBILITY_TIMEOUT_S:g}s",
    ]) + "\n")
    return path


# --- phases --------------------------------------------------------------------------------


@dataclass
class PhaseRecord:
    index: int
    name: str
    kind: str  # warmup, clean, held, recovery, closed, open, drain, overload, backlog
    target_rate: float
    started: float = 0.0  # monotonic
    ended: float = 0.0
    db_started: datetime | None = None
    db_ended: datetime | None = None
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    runs_before: int = 0
    runs_after: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.ended - self.started


class Run:
    """One scenario in progress: its database, daemon, producer, sampler and phases."""

    def __init__(self, name: str, env: Env, args: argparse.Namespace, durations: Durations,
                 monitor: Monitor, sampler: WaitSampler, runs: RunFiles, daemon: Daemon):
        self.name = name
        self.env = env
        self.args = args
        self.durations = durations
        self.monitor = monitor
        self.sampler = sampler
        self.runs = runs
        self.daemon = daemon
        self.phases: list[PhaseRecord] = []
        self.producers: list[Producer] = []
        self.producer: Producer | None = None
        self.extra_sent: list[tuple[int, int]] = []  # (id, phase) sent outside the producer
        self.checks: list[Callable[[], None]] = []
        self.meter = LoadMeter(env)
        self.extra: dict[str, Any] = {}
        self.visibility_timeout = VISIBILITY_TIMEOUT_S

    def use_producer(self, producer: Producer) -> None:
        self.producers.append(producer)
        self.producer = producer

    @property
    def sent(self) -> int:
        return sum(p.jobs_sent for p in self.producers) + len(self.extra_sent)

    def check(self) -> None:
        if self.daemon.proc is not None and self.daemon.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {self.daemon.proc.returncode}:\n"
                               f"{self.daemon.tail()}")
        self.sampler.raise_error()
        for producer in self.producers:
            producer.raise_error()
        for check in self.checks:
            check()

    def begin(self, name: str, kind: str, rate: float) -> PhaseRecord:
        rec = PhaseRecord(len(self.phases), name, kind, rate)
        self.phases.append(rec)
        self.runs.read_new()
        rec.runs_before = self.runs.lines
        rec.before = self.monitor.snapshot()
        rec.db_started = self.monitor.now()
        rec.started = time.monotonic()
        self.meter.start()
        self.sampler.phase = rec.index
        if self.producer is not None:
            self.producer.phase = rec.index
            self.producer.restart()
        log(f"{self.name}: phase {name} ({kind}) begins")
        return rec

    def end(self, rec: PhaseRecord) -> None:
        rec.ended = time.monotonic()
        if self.producer is not None:
            rec.extra["sends_behind_at_end"] = self.producer.behind()
        rec.db_ended = self.monitor.now()
        rec.extra.update(self.meter.stop())
        rec.after = self.monitor.snapshot()
        self.runs.read_new()
        rec.runs_after = self.runs.lines
        rec.extra["backlog_end"], rec.extra["live_end"] = self.monitor.backlog()
        rec.extra["horizon_age_s"] = round(self.monitor.horizon_age_s(), 1)
        log(f"{self.name}: phase {rec.name} ends after {rec.seconds:.1f}s; sent {self.sent}, "
            f"ran {self.runs.lines}, backlog {rec.extra['backlog_end']}")

    def hold(self, rec: PhaseRecord, seconds: float | None = None,
             until: Callable[[], bool] | None = None, timeout: float | None = None) -> None:
        """Let the phase run for ``seconds``, or until ``until()`` (at most ``timeout``),
        checking every load thread and taking statistics snapshots on the way."""
        start = time.monotonic()
        next_snapshot, next_progress = start + SNAPSHOT_S, start + PROGRESS_S
        while True:
            self.check()
            now = time.monotonic()
            if seconds is not None and now - start >= seconds:
                return
            if until is not None and until():
                return
            if timeout is not None and now - start >= timeout:
                rec.extra["timed_out_after_s"] = round(now - start, 1)
                log(f"{self.name}: phase {rec.name} gave up waiting after {now - start:.0f}s")
                return
            if now >= next_snapshot:
                point = self.monitor.snapshot()
                self.runs.read_new()
                point["runs"] = self.runs.lines
                rec.timeline.append(point)
                next_snapshot += SNAPSHOT_S
            if now >= next_progress:
                log(f"{self.name}: {rec.name} {now - start:.0f}s: sent {self.sent}, ran "
                    f"{self.runs.lines}, backlog ~{self.sent - self.runs.lines}")
                next_progress += PROGRESS_S
            left = (start + seconds - now) if seconds is not None else POLL_S
            time.sleep(max(0.0, min(POLL_S, left)))

    def phase(self, name: str, kind: str, seconds: float) -> PhaseRecord:
        rate = self.args.rate
        rec = self.begin(name, kind, rate)
        self.hold(rec, seconds)
        self.end(rec)
        return rec

    def drained(self) -> bool:
        self.runs.read_new()
        return self.runs.lines >= self.sent and self.monitor.backlog()[1] == 0

    def wait_drained(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.drained():
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: {self.sent - self.runs.lines} jobs still "
                                   f"not run {timeout:g}s after the load stopped")
            time.sleep(0.1)


@contextmanager
def scenario_run(cl: Cluster, name: str, args: argparse.Namespace,
                 durations: Durations) -> Iterator[Run]:
    env = scenario_env(cl, name)
    stamps = env.root / "runs"
    stamps.mkdir()
    config = write_config(env)
    monitor = Monitor(env.url, cl.statements)
    try:
        with WaitSampler(cl.admin_url, env.dbname) as sampler, \
                Daemon(env, config, stamps, workers=WORKERS) as daemon:
            log(f"{name}: daemon up (pid {daemon.pid}), database {env.dbname}")
            yield Run(name, env, args, durations, monitor, sampler, RunFiles(stamps), daemon)
    finally:
        monitor.close()


def start_producer(run: Run, stack: ExitStack, connections: int) -> Producer:
    producer = stack.enter_context(Producer(run.env.url, connections))
    run.use_producer(producer)
    producer.phase = len(run.phases)  # the phase about to begin: its sends are its own
    producer.set_rate(run.args.rate)
    return producer

"""The pressure benchmark: jobd under the conditions that hurt PostgreSQL queues.

Usage (from the repository root)::

    .venv/bin/python bench/pressure.py                     # every scenario, about 20 minutes
    .venv/bin/python bench/pressure.py --quick             # 20 s phases, a few minutes
    .venv/bin/python bench/pressure.py --scenarios baseline,idle_in_tx
    python -m bench.pressure --duration 90 --rate 400 --producers 4

It starts a throwaway PostgreSQL cluster (``jobd.localpg.throwaway_cluster``: a free port, a
temp directory, removed at the end) with ``synchronous_commit=on`` and ``pg_stat_statements``.
Each scenario gets a database of its own, migrated with ``jobd migrate``, and a daemon of its
own, ``jobd run -c CONFIG`` with one lane of 2 workers x concurrency 10 and the no-op handler
``bench.pressure_handlers:noop`` (this repository on ``PYTHONPATH``). The benchmark talks to
jobd only through its public surface: those two commands, ``SELECT jobd.enqueue(...)`` (and
the documented bulk call ``jobd.enqueue_many`` for the overload's backlog), the ``jobd.jobs``
table and the ``jobd.all_jobs`` view.

The load is an open-loop producer (``--rate`` jobs/s, default 400, from ``--producers``
autocommit connections, default 4), every send on a fixed schedule and timestamped
(bench/pressure_load.py); each phase restarts the schedule, and the sends a phase could not
make by its end are reported and dropped rather than sent in the next phase. The scenarios,
modelled on the phases of the public hardbyte/postgresql-job-queue-benchmarking harness:

enqueue
    Closed loop: pgbench runs single-job ``SELECT jobd.enqueue(...)`` against a bare
    ``INSERT ... RETURNING id`` into a table of jobd.jobs's shape (``LIKE jobd.jobs INCLUDING
    ALL``: its columns, defaults, checks and indexes, no trigger, so no NOTIFY), from 4 and 8
    connections, alternately, with the daemon up (its LISTEN connection is what NOTIFY
    delivers to). The jobs go to a lane the daemon does not serve, so no worker competes for
    the CPU with the contenders; they are counted against pgbench's figure, then deleted.
    Open loop: the producer at ``--rate`` from 4 and from 8 connections into the served lane,
    for call time (send to return) p50/p99 and the share of late sends (a send is late when
    it goes out more than 1 ms after it was due, because the previous one on its connection
    had not returned).
baseline
    The producer at ``--rate``, nothing else (60 s).
idle_in_tx
    A clean lead phase, then a session that runs ``BEGIN; SELECT txid_current();`` and sits
    for the held phase (180 s), then a recovery phase.
active_readers
    A clean lead phase, then 4 REPEATABLE READ sessions, each scanning ``jobd.all_jobs``
    (``count(*)``, 100 ms apart) inside one transaction for the whole held phase (180 s), then
    a recovery phase.
overload
    First, on the fresh table, a backlog of 20,000 jobs is enqueued at once
    (``jobd.enqueue_many``, see ``measure_drain``), twice; the faster drain (first claim to
    last finish) is the clean drain rate. Then a clean lead phase, then the producer offers
    1.5x the drain rate for a minute, several jobs per statement (at most 25 statements/s per
    connection: the enqueue's commits, not the workers, would otherwise set the pace); then
    ``--rate`` again until the backlog is gone (the backlog phase, whose done/s is the
    backlog drain rate); then a recovery phase.

Every phase but the warm-up is reported. ``--duration S`` sets every phase to S seconds
(recovery at most 60, lead at most 30); ``--quick`` is ``--duration 20`` with shorter
closed loops.

Pickup delay. jobd records no claim time once a job is finished: the archive keeps
``run_at``, ``created_at`` and ``finished_at``, and ``lease_until`` lives only while the job is
claimed. But every claim sets ``lease_until = now() + visibility_timeout`` (the database clock)
and hands it to the handler on the job. So the no-op handler appends ``id lease_until
start_time`` to a file of its process, one ``os.write`` (bench/pressure_handlers.py), and the
pickup delay is ``lease_until - visibility_timeout - run_at``: both ends the database's own
clock, no round trip per job. (Writing a row per job through the handler's own connection
would add a transaction per job to the very thing measured.) A job the worker gave back
unstarted and claimed again counts from its last claim. Pickup figures are per phase of
*sending*: the jobs enqueued while the phase ran.

Per phase it prints: offered/s (jobs sent / phase seconds) and done/s (``jobd.all_jobs`` rows
with state done whose ``finished_at`` falls in the phase), pickup p50/p95/p99/max, the backlog
at its end (``jobd.jobs`` rows not claimed), ``n_dead_tup`` of jobd.jobs, its heap and index
sizes, index entries read per claim (the change in ``pg_stat_user_indexes.idx_tup_read`` of
the claim index ``jobs_claimable_idx`` divided by the calls of the claim statement in
``pg_stat_statements``, and per claimed job), the enqueue call time and late share, the CPU
other processes on the machine used meanwhile, and the top wait events (``pg_stat_activity``
sampled every 100 ms from another database, active backends only, no wait event = CPU, by
kind of backend: producer, worker, supervisor, reader). At the end of each scenario its
database checks that every sent job is done exactly once (bench/pressure_stats.py); at the
end of the run one verdict line per target. Results: ``bench/results/pressure-<date>.json``
and ``.md`` (``-quick`` added for ``--quick`` runs). bench/README.md explains every figure.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import jobd
from bench.daemon_bench import Daemon, Env, LoadMeter, log, source_revision
from bench.pressure_load import (
    IdleInTransaction,
    Producer,
    Readers,
    WaitSampler,
    batch_for,
)
from bench.pressure_report import finish_scenario, write_results
from bench.pressure_stats import Monitor, RunFiles, parse_runs
from jobd.localpg import find_bindir, throwaway_cluster

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
SCENARIOS = ("enqueue", "baseline", "idle_in_tx", "active_readers", "overload")
HANDLER = "noop"
HANDLER_PATH = f"bench.pressure_handlers:{HANDLER}"
LANE = "default"
CLOSED_LANE = "pressure_closed"  # no worker serves it
WORKERS, CONCURRENCY = 2, 10
VISIBILITY_TIMEOUT_S = 30.0
OVERLOAD_FACTOR = 1.5
SNAPSHOT_S = 5.0  # statistics snapshots within a phase (the index-read timeline)
PROGRESS_S = 10.0
POLL_S = 0.5
DRAIN_ROUNDS = 2
DRAIN_TIMEOUT_S = 300.0
BACKLOG_TIMEOUT_S = 600.0
QUICK_S = 20.0

SERVER_SETTINGS = ["server_version", "synchronous_commit", "fsync", "wal_sync_method",
                   "shared_buffers", "max_connections", "autovacuum", "autovacuum_naptime",
                   "shared_preload_libraries"]


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


def durations_for(args: argparse.Namespace) -> Durations:
    d = args.duration if args.duration is not None else (QUICK_S if args.quick else None)
    if d is None:
        return Durations()
    base = replace(Durations(), baseline=d, held=d, overload=d, recovery=min(d, 60.0),
                   lead=min(d, 30.0), open_loop=min(d, 30.0))
    if args.quick:
        base = replace(base, warmup=3.0, closed=5.0, closed_rounds=1)
    return base


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
    with throwaway_cluster("jobd-pressure-", keep=args.keep, log=log) as local:
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


# --- the scenarios -------------------------------------------------------------------------


def scenario_baseline(run: Run) -> None:
    with ExitStack() as stack:
        start_producer(run, stack, run.args.producers)
        run.phase("warmup", "warmup", run.durations.warmup)
        run.phase("clean", "clean", run.durations.baseline)
        run.producer.set_rate(0)  # type: ignore[union-attr]
        run.wait_drained()


def scenario_held(run: Run, holder: Callable[[], Any]) -> None:
    """Lead, held (inside ``holder()``), recovery."""
    d = run.durations
    with ExitStack() as stack:
        start_producer(run, stack, run.args.producers)
        run.phase("warmup", "warmup", d.warmup)
        run.phase("lead", "clean", d.lead)
        with holder() as held:
            if isinstance(held, Readers):
                run.checks.append(held.raise_error)
            rec = run.begin("held", "held", run.args.rate)
            run.hold(rec, d.held)
            run.end(rec)
            run.checks.clear()
        rec.extra.update(describe_holder(held))
        run.phase("recovery", "recovery", d.recovery)
        run.producer.set_rate(0)  # type: ignore[union-attr]
        run.wait_drained()


def describe_holder(held: Any) -> dict[str, Any]:
    if isinstance(held, IdleInTransaction):
        return {"held_xid": held.xid}
    if isinstance(held, Readers):
        scans = sum(held.scans)
        return {"reader_scans": scans, "reader_scan_avg_ms":
                round(1000.0 * sum(held.scan_seconds) / scans, 1) if scans else None}
    return {}


def scenario_idle_in_tx(run: Run) -> None:
    scenario_held(run, lambda: IdleInTransaction(run.env.url))


def scenario_active_readers(run: Run) -> None:
    scenario_held(run, lambda: Readers(run.env.url, run.args.readers))


def scenario_overload(run: Run) -> None:
    d = run.durations
    with ExitStack() as stack:
        # The drains come first, on a table without history: the lead phase's dead tuples
        # (autovacuum has not visited yet) would slow them, and an underestimate makes the
        # overload no overload. The faster of two: other work on the machine can slow one.
        drains = [measure_drain(run, d.drain_jobs, r + 1) for r in range(DRAIN_ROUNDS)]
        drain_rate = max(drains)
        producer = start_producer(run, stack, run.args.producers)
        run.phase("warmup", "warmup", d.warmup)
        run.phase("lead", "clean", d.lead)
        rate = OVERLOAD_FACTOR * drain_rate
        batch = batch_for(rate, producer.connections)
        run.extra.update(clean_drain_per_s=round(drain_rate, 1),
                         drains_per_s=[round(x, 1) for x in drains],
                         overload_target_per_s=round(rate, 1), overload_batch=batch)
        log(f"overload: clean drain {drain_rate:,.0f} jobs/s; offering {rate:,.0f} jobs/s in "
            f"statements of {batch}")
        rec = run.begin("overload", "overload", rate)
        producer.set_rate(rate, batch)
        run.hold(rec, d.overload)
        run.end(rec)
        producer.set_rate(run.args.rate)
        threshold = max(20, int(run.args.rate * 0.05))
        rec = run.begin("backlog", "backlog", run.args.rate)
        run.hold(rec, until=lambda: backlog_cleared(run, threshold), timeout=BACKLOG_TIMEOUT_S)
        run.end(rec)
        run.phase("recovery", "recovery", d.recovery)
        producer.set_rate(0)
        run.wait_drained()


def backlog_cleared(run: Run, threshold: int) -> bool:
    run.runs.read_new()
    if run.sent - run.runs.lines > threshold:
        return False
    return run.monitor.due_unclaimed() <= threshold


def measure_drain(run: Run, jobs: int, round_no: int) -> float:
    """Jobs/s from the first claim to the last finish of ``jobs`` enqueued at once.

    The backlog goes in with ``jobd.enqueue_many`` (one COPY): its one notification names
    every job, so the supervisor wakes every worker the backlog needs. The same jobs sent as
    ``jobd.enqueue`` calls in one transaction would notify ``lane#1`` once per call, which
    PostgreSQL folds into one notification, and only one worker would drain them."""
    rec = run.begin(f"drain_{round_no}", "drain", 0.0)
    run.runs.read_new()  # everything before the backlog has been read: what follows is its
    with psycopg.connect(run.env.url, autocommit=True,
                         application_name="pressure-prefill") as conn:
        ids = jobd.enqueue_many(conn, [jobd.JobSpec(HANDLER, {}, LANE)] * jobs)
    run.extra_sent += [(job_id, rec.index) for job_id in ids]
    first_claim = float("inf")
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        run.check()
        for _, lease_until, _ in parse_runs(run.runs.read_new()):
            first_claim = min(first_claim, lease_until - VISIBILITY_TIMEOUT_S)
        if run.runs.lines >= run.sent and run.monitor.backlog()[1] == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the drain of {jobs} jobs did not finish in "
                               f"{DRAIN_TIMEOUT_S:g}s")
        time.sleep(0.05)
    run.end(rec)
    row = run.monitor.conn.execute(
        "SELECT extract(epoch FROM max(finished_at))::float8, count(*) FROM jobd.all_jobs "
        "WHERE id = ANY(%s) AND state = 'done'", (ids,)).fetchone()
    assert row is not None
    last_finish, done = row
    if done != jobs:
        raise RuntimeError(f"the drain finished {done} of {jobs} jobs")
    seconds = last_finish - first_claim
    rec.extra.update(drain_jobs=jobs, drain_seconds=round(seconds, 3),
                     drain_per_s=round(jobs / seconds, 1))
    log(f"overload: drain {round_no}: {jobs} jobs in {seconds:.2f}s = {jobs / seconds:,.0f}/s")
    return jobs / seconds


def scenario_enqueue(run: Run) -> None:
    d = run.durations
    closed: list[dict[str, Any]] = []
    for round_no in range(d.closed_rounds):
        order = [(c, kind) for c in run.args.enqueue_connections
                 for kind in ("insert", "enqueue")]
        if round_no % 2:
            order.reverse()  # drift over the run must not favour one contender
        for clients, kind in order:
            closed.append(closed_loop(run, kind, clients, d.closed, round_no + 1))
    run.extra["closed_loop"] = closed
    for connections in run.args.enqueue_connections:
        with ExitStack() as stack:
            start_producer(run, stack, connections)
            run.phase(f"warmup_c{connections}", "warmup", d.warmup)
            run.phase(f"open_c{connections}", "open", d.open_loop)
            run.producer.set_rate(0)  # type: ignore[union-attr]
            run.wait_drained()


_CLOSED_SCRIPTS = {
    "enqueue": f"SELECT jobd.enqueue('noop', '{{}}', '{CLOSED_LANE}');\n",
    "insert": "INSERT INTO pressure.plain_jobs (lane, handler, payload) "
              f"VALUES ('{CLOSED_LANE}', 'noop', '{{}}') RETURNING id;\n",
}
_CLOSED_COUNT = {
    "enqueue": "SELECT count(*) FROM jobd.jobs WHERE lane = 'pressure_closed'",
    "insert": "SELECT count(*) FROM pressure.plain_jobs",
}
_CLOSED_CLEANUP = {
    "enqueue": ["DELETE FROM jobd.jobs WHERE lane = 'pressure_closed'", "VACUUM jobd.jobs"],
    "insert": ["TRUNCATE pressure.plain_jobs"],
}


def closed_loop(run: Run, kind: str, clients: int, seconds: float,
                round_no: int) -> dict[str, Any]:
    """pgbench: one statement per transaction, ``clients`` connections, for ``seconds``."""
    script = run.env.config_dir / f"closed_{kind}.sql"
    script.write_text(_CLOSED_SCRIPTS[kind])
    command = [str(run.env.pgbench), "--no-vacuum", "--protocol=prepared", f"--file={script}",
               f"--client={clients}", f"--jobs={min(clients, os.cpu_count() or 1)}",
               f"--time={max(1, round(seconds))}", run.env.url]
    environ = dict(os.environ, PGOPTIONS="-c synchronous_commit=on")
    rec = run.begin(f"closed_{kind}_c{clients}_r{round_no}", "closed", 0.0)
    done = subprocess.run(command, capture_output=True, text=True, env=environ)
    run.end(rec)
    output = done.stdout + done.stderr
    figures = parse_pgbench(output)
    if done.returncode != 0 or "processed" not in figures:
        raise RuntimeError(f"pgbench failed (exit {done.returncode}):\n{output}")
    rows = run.monitor.conn.execute(_CLOSED_COUNT[kind]).fetchone()
    assert rows is not None
    for statement in _CLOSED_CLEANUP[kind]:
        run.monitor.conn.execute(statement)
    result = {"kind": kind, "clients": clients, "round": round_no, "phase": rec.index,
              "rows": int(rows[0]), **figures}
    rec.extra.update(result)
    log(f"enqueue closed loop: {kind} x{clients}: {figures['tps']:,.0f}/s "
        f"(latency avg {figures.get('latency_ms', float('nan')):.2f} ms, rows {rows[0]})")
    return result


def parse_pgbench(output: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for line in output.splitlines():
        if line.startswith("number of transactions actually processed:"):
            figures["processed"] = float(line.split(":")[1].split("/")[0])
        elif line.startswith("number of failed transactions:"):
            figures["failed"] = float(line.split(":")[1].split()[0])
        elif line.startswith("latency average"):
            figures["latency_ms"] = float(line.split("=")[1].split()[0])
        elif line.startswith("tps =") and "without initial connection time" in line:
            figures["tps"] = float(line.split("=")[1].split()[0])
    return figures


RUNNERS: dict[str, Callable[[Run], None]] = {
    "enqueue": scenario_enqueue, "baseline": scenario_baseline,
    "idle_in_tx": scenario_idle_in_tx, "active_readers": scenario_active_readers,
    "overload": scenario_overload,
}


# --- the command line ----------------------------------------------------------------------


def _scenarios(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown scenario {', '.join(unknown) or '(none)'}; choose from "
            f"{','.join(SCENARIOS)}")
    return [n for n in SCENARIOS if n in names]  # always in the documented order


def _connections(text: str) -> list[int]:
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 4,8: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers such as 4,8: {text!r}")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/pressure.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS),
                        metavar="A,B", help=f"scenarios to run (default: all: "
                        f"{','.join(SCENARIOS)})")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="length of every phase in seconds (default: 60 s baseline and "
                             "overload, 180 s held phases, 60 s recovery, 30 s lead and open "
                             "loop)")
    parser.add_argument("--quick", action="store_true",
                        help="20 s phases and one short closed-loop round: a few minutes in "
                             "all")
    parser.add_argument("--rate", type=float, default=400.0,
                        help="jobs/s the open-loop producer offers (default 400)")
    parser.add_argument("--producers", type=int, default=4,
                        help="autocommit connections of the producer (default 4)")
    parser.add_argument("--enqueue-connections", type=_connections, default=[4, 8],
                        metavar="N,M", help="connections of the enqueue scenario's closed "
                                            "and open loops (default 4,8)")
    parser.add_argument("--readers", type=int, default=4,
                        help="REPEATABLE READ readers in active_readers (default 4)")
    parser.add_argument("--claim-index", default="jobs_claimable_idx",
                        help="the index of jobd.jobs the claim walks (default "
                             "jobs_claimable_idx; if absent, every index but the primary "
                             "key counts)")
    parser.add_argument("--no-statements", dest="statements", action="store_false",
                        help="do not load pg_stat_statements (index reads are then given "
                             "per claimed job only)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (daemon logs, handler files, cluster)")
    parser.add_argument("--no-results", dest="results", action="store_false",
                        help="do not write bench/results/pressure-<date>.json and .md")
    args = parser.parse_args(argv)
    if args.duration is not None and args.duration < 5:
        parser.error("--duration must be at least 5 seconds")
    if args.rate <= 0 or args.producers < 1 or args.readers < 1:
        parser.error("--rate, --producers and --readers must be positive")
    return args


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    durations = durations_for(args)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "source": source_revision(), "cores": os.cpu_count(),
        "load_average_at_start": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items()}, "durations": vars(durations),
        "workers": WORKERS, "concurrency": CONCURRENCY,
        "visibility_timeout_s": VISIBILITY_TIMEOUT_S,
    }
    results: list[dict[str, Any]] = []
    with cluster(args) as cl:
        meta["server"] = cl.settings
        for name in args.scenarios:
            with scenario_run(cl, name, args, durations) as run:
                RUNNERS[name](run)
            results.append(finish_scenario(run))
    meta["seconds"] = round(time.monotonic() - started)
    write_results(meta, results, RESULTS_DIR if args.results else None, quick=args.quick)
    log(f"done in {meta['seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

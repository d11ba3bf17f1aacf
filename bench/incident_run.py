"""The incident drill in progress: a PostgreSQL server whose clock the drill moves, one jobd
node, a real Prometheus with the shipped alert rules, steady traffic, the herd and the poison.

The pieces, in the order the drill uses them:

- ``clock_cluster``: a throwaway cluster (``jobd.localpg``) whose server processes run under
  libfaketime, the offset read from a file (``FAKETIME_TIMESTAMP_FILE``, at most a second
  old) that ``Clock.set`` rewrites; ``FAKETIME_DONT_FAKE_MONOTONIC`` keeps the monotonic
  clock real, as an NTP step or a resumed VM would: only the wall clock moves.
- ``Setup``: the database (``jobd migrate``), the config (one lane, four handlers), the herd
  (``jobd.enqueue_many``, ``run_at`` an hour ahead by the database clock), the daemon
  (bench/daemon_bench.py's ``Daemon``), Prometheus (bench/incident_prom.py) and the steady
  producers (bench/pressure_load.py's ``Producer``, one per handler).
- ``Drill.run``: baseline, then the cause (the jump and the poison at once), the watch (every
  0.5 s: alerts, the herd left, the DLQ), the mitigation an on-call would run, the drain.
- ``Drill.collect``: what Prometheus recorded (the chart's series, the alerts' pending and
  firing times) and what the database says (pickup per handler by window, the poison's
  crashes and deaths), into one record that bench/incident_report.py writes out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

import jobd
from bench.daemon_bench import Daemon, Env, log
from bench.incident_prom import Prometheus
from bench.pressure_load import Producer
from jobd.config import parse as parse_config
from jobd.errors import ConfigError
from jobd.localpg import LocalCluster, find_bindir, free_port, throwaway_cluster

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "contrib" / "prometheus" / "alerts.yml"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
DBNAME = "incident"
LANE = "default"
HERD, POISON = "herd", "poison"
STEADY = ("email", "thumbnail")
HANDLERS = {HERD: "bench.pressure_handlers:noop", "email": "bench.incident_handlers:work",
            "thumbnail": "bench.incident_handlers:work",
            POISON: "bench.incident_handlers:poison"}
JUMP = timedelta(hours=1)
WATCH_S = 0.5
HERD_CHUNK = 5000
DLQ_ALERT = "JobdDeadLetterQueueGrowing"
STEADY_DONE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Settings:
    fairness: str  # "on": fair_by: handler; "off": fair_by: none (or the key left out)
    herd: int = 50_000
    workers: int = 2
    concurrency: int = 4
    steady_rate: float = 20.0  # jobs/s per steady handler
    steady_ms: float = 20.0
    poison_every_s: float = 2.0  # 0: no poison (the herd alone)
    baseline_s: float = 40.0
    mitigate_by_s: float = 60.0  # act without an alert this long after the cause
    mitigate: bool = True  # False: the runbook is not run, the lane is left to itself
    drain_timeout_s: float = 200.0
    tail_s: float = 15.0
    interval_s: float = 2.0  # Prometheus scrape and rule evaluation
    slo_pickup_s: float = 5.0
    max_attempts: int = 3
    # The lane's max_crashes: a poison job is dead-lettered at its second crash alone,
    # before its max_attempts run out.
    max_crashes: int = 2
    rules: Path = RULES
    keep: bool = False


class DrillError(RuntimeError):
    """The drill could not run; the message says why."""


# --- the server's clock --------------------------------------------------------------------


@dataclass
class Clock:
    """The offset file libfaketime reads for the server's processes (at most a second old)."""

    path: Path

    def set(self, offset: str) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, self.path)  # atomic: a server process never reads half a line


@contextmanager
def clock_cluster(keep: bool) -> Iterator[tuple[LocalCluster, Clock]]:
    if not LIBFAKETIME.exists():
        raise DrillError(f"{LIBFAKETIME} is missing: apt-get install libfaketime")
    with throwaway_cluster("jobd-incident-", start=False, keep=keep, log=log) as cluster:
        clock = Clock(cluster.datadir.parent / "faketime.rc")
        clock.set("+0")
        cluster.server_env = {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(clock.path),
            # Re-read the file at most once a second, so every server process sees the jump
            # within a second. Not on every call (FAKETIME_NO_CACHE): libfaketime reads it
            # with fopen(), which is not async-signal-safe, and PostgreSQL reads the clock in
            # its SIGALRM handler. A timeout's signal that landed inside the fopen() of a
            # clock call deadlocked the backend on glibc's stream-list lock: a producer's
            # enqueue hung, and the server could not shut down.
            "FAKETIME_CACHE_DURATION": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
        cluster.start()
        try:
            yield cluster, clock
        finally:
            _checkpoint(cluster)


def _checkpoint(cluster: LocalCluster) -> None:
    """An immediate checkpoint before the cluster stops. The step of the clock starts a timed
    checkpoint (checkpoint_timeout passed, by the server's clock), spread over minutes; the
    shutdown waits for it and pg_ctl gives up after 60 s unless it is hurried along."""
    if not cluster.running():
        return
    try:
        with psycopg.connect(cluster.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error as exc:  # the stop that follows reports what is wrong
        log(f"the checkpoint before stopping the cluster failed: {exc}")


def db_offset(url: str) -> float:
    """The database clock minus this machine's, in seconds (midpoint of the round trip)."""
    with psycopg.connect(url, autocommit=True) as conn:
        before = time.time()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        after = time.time()
    assert row is not None
    return float(row[0]) - (before + after) / 2


# --- the setup -----------------------------------------------------------------------------


def fairness_supported() -> bool:
    """Whether this jobd knows the lane key ``fair_by``."""
    text = f"handlers: {{h: m:f}}\nlanes:\n  {LANE}: {{fair_by: handler}}\n"
    try:
        parse_config(text)
    except ConfigError as exc:
        if "fair_by" in str(exc):
            return False
        raise
    return True


def config_text(s: Settings, metrics_listen: str, fair_key: bool) -> str:
    lines = [
        "database:", "  schema: jobd",
        "node:", "  name: drill-1",
        "supervisor:", "  shutdown_timeout: 20s", "  log_level: info",
        f'metrics: {{listen: "{metrics_listen}"}}',
        "handlers:", *(f"  {name}: {target}" for name, target in HANDLERS.items()),
        "lanes:", f"  {LANE}:",
        f"    workers: {s.workers}", f"    concurrency: {s.concurrency}",
        "    visibility_timeout: 30s", "    heartbeat: 10s",
        f"    max_attempts: {s.max_attempts}", f"    max_crashes: {s.max_crashes}",
        "    backoff: {base: 500ms, cap: 5s}",
        f"    slo: {{pickup: {s.slo_pickup_s:g}s}}",
    ]
    if fair_key:
        lines.append(f"    fair_by: {'handler' if s.fairness == 'on' else 'none'}")
    return "\n".join(lines) + "\n"


def create_database(cluster: LocalCluster) -> tuple[str, str]:
    admin_url = make_conninfo(cluster.url, application_name="incident-admin")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DBNAME)))
    url = make_conninfo(cluster.url, dbname=DBNAME)
    migrated = subprocess.run([sys.executable, "-m", "jobd", "migrate", "--database-url", url],
                              capture_output=True, text=True)
    if migrated.returncode != 0:
        raise DrillError(f"jobd migrate failed: {migrated.stderr.strip()}")
    return admin_url, url


def enqueue_herd(url: str, count: int) -> dict[str, Any]:
    """``count`` no-op jobs due an hour from now by the database clock, in bulk."""
    started = time.monotonic()
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT now() + %s", (JUMP,)).fetchone()
        assert row is not None
        run_at = row[0]
        for first in range(0, count, HERD_CHUNK):
            size = min(HERD_CHUNK, count - first)
            jobd.enqueue_many(conn, [jobd.JobSpec(HERD, {"n": first + i}, run_at=run_at)
                                     for i in range(size)])
            conn.commit()
    return {"jobs": count, "run_at": run_at.isoformat(),
            "seconds": round(time.monotonic() - started, 2)}


# --- the drill -----------------------------------------------------------------------------


@dataclass
class Marks:
    """When things happened, in this machine's epoch seconds (the database's clock is off by
    an hour after the jump; ``offset_after`` converts)."""

    events: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def mark(self, name: str, at: float | None = None) -> float:
        at = time.time() if at is None else at
        if name not in self.events:
            self.events[name] = at
            log(f"  {name}")
        return self.events[name]


class Drill:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.marks = Marks()
        self.stack = ExitStack()

    # -- running --

    def run(self, collect: Callable[[Drill], dict[str, Any]]) -> dict[str, Any]:
        """The drill, then ``collect`` (bench/incident_stats.py) while Prometheus and the
        database still run."""
        with self.stack:
            self._setup()
            self._baseline()
            self._cause()
            self._watch()
            return collect(self)

    def _setup(self) -> None:
        s = self.s
        if s.fairness == "on" and not fairness_supported():
            raise DrillError("this jobd has no lane key fair_by: --fairness on cannot run")
        self.fair_key = fairness_supported()
        cluster, self.clock = self.stack.enter_context(clock_cluster(s.keep))
        root = cluster.datadir.parent
        self.admin_url, self.url = create_database(cluster)
        before = db_offset(self.url)
        self.marks.notes["offset_before_s"] = round(before, 3)
        if abs(before) > 5:
            raise DrillError(f"the database clock is already {before:.1f}s off this machine's")
        self.marks.notes["herd"] = enqueue_herd(self.url, s.herd)
        log(f"herd of {s.herd} enqueued in {self.marks.notes['herd']['seconds']}s")
        stamps = root / "runs"
        stamps.mkdir()
        self.stamps = stamps
        listen = f"127.0.0.1:{free_port()}"
        config = root / "jobd.yaml"
        config.write_text(config_text(s, listen, self.fair_key))
        self.config = config
        self.marks.notes["config"] = config.read_text()
        env = Env(root=root, admin_url=self.admin_url, url=self.url, config_dir=root,
                  handler_dir=REPO, pgbench=find_bindir() / "pgbench", statements=False,
                  dbname=DBNAME)
        self.prom = self.stack.enter_context(
            Prometheus(root / "prometheus", listen, s.rules, s.interval_s))
        self.daemon = self.stack.enter_context(Daemon(env, config, stamps, workers=s.workers))
        log(f"daemon up (pid {self.daemon.pid}), prometheus on :{self.prom.port}")
        self.producers = {}
        for handler in STEADY:
            producer = self.stack.enter_context(
                Producer(self.url, 1, name=f"incident-{handler}", handler=handler))
            self.producers[handler] = producer
        self.poison = self.stack.enter_context(
            Producer(self.url, 1, name="incident-poison", handler=POISON))

    def _check(self) -> None:
        if self.daemon.proc is not None and self.daemon.proc.poll() is not None:
            raise DrillError(f"the daemon exited with {self.daemon.proc.returncode}:\n"
                             f"{self.daemon.tail()}")
        for producer in (*self.producers.values(), self.poison):
            producer.raise_error()

    def _hold(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._check()
            time.sleep(min(WATCH_S, max(0.0, end - time.monotonic())))

    def _baseline(self) -> None:
        log(f"baseline: {len(STEADY)} handlers at {self.s.steady_rate:g} jobs/s each, "
            f"{self.s.baseline_s:g}s")
        self.marks.mark("start")
        for producer in self.producers.values():
            producer.set_rate(self.s.steady_rate)
        self.marks.mark("baseline_begins")
        self._hold(self.s.baseline_s)

    def _cause(self) -> None:
        log("the cause: the database server's clock jumps +1h; poison arrives")
        self.marks.notes["db_before_jump"] = self._db_now()
        self.marks.mark("cause")
        self.clock.set("+1h")
        if self.s.poison_every_s > 0:  # 0: the herd alone, the control run
            self.poison.set_rate(1.0 / self.s.poison_every_s)
        while (offset := db_offset(self.url)) < JUMP.total_seconds() - 60:
            time.sleep(0.05)
        self.marks.mark("jump_seen")
        self.marks.notes["offset_after_s"] = round(offset, 3)
        self.marks.notes["db_after_jump"] = self._db_now()

    def _db_now(self) -> str:
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        return row[0].isoformat()

    def _watch(self) -> None:
        s, marks = self.s, self.marks
        cause = marks.events["cause"]
        # Without poison (the herd alone) there is nothing to mitigate.
        mitigated, drained = s.poison_every_s == 0 or not s.mitigate, False
        with psycopg.connect(self.url, autocommit=True) as conn:
            while True:
                self._check()
                now = time.time()
                for name in self.prom.firing():
                    marks.mark(f"alert_seen:{name}", now)
                if not mitigated and (DLQ_ALERT in self.prom.firing()
                                      or now - cause >= s.mitigate_by_s):
                    self._mitigate(DLQ_ALERT in self.prom.firing())
                    mitigated = True
                if not drained and self._herd_left(conn) == 0:
                    marks.mark("herd_drained")
                    marks.notes["db_herd_drained"] = self._db_now()
                    drained = True
                if drained and mitigated:
                    break
                if now - cause > s.drain_timeout_s:
                    marks.notes["drain_timed_out"] = True
                    log(f"the herd did not drain within {s.drain_timeout_s:g}s")
                    break
                time.sleep(WATCH_S)
        log(f"tail: {s.tail_s:g}s")
        self._hold(s.tail_s)
        self.poison.pause()
        for producer in self.producers.values():
            producer.pause()
        self._wait_steady_done()
        marks.mark("end")
        self.marks.notes["db_end"] = self._db_now()

    def _wait_steady_done(self) -> None:
        """Until the steady jobs sent so far have all finished, so the counts add up."""
        deadline = time.monotonic() + STEADY_DONE_TIMEOUT_S
        with psycopg.connect(self.url, autocommit=True) as conn:
            while True:
                self._check()
                row = conn.execute("SELECT count(*) FROM jobd.jobs WHERE handler = ANY(%s)",
                                   (list(STEADY),)).fetchone()
                assert row is not None
                if row[0] == 0:
                    return
                if time.monotonic() > deadline:
                    self.marks.notes["steady_left_at_end"] = int(row[0])
                    log(f"{row[0]} steady jobs still live {STEADY_DONE_TIMEOUT_S:g}s after "
                        "the traffic stopped")
                    return
                time.sleep(0.2)

    def _herd_left(self, conn: psycopg.Connection) -> int:
        row = conn.execute("SELECT count(*) FROM jobd.jobs WHERE handler = %s",
                           (HERD,)).fetchone()
        assert row is not None
        return int(row[0])

    def _jobd(self, *args: str) -> dict[str, Any]:
        started = time.time()
        result = subprocess.run(
            [sys.executable, "-m", "jobd", *args, "-c", str(self.config), "--database-url",
             self.url, "--json"], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise DrillError(f"jobd {' '.join(args)} failed ({result.returncode}): "
                             f"{result.stderr.strip()}")
        return {"command": "jobd " + " ".join(args), "started": started,
                "seconds": round(time.time() - started, 3), "output": result.stdout.strip()}

    def _mitigate(self, by_alert: bool) -> None:
        """What the runbook says for a poison handler: pause it everywhere, then move its
        backlog to the DLQ (docs/operations.md)."""
        self.marks.mark("mitigation_begins")
        self.marks.notes["mitigation_trigger"] = (
            f"{DLQ_ALERT} firing" if by_alert else
            f"no {DLQ_ALERT} after {self.s.mitigate_by_s:g}s: acting on the DLQ depth gauge")
        pause = self._jobd("lanes", "pause", LANE, "--handler", POISON)
        self.marks.mark("poison_paused")
        quarantine = self._jobd("dlq", "quarantine", "--handler", POISON, "--lane", LANE)
        self.marks.mark("poison_quarantined")
        self.marks.notes["mitigation"] = [pause, quarantine]

"""The fault-injection soak: a handler module, the daemon config and a chaos thread.

The soak runs thousands of transactional jobs through the real daemon while :class:`Chaos`
SIGKILLs worker processes and terminates jobd's database backends. The handler notes every
execution in a per-process file before it writes its effect (an ``O_APPEND`` write survives
the process being killed a moment later, and no transaction can take it back), so duplicate
executions can be counted afterwards and set against the effect rows, which are written in
the handler's transaction.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from daemon_support import children_of, make_config

HANDLER_NAME = "effect"
LANE = "soak"

HANDLERS_MODULE = '''\
"""The soak's transactional handler: one execution line, then one effect row."""

import os
import threading
import time

import jobd

EXECUTIONS_DIR = {executions_dir!r}
_lock = threading.Lock()
_fd = None


def _executions_file():
    global _fd
    with _lock:
        if _fd is None:
            path = os.path.join(EXECUTIONS_DIR, f"{{os.getpid()}}.log")
            _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return _fd


@jobd.transactional
def effect(job, conn):
    os.write(_executions_file(), f"{{job.effect_key}} {{job.id}} {{job.attempt}}\\n".encode())
    conn.execute(
        "INSERT INTO public.soak_effects (key, job_id, attempt, pid) VALUES (%s, %s, %s, %s)",
        (job.effect_key, job.id, job.attempt, os.getpid()))
    # Hold the transaction open a moment: kills land between the effect and the commit, and
    # the chaos phase lasts long enough for its faults however fast the daemon drains.
    time.sleep(0.03)
'''

# No unique constraint on purpose: a second effect for a key must show up as a second row.
EFFECTS_TABLE = """
CREATE TABLE public.soak_effects (
    id      bigserial   PRIMARY KEY,
    key     text        NOT NULL,
    job_id  bigint      NOT NULL,
    attempt integer     NOT NULL,
    pid     integer     NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
)"""

# Connections the chaos thread may terminate: the workers' loop connections and their
# transactional handler connections (never the supervisor's, never the test's own).
TERMINATE_ONE_BACKEND = """
SELECT victim.application_name, pg_terminate_backend(victim.pid)
  FROM (SELECT pid, application_name FROM pg_stat_activity
         WHERE datname = current_database()
           AND (application_name LIKE 'jobd worker%%' OR application_name LIKE 'jobd handler%%')
         ORDER BY random() LIMIT 1) AS victim
"""


def write_handlers(directory: Path, executions_dir: Path) -> None:
    executions_dir.mkdir(parents=True, exist_ok=True)
    (directory / "soakhandlers.py").write_text(
        HANDLERS_MODULE.format(executions_dir=str(executions_dir)))


def soak_config(*, workers: int, concurrency: int) -> dict[str, Any]:
    """Short timings everywhere, so killed workers come back and orphaned jobs are
    recovered within a second or so; an attempt budget no amount of killing exhausts."""
    return make_config(
        {LANE: {
            "workers": workers,
            "concurrency": concurrency,
            "visibility_timeout": "3s",
            "heartbeat": "1s",
            "poll_interval": "1s",
            "max_attempts": 1000,
            # The chaos kills a worker about three times a second: a job killed twice while
            # it ran alone (a suspect after the first) would be dead-lettered as poison
            # (max_crashes), and this test is of one effect per job under kill -9, not of
            # the crash budget (tests/test_queue.py, tests/test_daemon.py).
            "max_crashes": 1000,
            "backoff": {"base": "50ms", "cap": "500ms"},
        }},
        supervisor={
            "restart_backoff": {"base": "50ms", "cap": "200ms"},
            "duty_interval": "500ms",
            "worker_timeout": "30s",
            "shutdown_timeout": "5s",
        },
        handlers={HANDLER_NAME: "soakhandlers:effect"},
    )


def read_executions(executions_dir: Path) -> collections.Counter[str]:
    """Executions per effect key, from every worker process's file."""
    counts: collections.Counter[str] = collections.Counter()
    for path in executions_dir.glob("*.log"):
        for line in path.read_text().splitlines():
            key = line.split(" ", 1)[0]
            if key:
                counts[key] += 1
    return counts


def ready_workers(supervisor_pid: int) -> list[int]:
    """The supervisor's worker processes that are in their main loop (past "starting")."""
    return [pid for pid, title in children_of(supervisor_pid).items()
            if title.startswith("jobd: worker") and "starting" not in title]


@dataclass
class ChaosCounts:
    kills: int = 0
    skipped: int = 0  # kill ticks without a worker old enough to kill
    terminations: int = 0
    terminated: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)


class Chaos(threading.Thread):
    """Until :meth:`stop`: every ``kill_every`` seconds (a uniform range) SIGKILLs a random
    worker that has been in its main loop for at least ``min_uptime`` seconds, and every
    ``terminate_every`` seconds (jittered by a quarter) terminates a random jobd worker or
    handler backend.

    The minimum uptime keeps the chaos from killing each worker the moment it is ready (on a
    loaded machine a worker takes a second or more to start): a worker gets to claim and run
    jobs, and is then killed in the middle of them.
    """

    def __init__(self, supervisor_pid: int, db_url: str, *, seed: int,
                 kill_every: tuple[float, float] = (0.15, 0.3), min_uptime: float = 0.5,
                 terminate_every: float = 2.0) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.supervisor_pid = supervisor_pid
        self.db_url = db_url
        self.rng = random.Random(seed)
        self.kill_every = kill_every
        self.min_uptime = min_uptime
        self.terminate_every = terminate_every
        self.ready_since: dict[int, float] = {}
        self.counts = ChaosCounts()
        self.started_at = 0.0
        self.stopped_at = 0.0
        self._stop_event = threading.Event()

    def stop(self) -> ChaosCounts:
        self._stop_event.set()
        self.join(30)
        assert not self.is_alive(), "the chaos thread did not stop"
        return self.counts

    @property
    def seconds(self) -> float:
        return (self.stopped_at or time.monotonic()) - self.started_at

    def run(self) -> None:
        self.started_at = time.monotonic()
        try:
            with psycopg.connect(self.db_url, autocommit=True,
                                 application_name="soak chaos") as conn:
                self._loop(conn)
        except Exception as exc:  # reported by the test, which checks counts.errors
            self.counts.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.stopped_at = time.monotonic()

    def _loop(self, conn: psycopg.Connection) -> None:
        now = time.monotonic()
        next_kill = now + self.rng.uniform(*self.kill_every)
        next_terminate = now + self.terminate_every * self.rng.uniform(0.75, 1.25)
        while not self._stop_event.wait(max(0.0, min(next_kill, next_terminate)
                                            - time.monotonic())):
            now = time.monotonic()
            if now >= next_kill:
                next_kill = now + self.rng.uniform(*self.kill_every)
                self._kill_a_worker()
            if now >= next_terminate:
                next_terminate = now + self.terminate_every * self.rng.uniform(0.75, 1.25)
                row = conn.execute(TERMINATE_ONE_BACKEND).fetchone()
                if row is not None and row[1]:
                    self.counts.terminations += 1
                    self.counts.terminated[str(row[0]).split("#")[0]] += 1

    def _kill_a_worker(self) -> None:
        now = time.monotonic()
        ready = ready_workers(self.supervisor_pid)
        self.ready_since = {pid: self.ready_since.get(pid, now) for pid in ready}
        candidates = [pid for pid, since in self.ready_since.items()
                      if now - since >= self.min_uptime]
        if not candidates:
            self.counts.skipped += 1
            return
        victim = self.rng.choice(candidates)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.counts.kills += 1

"""Running the real daemon (`python -m jobd run`) in tests.

A :class:`Daemon` writes a YAML config and a module of test handlers into the test's tmp_path,
starts the supervisor in a process group of its own with stderr going to a file, and reads
that file back as JSON log lines (the workers inherit the supervisor's stderr, so their lines
are there too, with ``process`` telling them apart). Every wait polls with a deadline.

The ``daemons`` fixture hands out daemons and, at the end of the test, SIGKILLs every process
of each daemon's process group and reaps the supervisor, so nothing outlives its test.

The test handlers leave their traces in the table ``public.test_effects`` of the test's
database (see :func:`create_effects_table`), through a connection of their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import yaml

from jobd.db import connect

T = TypeVar("T")

EFFECTS_URL_ENV = "JOBD_TEST_EFFECTS_URL"

HANDLERS_MODULE = '''\
"""Handlers for the daemon tests; each one leaves rows in public.test_effects."""

import os
import signal
import time

import psycopg


def _record(job, kind):
    with psycopg.connect(os.environ["JOBD_TEST_EFFECTS_URL"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO public.test_effects (job_id, handler, kind, attempt, pid)"
            " VALUES (%s, %s, %s, %s, %s)",
            (job.id, job.handler, kind, job.attempt, os.getpid()))


def ok(job):
    _record(job, "start")
    _record(job, "end")


def slow(job):
    """Sleeps payload["seconds"]; with payload["slow_attempts"], only on those attempts."""
    _record(job, "start")
    attempts = (job.payload or {}).get("slow_attempts")
    if attempts is None or job.attempt in attempts:
        time.sleep(float((job.payload or {}).get("seconds", 1)))
    _record(job, "end")


def suicide(job):
    """Kills its own worker process, every attempt."""
    _record(job, "start")
    os.kill(os.getpid(), signal.SIGKILL)


def exit_zero(job):
    """Ends its own worker process with status 0, every attempt (as a C library's exit(0))."""
    _record(job, "start")
    os._exit(0)
'''

HANDLERS = {
    "ok": "testhandlers:ok",
    "slow": "testhandlers:slow",
    "suicide": "testhandlers:suicide",
}

LANE_DEFAULTS: dict[str, Any] = {
    "workers": 1,
    "concurrency": 2,
    "heartbeat": "1s",
    "visibility_timeout": "60s",
    # High on purpose: work must arrive through wake-ups, not through the fallback poll.
    "poll_interval": "60s",
    "backoff": {"base": "100ms", "cap": "1s"},
}

SUPERVISOR_DEFAULTS: dict[str, Any] = {
    "worker_timeout": "30s",
    "shutdown_timeout": "5s",
    "duty_interval": "500ms",
}


# --- waiting -------------------------------------------------------------------------------


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.05,
               message: str | Callable[[], str] = "condition") -> T:
    """Poll ``condition`` until it returns something truthy; return that, or fail at the
    deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g}s waiting for {text}")
        time.sleep(interval)


# --- the database side ---------------------------------------------------------------------


def create_effects_table(db_url: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("""
            CREATE TABLE public.test_effects (
                id      bigserial   PRIMARY KEY,
                job_id  bigint      NOT NULL,
                handler text        NOT NULL,
                kind    text        NOT NULL,
                attempt integer     NOT NULL,
                pid     integer     NOT NULL,
                at      timestamptz NOT NULL DEFAULT clock_timestamp()
            )""")


def effects(conn: psycopg.Connection, job_id: int, kind: str | None = None
            ) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT kind, attempt, pid, at FROM public.test_effects"
        " WHERE job_id = %s AND (%s::text IS NULL OR kind = %s) ORDER BY id",
        (job_id, kind, kind)).fetchall()
    return [{"kind": r[0], "attempt": r[1], "pid": r[2], "at": r[3]} for r in rows]


def job_row(conn: psycopg.Connection, job_id: int) -> dict[str, Any]:
    cursor = conn.execute(
        "SELECT id, lane, handler, state, attempts, max_attempts, run_at, claimed_by,"
        " last_error, errors, created_at, finished_at FROM all_jobs WHERE id = %s", (job_id,))
    row = cursor.fetchone()
    assert row is not None, f"job {job_id} is nowhere"
    assert cursor.description is not None
    return {column.name: value for column, value in zip(cursor.description, row, strict=True)}


def job_state(conn: psycopg.Connection, job_id: int) -> str:
    return str(job_row(conn, job_id)["state"])


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def enqueued_when_due(conn: psycopg.Connection) -> None:
    """Make every waiting job look enqueued at its run_at, as a job due 30 s ago would have
    been: a test cannot enqueue in the past, and a job enqueued due in the past has waited
    only since its enqueue (its created_at)."""
    conn.execute("UPDATE jobd.jobs SET created_at = least(created_at, run_at)")


# --- processes -----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgrp) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def children_of(pid: int) -> dict[int, str]:
    """Live children of ``pid`` with their command lines (process titles)."""
    found = {}
    for candidate in _all_pids():
        stat = _stat(candidate)
        if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
            found[candidate] = cmdline(candidate)
    return found


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group."""
    members = []
    for candidate in _all_pids():
        stat = _stat(candidate)
        if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
            members.append(candidate)
    return members


def descendants(pid: int) -> list[int]:
    stats = {p: s for p in _all_pids() if (s := _stat(p)) is not None}
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, s in stats.items() if s[1] == parent]
        found.extend(kids)
        frontier.extend(kids)
    return found


# --- the daemon ----------------------------------------------------------------------------


def make_config(lanes: dict[str, dict[str, Any]], *, supervisor: dict[str, Any] | None = None,
                handlers: dict[str, str] | None = None) -> dict[str, Any]:
    """A config document: every lane gets LANE_DEFAULTS under what the test sets."""
    return {
        "node": {"name": "testnode"},
        "handlers": dict(HANDLERS if handlers is None else handlers),
        "supervisor": {**SUPERVISOR_DEFAULTS, **(supervisor or {})},
        "lanes": {name: {**LANE_DEFAULTS, **settings} for name, settings in lanes.items()},
    }


class Daemon:
    def __init__(self, directory: Path, db_url: str, name: str = "jobd") -> None:
        self.dir = directory
        self.db_url = db_url  # the test's database: the handlers' effects go there
        # The daemon's --database-url when it is not db_url (a pooler's, say).
        self.run_url: str | None = None
        self.config_path = directory / f"{name}.yaml"
        self.log_path = directory / f"{name}.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self._entries: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""
        (directory / "testhandlers.py").write_text(HANDLERS_MODULE)

    # config

    def write_config(self, config: dict[str, Any] | str) -> Path:
        text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        # Replace atomically: a SIGHUP must never read a half-written file.
        scratch = self.config_path.with_suffix(".tmp")
        scratch.write_text(text)
        scratch.replace(self.config_path)
        return self.config_path

    # process

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JOBD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.dir), os.environ.get("PYTHONPATH", "")) if p)
        env[EFFECTS_URL_ENV] = self.db_url
        return env

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "jobd", "run", "-c", str(self.config_path),
                "--database-url", self.run_url or self.db_url, *extra]

    def start(self, config: dict[str, Any] | str | None = None) -> Daemon:
        assert self.proc is None, "this daemon was started already"
        if config is not None:
            self.write_config(config)
        with open(self.log_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=stderr, cwd=self.dir, env=self.env(), start_new_session=True)
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signum)

    def reload(self, config: dict[str, Any] | str) -> int:
        """Write ``config`` and send SIGHUP; returns the log mark from before the signal."""
        mark = self.mark()
        self.write_config(config)
        self.signal(signal.SIGHUP)
        return mark

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the daemon did not exit within {timeout:g}s\n{self.tail()}") from None

    def stop(self) -> None:
        """SIGKILL the daemon's whole process group and reap the supervisor."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        victims = set(descendants(pgid)) if self.proc.poll() is None else set()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        wait_until(lambda: not group_members(pgid) and not any(alive(p) for p in victims),
                   timeout=30, message=f"the processes of daemon {pgid} to die")

    # logs

    def entries(self) -> list[dict[str, Any]]:
        """Every JSON log line so far (lines that are not JSON, e.g. stack dumps, skipped)."""
        try:
            with open(self.log_path, "rb") as log_file:
                log_file.seek(self._offset)
                data = log_file.read()
        except FileNotFoundError:
            return self._entries
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"{"):
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict):
                self._entries.append(entry)
        return self._entries

    def mark(self) -> int:
        """A position in the log: pass it as ``since`` to look only at later lines."""
        return len(self.entries())

    def events(self, event: str | None = None, *, process: str | None = "supervisor",
               since: int = 0, **fields: Any) -> list[dict[str, Any]]:
        found = []
        for entry in self.entries()[since:]:
            if event is not None and entry.get("event") != event:
                continue
            if process is not None and entry.get("process") != process:
                continue
            if all(entry.get(key) == value for key, value in fields.items()):
                found.append(entry)
        return found

    def wait_for_log(self, event: str, predicate: Callable[[dict[str, Any]], bool] | None = None,
                     timeout: float = 15.0, *, process: str | None = "supervisor",
                     since: int = 0, count: int = 1, **fields: Any) -> dict[str, Any]:
        """The ``count``-th log line with ``event`` (and fields, and predicate) after ``since``;
        fails at the deadline, or at once if the daemon exits first."""

        def found() -> list[dict[str, Any]] | None:
            matches = [e for e in self.events(event, process=process, since=since, **fields)
                       if predicate is None or predicate(e)]
            if len(matches) >= count:
                return matches
            if self.proc is not None and self.proc.poll() is not None:
                # One last look: the line may have been written just before the exit.
                matches = [e for e in self.events(event, process=process, since=since,
                                                  **fields)
                           if predicate is None or predicate(e)]
                if len(matches) >= count:
                    return matches
                raise AssertionError(
                    f"the daemon exited ({self.proc.returncode}) before logging {event!r}"
                    f"\n{self.tail()}")
            return None

        matches = wait_until(found, timeout,
                             message=lambda: f"log event {event!r} {fields}\n{self.tail()}")
        return matches[count - 1]

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "--- daemon log (tail) ---\n" + "\n".join(text.splitlines()[-lines:])

    # workers

    def workers(self, lane: str | None = None) -> dict[tuple[str, int], dict[str, Any]]:
        """The current worker of each (lane, slot), from "worker spawned"/"worker exited"
        lines: {"pid", "worker", "generation", ...}."""
        current: dict[tuple[str, int], dict[str, Any]] = {}
        exited = {e["pid"] for e in self.events("worker exited")}
        for entry in self.events("worker spawned"):
            if entry["pid"] in exited:
                continue
            if lane is None or entry["lane"] == lane:
                current[(entry["lane"], entry["slot"])] = entry
        return current

    def worker_pids(self, lane: str) -> dict[int, int]:
        """{slot: pid} of the lane's live (not retiring) workers, by the log."""
        retiring = {e["pid"] for e in self.events("worker retiring")}
        return {slot: entry["pid"] for (_lane, slot), entry in self.workers(lane).items()
                if entry["pid"] not in retiring}

    def wait_workers_started(self, lane: str, count: int, since: int = 0,
                             timeout: float = 15.0) -> dict[int, int]:
        """Wait until ``count`` workers of ``lane`` spawned after ``since`` say "worker
        started" (they are then about to claim); returns {slot: pid}."""
        self.wait_for_log("worker spawned", since=since, count=count, lane=lane,
                          timeout=timeout)
        pids = [e["pid"] for e in self.events("worker spawned", since=since, lane=lane)]
        wait_until(lambda: {e.get("pid") for e in self.events("worker started", process=None,
                                                              since=since)} >= set(pids),
                   timeout, message=lambda: f"workers {pids} to start\n{self.tail()}")
        return {e["slot"]: e["pid"] for e in self.events("worker spawned", since=since,
                                                         lane=lane)}

    def child_processes(self) -> dict[int, str]:
        """Live children of the supervisor with their process titles, from /proc."""
        return children_of(self.pid)


@pytest.fixture
def effects_db(db_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit connection to the test's database, with public.test_effects created."""
    create_effects_table(db_url)
    with connect(db_url) as conn:
        yield conn


@pytest.fixture
def daemons(tmp_path: Path, db_url: str) -> Iterator[Callable[..., Daemon]]:
    """``daemons(config=None, name="jobd")``: a Daemon (started when given a config); all of
    them are killed and reaped when the test ends."""
    made: list[Daemon] = []

    def make(config: dict[str, Any] | str | None = None, name: str = "jobd") -> Daemon:
        daemon = Daemon(tmp_path, db_url, name)
        made.append(daemon)
        if config is not None:
            daemon.start(config)
        return daemon

    yield make
    errors = []
    for daemon in made:
        try:
            daemon.stop()
        except Exception as exc:  # stop every daemon before reporting
            errors.append(exc)
    if errors:
        raise errors[0]

"""What the fault tests share: a transactional handler, configs, load, a private cluster and
a node under a fake clock.

The handler ``effect`` writes one row to ``public.soak_effects`` (the soak's table, see
tests/soak_support.py) inside the job's transaction and may hold that transaction open for
``payload["hold"]`` seconds, so faults land between the effect and the commit. It waits with
``threading.Event.wait``, not ``time.sleep``: under libfaketime with the monotonic clock left
alone, ``clock_nanosleep`` fails with EINVAL, and a node under a fake clock runs it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import soak_support
from daemon_support import Daemon, make_config, wait_until

import jobd
from jobd.db import connect
from jobd.jobs import JobSpec
from jobd.localpg import LocalCluster, LocalPgError, find_bindir, throwaway_cluster
from jobd.migrate import migrate

HANDLER = "effect"
LANE = "faults"

HANDLERS_MODULE = '''\
"""The fault suite's transactional handler: one effect row, then an optional hold."""

import os
import threading

import jobd


@jobd.transactional
def effect(job, conn):
    conn.execute(
        "INSERT INTO public.soak_effects (key, job_id, attempt, pid) VALUES (%s, %s, %s, %s)",
        (job.effect_key, job.id, job.attempt, os.getpid()))
    hold = float((job.payload or {}).get("hold", 0))
    if hold:
        threading.Event().wait(hold)
'''

HANDLERS = {HANDLER: "faulthandlers:effect"}

# Short leases and sweeps, so faults are healed within seconds; a budget no fault exhausts.
FAULT_LANE: dict[str, Any] = {
    "workers": 2,
    "concurrency": 4,
    "visibility_timeout": "3s",
    "heartbeat": "1s",
    "poll_interval": "1s",
    "max_attempts": 1000,
    "backoff": {"base": "50ms", "cap": "500ms"},
}
FAULT_SUPERVISOR: dict[str, Any] = {
    "restart_backoff": {"base": "50ms", "cap": "200ms"},
    "duty_interval": "500ms",
    "worker_timeout": "30s",
    "shutdown_timeout": "5s",
}


def fault_config(node: str = "testnode", *, lane: dict[str, Any] | None = None,
                 supervisor: dict[str, Any] | None = None,
                 schedules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    config = make_config({LANE: {**FAULT_LANE, **(lane or {})}},
                         supervisor={**FAULT_SUPERVISOR, **(supervisor or {})},
                         handlers=HANDLERS)
    config["node"] = {"name": node}
    if schedules:
        config["schedules"] = schedules
    return config


def prepare(daemon: Daemon) -> Daemon:
    (daemon.dir / "faulthandlers.py").write_text(HANDLERS_MODULE)
    return daemon


def create_effects_table(conn: psycopg.Connection) -> None:
    conn.execute(soak_support.EFFECTS_TABLE)


def enqueue_load(conn: psycopg.Connection, count: int, *, hold: float = 0.0,
                 prefix: str = "fault") -> list[int]:
    """``count`` transactional jobs of the fault lane, half of them with an idempotency key
    (their effect key), half without (``jobd:job:<id>``)."""
    specs = [JobSpec(HANDLER, {"n": n, "hold": hold}, lane=LANE,
                     idempotency_key=f"{prefix}-{n}" if n % 2 else None)
             for n in range(count)]
    return jobd.enqueue_many(conn, specs)


def scalar(conn: psycopg.Connection, statement: str, params: Any = None) -> Any:
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return row[0]


def done_count(conn: psycopg.Connection, ids: list[int]) -> int:
    return int(scalar(conn, "SELECT count(*) FROM jobd.jobs_archive WHERE id = ANY(%s)",
                      (ids,)))


def wait_all_done(conn: psycopg.Connection, ids: list[int], timeout: float,
                  *daemons: Daemon) -> None:
    def left() -> str:
        rows = conn.execute("SELECT state, count(*) FROM jobd.jobs WHERE id = ANY(%s)"
                            " GROUP BY state", (ids,)).fetchall()
        tails = "\n".join(d.tail(15) for d in daemons)
        return f"all {len(ids)} jobs to finish; left: {dict(rows)}\n{tails}"

    wait_until(lambda: done_count(conn, ids) == len(ids), timeout, interval=0.2,
               message=left)


def claimed_by_node(conn: psycopg.Connection, node: str) -> int:
    """Jobs claimed by workers of ``node`` (worker ids start with the node name)."""
    return int(scalar(conn, "SELECT count(*) FROM jobd.jobs WHERE state = 'claimed'"
                            " AND claimed_by LIKE %s", (f"{node}%",)))


# --- a private cluster -----------------------------------------------------------------


@pytest.fixture
def private_cluster_factory() -> Iterator[Callable[..., LocalCluster]]:
    """``make(**settings)``: a started throwaway cluster with those server settings and the
    jobd schema migrated; all of them are stopped and removed at the end."""
    try:
        find_bindir()
    except LocalPgError as exc:
        pytest.skip(f"needs the PostgreSQL server binaries (Debian package postgresql): {exc}")
    with contextlib.ExitStack() as clusters:

        def make(**settings: str) -> LocalCluster:
            cluster = clusters.enter_context(
                throwaway_cluster("jobd-fault-pg-", settings=settings))
            with connect(cluster.url, autocommit=True) as conn:
                migrate(conn, "jobd")
            return cluster

        yield make


# --- a node under a fake clock ---------------------------------------------------------

FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def faketime_library() -> str:
    """The libfaketime preload library, or a skip naming the Debian package."""
    candidates = [FAKETIME_LIBRARY, *sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))]
    for candidate in candidates:
        if Path(candidate).exists():
            return str(candidate)
    pytest.skip("needs libfaketime (Debian package faketime)"
                + ("" if shutil.which("faketime") else "; the faketime binary is missing too"))


# libfaketime 0.9.10 with the monotonic clock left alone fails clock_nanosleep on it with
# EINVAL, which is how time.sleep (and subprocess.Popen.wait) sleep; under the fake clock,
# sleeps wait in select() instead, which it leaves alone.
SLEEP_SHIM = '''\
"""Loaded at start-up under the fault suite's fake clock (see tests/faults/fault_support)."""

import select
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        select.select([], [], [], left)


time.sleep = _sleep
'''


def replace_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, whole."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(text)
    scratch.replace(path)


class FakeClock:
    """The wall clock of one daemon and its workers: an offset from the real clock, read
    from a file on every call, so the test can step it while the node runs. The monotonic
    clock is left alone, as an NTP step leaves it."""

    def __init__(self, directory: Path, offset_seconds: float = 0.0) -> None:
        self.library = faketime_library()
        self.path = directory / f"faketime-{id(self)}.spec"
        self.site = directory / "faketime-site"
        self.site.mkdir(exist_ok=True)
        # Nodes share the directory, and one may be starting (importing the shim) while the
        # next node's clock is made: a file truncated and rewritten in place could be read
        # empty, leaving that node with the real time.sleep.
        replace_atomically(self.site / "sitecustomize.py", SLEEP_SHIM)
        self.set(offset_seconds)

    def set(self, offset_seconds: float) -> None:
        replace_atomically(self.path, f"{offset_seconds:+.0f}\n")

    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": self.library, "FAKETIME_TIMESTAMP_FILE": str(self.path),
                "FAKETIME_NO_CACHE": "1", "DONT_FAKE_MONOTONIC": "1"}


def run_under(daemon: Daemon, clock: FakeClock) -> Daemon:
    environment = daemon.env()
    path = os.pathsep.join(p for p in (str(clock.site), environment.get("PYTHONPATH")) if p)
    daemon.env = lambda: {**environment, **clock.env(),  # type: ignore[method-assign]
                          "PYTHONPATH": path}
    return daemon


def logged_clock_skew(daemon: Daemon) -> float:
    """How far ahead of ours the node's wall clock ran when it wrote its latest log line
    (structlog stamps every line with it); the line may be a few seconds old."""
    stamps = [e["timestamp"] for e in daemon.entries() if "timestamp" in e]
    assert stamps, f"no log line with a timestamp\n{daemon.tail()}"
    return datetime.fromisoformat(str(stamps[-1]).replace("Z", "+00:00")).timestamp() \
        - time.time()

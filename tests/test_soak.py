"""The exactly-once soak: 10,000 transactional jobs through the real daemon under faults.

While the jobs run, a chaos thread SIGKILLs a random worker process several times per second
and terminates a random jobd database backend every couple of seconds. Killed workers come
back after a short restart backoff, their jobs are failed and retried, jobs whose worker lost
its connection are retried or recovered by the lease sweep. Jobs are executed more than once —
the handler notes every execution outside its transaction, and the test requires that this
happened — yet every job leaves exactly one effect row.

Run it alone and see its figures with ``.venv/bin/pytest tests/test_soak.py -rP``.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import daemon_support
import psycopg
import pytest
import soak_support
from daemon_support import Daemon, wait_until
from faults.invariants import assert_invariants
from soak_support import Chaos

import jobd
from jobd.jobs import JobSpec

daemons = daemon_support.daemons

pytestmark = pytest.mark.slow

JOBS = 10_000
WORKERS = 4
CONCURRENCY = 8
# Chaos stops when this many jobs are left (or after CHAOS_BUDGET seconds); the rest run
# undisturbed so the test can wait for a quiet end.
CHAOS_UNTIL_REMAINING = 300
CHAOS_BUDGET = 150.0
FINAL_DEADLINE = 90.0
MIN_KILLS = 20


def scalar(conn: psycopg.Connection, sql: str) -> int:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def test_ten_thousand_jobs_under_sigkill_and_backend_termination_have_one_effect_each(
    tmp_path: Path, db_url: str, conn: psycopg.Connection, daemons: Callable[..., Daemon]
) -> None:
    seed = int(os.environ.get("JOBD_SOAK_SEED", random.randrange(2**32)))
    executions_dir = tmp_path / "executions"
    soak_support.write_handlers(tmp_path, executions_dir)
    conn.execute(soak_support.EFFECTS_TABLE)
    ids = jobd.enqueue_many(conn, [
        JobSpec(soak_support.HANDLER_NAME, {"n": n}, lane=soak_support.LANE,
                idempotency_key=f"soak-{n:05d}")
        for n in range(JOBS)])
    assert len(set(ids)) == JOBS

    started = time.monotonic()
    daemon = daemons(soak_support.soak_config(workers=WORKERS, concurrency=CONCURRENCY),
                     name="soak")
    daemon.wait_workers_started(soak_support.LANE, WORKERS, timeout=60)
    chaos = Chaos(daemon.pid, db_url, seed=seed)
    chaos.start()
    try:
        wait_until(
            lambda: (scalar(conn, "SELECT count(*) FROM jobs") <= CHAOS_UNTIL_REMAINING
                     or chaos.seconds >= CHAOS_BUDGET or not chaos.is_alive()),
            CHAOS_BUDGET + 30, interval=0.5, message="the chaos phase to end")
    finally:
        counts = chaos.stop()
    remaining_at_calm = scalar(conn, "SELECT count(*) FROM jobs")
    assert daemon.running(), f"the supervisor died\n{daemon.tail()}"

    def left() -> str:
        rows = conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall()
        dead = scalar(conn, "SELECT count(*) FROM dead_letter")
        return f"every job to finish; left: {dict(rows)}, dead: {dead}\n{daemon.tail()}"

    wait_until(lambda: scalar(conn, "SELECT count(*) FROM jobs") == 0, FINAL_DEADLINE,
               interval=0.5, message=left)
    elapsed = time.monotonic() - started

    executions = soak_support.read_executions(executions_dir)
    total_executions = sum(executions.values())
    duplicates = total_executions - len(executions)
    report = (
        f"soak: {JOBS} jobs in {elapsed:.1f}s (chaos {chaos.seconds:.1f}s, seed {seed}): "
        f"{counts.kills} workers SIGKILLed ({counts.kills / max(chaos.seconds, 1e-9):.1f}/s, "
        f"{counts.skipped} kill ticks skipped for want of a worker up for 0.5s), "
        f"{counts.terminations} backends terminated "
        f"({dict(counts.terminated)}); {total_executions} executions, {duplicates} duplicate "
        f"executions over {sum(1 for c in executions.values() if c > 1)} keys "
        f"(at most {max(executions.values(), default=0)} for one key); "
        f"{remaining_at_calm} jobs left when the chaos stopped"
    )
    print(report)

    effects, distinct = conn.execute(
        "SELECT count(*), count(DISTINCT key) FROM public.soak_effects").fetchone() or (0, 0)
    assert (effects, distinct) == (JOBS, JOBS), report
    doubled = conn.execute(
        "SELECT key, count(*) FROM public.soak_effects GROUP BY key HAVING count(*) > 1"
        " LIMIT 5").fetchall()
    assert doubled == [], report
    assert scalar(conn, "SELECT count(*) FROM all_jobs WHERE state = 'done'"
                        f" AND handler = '{soak_support.HANDLER_NAME}'") == JOBS, report
    assert scalar(conn, "SELECT count(*) FROM jobs") == 0, report
    assert scalar(conn, "SELECT count(*) FROM dead_letter") == 0, report
    assert scalar(conn, "SELECT count(*) FROM processed_keys") == JOBS, report
    # Every effect belongs to a job, and every key was executed at least once.
    assert set(executions) == {f"soak-{n:05d}" for n in range(JOBS)}, report

    # The fault suite's invariants: nothing lost or stuck, attempts matching each job's error
    # history (every kill and termination left one entry), one effect per job.
    assert_invariants(conn, ids, context=report)

    # The faults must have happened, or the run proves nothing.
    assert counts.errors == [], report
    assert counts.kills >= MIN_KILLS, report
    assert counts.terminations >= 1, report
    assert duplicates > 0, "no job ran twice: the chaos was too weak to prove anything\n" \
        + report

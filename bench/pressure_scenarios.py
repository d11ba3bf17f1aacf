"""The scenarios of bench/pressure.py (its docstring describes them), each a function of a
``Run``, and the closed-loop enqueue comparison and the drain measurement they use."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import psycopg

import jobd
from bench.daemon_bench import log
from bench.pressure_load import IdleInTransaction, Readers, batch_for
from bench.pressure_run import (
    DRAIN_TIMEOUT_S,
    HANDLER,
    LANE,
    VISIBILITY_TIMEOUT_S,
    Run,
    start_producer,
)
from bench.pressure_stats import parse_runs

SCENARIOS = ("enqueue", "baseline", "idle_in_tx", "active_readers", "overload")
CLOSED_LANE = "pressure_closed"  # no worker serves it
OVERLOAD_FACTOR = 1.5
DRAIN_ROUNDS = 2
# Below this many jobs a backlog fits in the buffers as the clean drain's does: nothing to tell.
SAME_SIZE_MIN_JOBS = 100_000
BACKLOG_TIMEOUT_S = 600.0
# A drain the size of an overload's backlog gets as long as one at this rate takes, so a slow
# machine does not fail the scenario at DRAIN_TIMEOUT_S.
SLOWEST_DRAIN_PER_S = 1000.0


def scenario_baseline(run: Run) -> None:
    with ExitStack() as stack:
        start_producer(run, stack, run.args.producers)
        run.phase("warmup", "warmup", run.durations.warmup)
        run.phase("clean", "clean", run.durations.baseline)
        run.producer.pause()  # type: ignore[union-attr]
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
        run.producer.pause()  # type: ignore[union-attr]
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
        drains = [measure_drain(run, d.drain_jobs, f"drain_{r + 1}") for r in range(DRAIN_ROUNDS)]
        drain_rate = max(drains)
        producer = start_producer(run, stack, run.args.producers)
        run.phase("warmup", "warmup", d.warmup)
        run.phase("lead", "clean", d.lead)
        # The backlog drains beside the producer's standing load: so do these clean drains,
        # to tell that load's share of a slower backlog drain from the overload's leavings.
        loaded = [measure_drain(run, d.drain_jobs, f"drain_loaded_{r + 1}")
                  for r in range(DRAIN_ROUNDS)]
        run.extra.update(loaded_drain_per_s=round(max(loaded), 1),
                         loaded_drains_per_s=[round(x, 1) for x in loaded])
        rate = OVERLOAD_FACTOR * drain_rate
        batch = batch_for(rate, producer.connections)
        run.extra.update(clean_drain_per_s=round(drain_rate, 1),
                         drains_per_s=[round(x, 1) for x in drains],
                         overload_target_per_s=round(rate, 1), overload_batch=batch)
        log(f"overload: clean drain {drain_rate:,.0f} jobs/s; offering {rate:,.0f} jobs/s in "
            f"sends of {batch} (jobd.enqueue_many)")
        rec = run.begin("overload", "overload", rate)
        producer.set_rate(rate, batch)
        run.hold(rec, d.overload)
        run.end(rec)
        left = int(rec.extra["backlog_end"])
        producer.set_rate(run.args.rate)
        threshold = max(20, int(run.args.rate * 0.05))
        rec = run.begin("backlog", "backlog", run.args.rate)
        run.hold(rec, until=lambda: backlog_cleared(run, threshold), timeout=BACKLOG_TIMEOUT_S)
        run.end(rec)
        run.phase("recovery", "recovery", d.recovery)
        producer.pause()
        run.wait_drained()
        same_size_drain(run, left)


def same_size_drain(run: Run, jobs: int) -> None:
    """A drain of as many jobs as the overload left, with no producer, on the table vacuumed.

    The clean drain is of 20,000 jobs, a heap that fits in shared buffers; an overload's
    backlog is hundreds of thousands. This drain tells the two causes of a slower backlog
    drain apart: the backlog's size (this drain is as slow) or what the overload left
    behind, its dead rows and the producers beside it (this drain is faster)."""
    if jobs < SAME_SIZE_MIN_JOBS:
        return
    run.monitor.conn.execute("VACUUM jobd.jobs")
    rate = measure_drain(run, jobs, "drain_same_size")
    run.extra.update(same_size_drain_per_s=round(rate, 1), same_size_drain_jobs=jobs)


def backlog_cleared(run: Run, threshold: int) -> bool:
    run.runs.read_new()
    if run.sent - run.runs.lines > threshold:
        return False
    return run.monitor.due_unclaimed() <= threshold


def measure_drain(run: Run, jobs: int, name: str) -> float:
    """Jobs/s from the first claim to the last finish of ``jobs`` enqueued at once.

    The backlog goes in with ``jobd.enqueue_many`` (one COPY): its one notification names
    every job, so the supervisor wakes every worker the backlog needs. The same jobs sent as
    ``jobd.enqueue`` calls in one transaction would notify ``lane#1`` once per call, which
    PostgreSQL folds into one notification, and only one worker would drain them. Only this
    drain's own jobs are followed, so the producer may keep sending beside it."""
    rec = run.begin(name, "drain", 0.0)
    run.runs.read_new()  # everything before the backlog has been read: what follows is its
    with psycopg.connect(run.env.url, autocommit=True,
                         application_name="pressure-prefill") as conn:
        ids = jobd.enqueue_many(conn, [jobd.JobSpec(HANDLER, {}, LANE)] * jobs)
    run.extra_sent += [(job_id, rec.index) for job_id in ids]
    not_started = set(ids)
    first_claim = float("inf")
    timeout = max(DRAIN_TIMEOUT_S, jobs / SLOWEST_DRAIN_PER_S)
    deadline = time.monotonic() + timeout
    done = 0
    while True:
        run.check()
        for job_id, lease_until, _ in parse_runs(run.runs.read_new()):
            if job_id in not_started:
                not_started.discard(job_id)
                first_claim = min(first_claim, lease_until - VISIBILITY_TIMEOUT_S)
        if not not_started:
            # Every job has started; the last ones finish a moment later.
            done, last_finish = drain_finished(run, ids)
            if done == jobs:
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the drain of {jobs} jobs did not finish in {timeout:g}s "
                               f"({jobs - len(not_started)} started, {done} done)")
        time.sleep(0.05)
    run.end(rec)
    seconds = last_finish - first_claim
    rec.extra.update(drain_jobs=jobs, drain_seconds=round(seconds, 3),
                     drain_per_s=round(jobs / seconds, 1))
    log(f"overload: {name}: {jobs} jobs in {seconds:.2f}s = {jobs / seconds:,.0f}/s")
    return jobs / seconds


def drain_finished(run: Run, ids: list[int]) -> tuple[int, float]:
    """(how many of ``ids`` are done, the epoch of the last one's finish)."""
    row = run.monitor.conn.execute(
        "SELECT count(*), coalesce(extract(epoch FROM max(finished_at))::float8, 0) "
        "FROM jobd.all_jobs WHERE id = ANY(%s) AND state = 'done'", (ids,)).fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


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
            run.producer.pause()  # type: ignore[union-attr]
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
    result = {"contender": kind, "clients": clients, "round": round_no, "phase_index": rec.index,
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

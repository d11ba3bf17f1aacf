"""Throughput of jobd's queue operations next to the bare SQL that does the same durable work.

Usage::

    .venv/bin/python bench/queue_ops.py [--database-url URL] [--jobs N] [--rounds R]

Every figure is jobs per second, measured over R rounds and reported as median, min and max.
Each jobd figure is paired with a baseline that does the same work in the plainest way, and the
ratio of the medians (jobd / baseline) is printed next to it.

enqueue.single
    jobd: ``jobd.enqueue()`` N times, one job per call, on an autocommit connection (each job is
    its own committed transaction). Baseline: ``INSERT INTO jobd.jobs (handler, payload)
    VALUES (%s, %s)`` N times on another autocommit connection.
enqueue.bulk
    jobd: ``jobd.enqueue_many()`` of 20,000 ``JobSpec`` in one call. Baseline: one plain
    ``COPY jobd.jobs (handler, payload) FROM STDIN`` of the same 20,000 rows through psycopg.
    Target: jobd >= 60,000 jobs/s.
claim+complete
    jobd: client processes (one connection each) run the worker's hot path,
    ``jobd.queue.settle_and_claim()``: the completion of the previous batch and the claim of the
    next one go out in one round trip (one pipeline, still two transactions), at batch sizes 1
    and 100 and with 1 and 4 clients, against a pre-enqueued backlog. Baselines: pgbench with a
    custom script, the same client count, batch size and number of iterations per client,
    running the minimal SQL: a claim (``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP
    LOCKED)``, setting the lease columns the table's CHECK requires) followed by either a
    ``DELETE`` of the claimed rows ("bare delete") or a ``DELETE ... RETURNING`` feeding an
    ``INSERT`` into jobd.jobs_archive, which is what jobd's complete does ("bare archive"). Both
    sides commit twice per batch (claim, then done). Target: jobd >= 70 % of "bare archive" at
    the same batch size and client count, the bare SQL that does the same durable work; "bare
    delete" keeps no history, which is less work, and is printed for reference.

How it is measured:

* A scratch database is created on the server, migrated with ``jobd.migrate.migrate`` and
  dropped at the end, also on error, Ctrl-C or SIGTERM.
* Every connection (psycopg and pgbench) starts with ``-c synchronous_commit=on``, so each
  commit waits for its WAL flush whatever the server default is.
* Before every timed run the tables are truncated; for claim+complete the backlog is then
  refilled with ``enqueue_many`` (20,000 jobs plus one batch per client of slack, so every
  claim finds a full batch) and the jobs table is vacuumed and analyzed. Setup is not timed.
  The order of jobd and its baselines rotates from round to round.
* Jobs are counted in the database after each run (rows inserted, or backlog minus rows left),
  not by the clients.
* Time: enqueue runs are timed around the calls. For claim+complete the clock starts once all
  clients are connected and stops when the last one finishes: the jobd clients record their
  own start and end on the machine's monotonic clock; for pgbench it is pgbench's own
  benchmark duration (transactions processed / reported tps, connection time excluded).
* Client CPU (user + system) per job is reported beside each figure: the benchmark process for
  enqueue runs, the client processes for jobd's claim+complete, pgbench for the bare scripts.
* Output: a header with the server settings, progress on stderr, a table, then one JSON line
  per measurement (lines starting with ``{``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb

import jobd
from jobd.db import connect
from jobd.jobs import JobSpec
from jobd.migrate import migrate
from jobd.producer import enqueue, enqueue_many
from jobd.queries import query
from jobd.queue import ClaimRequest, claim, complete, settle_and_claim

SCHEMA = "jobd"
LANE = "default"
HANDLER = "bench.noop"
DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
URL_ENV = "JOBD_BENCH_DATABASE_URL"

DEFAULT_SINGLE_JOBS = 5_000
DEFAULT_ROUNDS = 5
BULK_JOBS = 20_000
BACKLOG = 20_000
BATCH_SIZES = (1, 100)
CLIENT_COUNTS = (1, 4)
# Jobs claimed and completed per timed run; batch size 1 costs two commits per job.
CLAIM_JOBS_PER_RUN = {1: 2_000, 100: 20_000}
VISIBILITY_TIMEOUT = 30.0
CLIENT_TIMEOUT = 600.0

BULK_TARGET_JOBS_PER_S = 60_000
CLAIM_TARGET_RATIO = 0.70
# The target compares jobd with the bare SQL that does the same durable work: a finished job
# is kept in the archive. "bare delete" throws the job away, less work than jobd is asked to
# do; it is printed for reference.
CLAIM_TARGET_BASELINE = "bare archive"

# --- the bare SQL ------------------------------------------------------------------------------

BARE_INSERT = "INSERT INTO jobd.jobs (handler, payload) VALUES (%s, %s)"
BARE_COPY = "COPY jobd.jobs (handler, payload) FROM STDIN"

# pgbench scripts (bench/sql/, shared by the benchmarks): claim a batch, then finish it.
CEILING_SQL = Path(__file__).resolve().parent / "sql"
CEILING_CLAIM = (CEILING_SQL / "ceiling_claim.sql").read_text()




PGBENCH_SCRIPTS = {
    "bare delete": CEILING_CLAIM + (CEILING_SQL / "ceiling_done_delete.sql").read_text(),
    "bare archive": CEILING_CLAIM + (CEILING_SQL / "ceiling_done_archive.sql").read_text(),
}


# --- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """Wall-clock seconds of a run and the CPU seconds (user + system) its clients used."""

    seconds: float
    client_cpu: float


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run: how many jobs the database shows as done, and what it took."""

    jobs: int
    timing: Timing

    @property
    def rate(self) -> float:
        return self.jobs / self.timing.seconds

    @property
    def cpu_us_per_job(self) -> float:
        return 1e6 * self.timing.client_cpu / self.jobs


@dataclass(slots=True)
class Series:
    """All rounds of one implementation of one operation."""

    operation: str
    implementation: str
    batch: int
    clients: int
    jobs_per_run: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [sample.rate for sample in self.samples]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu_us_per_job(self) -> float:
        """Median client CPU per job, in microseconds."""
        return statistics.median(sample.cpu_us_per_job for sample in self.samples)


@dataclass(slots=True)
class Comparison:
    """jobd and its baselines for one operation; the first series is jobd's."""

    jobd: Series
    baselines: list[Series]
    target_rate: float | None = None
    target_ratio: float | None = None
    # The baseline the ratio target is judged against; the others are shown for reference.
    target_baseline: str | None = None

    def ratio(self, baseline: Series) -> float:
        return self.jobd.median / baseline.median

    def judges(self, baseline: Series) -> bool:
        return self.target_ratio is not None and baseline.implementation == self.target_baseline


@dataclass(frozen=True, slots=True)
class Contender:
    """An implementation under test: untimed setup, then the timed run."""

    name: str
    prepare: Callable[[], None]
    run: Callable[[], Sample]


@dataclass(frozen=True, slots=True)
class Bench:
    """What every measurement needs: where the scratch database is and how long to run."""

    dsn: str
    conn: psycopg.Connection
    rounds: int
    pgbench: str
    scripts: dict[str, Path]  # pgbench script per bare implementation


# --- scratch database --------------------------------------------------------------------------


def scratch_dsn(admin_url: str, dbname: str) -> str:
    """The admin URL pointed at ``dbname``, with synchronous_commit forced on."""
    params = conninfo_to_dict(admin_url)
    params["dbname"] = dbname
    params["options"] = f"{params.get('options', '')} -c synchronous_commit=on".strip()
    params.setdefault("connect_timeout", 10)
    return make_conninfo(**params)


@contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    """Create an empty database, yield its name, drop it afterwards whatever happens."""
    name = f"jobd_bench_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
            log(f"dropped scratch database {name}")
        finally:
            signal.signal(signal.SIGINT, previous)


def open_bench_connection(dsn: str) -> psycopg.Connection:
    """A jobd connection (autocommit, search_path=jobd) that refuses asynchronous commits."""
    conn = connect(dsn, SCHEMA, application_name="jobd-bench")
    setting = conn.execute("SHOW synchronous_commit").fetchone()
    if setting is None or setting[0] != "on":
        conn.close()
        raise SystemExit(f"refusing to run: synchronous_commit is {setting}, not on")
    return conn


def reset_tables(conn: psycopg.Connection) -> None:
    conn.execute("TRUNCATE jobd.jobs, jobd.jobs_archive")


def refill_backlog(conn: psycopg.Connection, count: int) -> None:
    """An empty queue, then ``count`` due jobs, vacuumed and analyzed."""
    reset_tables(conn)
    enqueue_many(conn, [JobSpec(HANDLER, {"i": i}) for i in range(count)])
    conn.execute("VACUUM (ANALYZE) jobd.jobs")


def scalar(conn: psycopg.Connection, statement: str | sql.Composable) -> Any:
    row = conn.execute(statement).fetchone()
    assert row is not None
    return row[0]


def count_rows(conn: psycopg.Connection, table: str) -> int:
    statement = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(SCHEMA, table))
    return int(scalar(conn, statement))


def settings(conn: psycopg.Connection, names: Sequence[str]) -> dict[str, str]:
    rows = conn.execute(
        "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name", (list(names),)
    )
    return dict(rows.fetchall())


# --- enqueue -----------------------------------------------------------------------------------


def timed_insert_count(conn: psycopg.Connection, work: Callable[[], object]) -> Sample:
    """Run ``work`` on an empty jobs table; the sample counts the rows it left there."""
    start, cpu_start = time.perf_counter(), time.process_time()
    work()
    timing = Timing(time.perf_counter() - start, time.process_time() - cpu_start)
    return Sample(count_rows(conn, "jobs"), timing)


def enqueue_one_by_one(conn: psycopg.Connection, count: int) -> None:
    for i in range(count):
        enqueue(conn, HANDLER, {"i": i})


def insert_one_by_one(conn: psycopg.Connection, count: int) -> None:
    for i in range(count):
        conn.execute(BARE_INSERT, (HANDLER, Jsonb({"i": i})))


def copy_rows(conn: psycopg.Connection, rows: Sequence[tuple[str, Any]]) -> None:
    with conn.cursor() as cur, cur.copy(BARE_COPY) as copy:
        for handler, payload in rows:
            copy.write_row((handler, Jsonb(payload)))


def enqueue_contenders(
    bench: Bench,
    jobd_work: Callable[[psycopg.Connection], object],
    bare_name: str,
    bare_work: Callable[[psycopg.Connection], object],
) -> list[Contender]:
    """jobd's enqueue on a jobd connection against the bare statement on a plain one, each
    from empty tables, counted by the rows they inserted."""

    def run_jobd() -> Sample:
        with connect(bench.dsn, SCHEMA, application_name="jobd-bench") as conn:
            return timed_insert_count(bench.conn, lambda: jobd_work(conn))

    def run_bare() -> Sample:
        with psycopg.connect(bench.dsn, autocommit=True) as conn:
            return timed_insert_count(bench.conn, lambda: bare_work(conn))

    def prepare() -> None:
        reset_tables(bench.conn)

    return [Contender("jobd", prepare, run_jobd), Contender(bare_name, prepare, run_bare)]


def single_enqueue_contenders(bench: Bench, count: int) -> list[Contender]:
    return enqueue_contenders(bench, lambda conn: enqueue_one_by_one(conn, count),
                              "bare INSERT", lambda conn: insert_one_by_one(conn, count))


def bulk_enqueue_contenders(bench: Bench, count: int) -> list[Contender]:
    specs = [JobSpec(HANDLER, {"i": i}) for i in range(count)]
    rows = [(HANDLER, {"i": i}) for i in range(count)]
    return enqueue_contenders(bench, lambda conn: enqueue_many(conn, specs),
                              "bare COPY", lambda conn: copy_rows(conn, rows))


# --- claim + complete --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientReport:
    start: float
    end: float
    cpu: float
    error: str | None = None


def _claim_client(
    dsn: str, index: int, batch: int, iterations: int, barrier: Any, reports: Any
) -> None:
    """One jobd client process: ``iterations`` claims, each batch completed in the round trip
    that claims the next (the worker's hot path), the last one completed on its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        with connect(dsn, SCHEMA, application_name=f"jobd-bench-{index}") as conn:
            worker = f"bench-{index}"
            barrier.wait(timeout=60)
            start, cpu_start = time.perf_counter(), time.process_time()
            request = ClaimRequest(LANE, worker, batch, VISIBILITY_TIMEOUT)
            jobs = claim(conn, LANE, worker, batch, VISIBILITY_TIMEOUT)
            for _ in range(iterations - 1):
                jobs = settle_and_claim(conn, [job.lease for job in jobs], [], request)[2].jobs
            complete(conn, [job.lease for job in jobs])
            end, cpu = time.perf_counter(), time.process_time() - cpu_start
        reports.put(ClientReport(start, end, cpu))
    except BaseException as exc:
        barrier.abort()
        reports.put(ClientReport(0.0, 0.0, 0.0, f"client {index}: {exc!r}"))


def collect_reports(reports: Any, processes: Sequence[Any]) -> list[ClientReport]:
    """One report per client; fails if a client died silently or the run takes too long."""
    results: list[ClientReport] = []
    deadline = time.monotonic() + CLIENT_TIMEOUT
    while len(results) < len(processes):
        try:
            results.append(reports.get(timeout=1.0))
        except queue.Empty:
            if not any(process.is_alive() for process in processes):
                raise RuntimeError("a client process exited without reporting") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"clients still running after {CLIENT_TIMEOUT:.0f} s") from None
    return results


def run_jobd_clients(dsn: str, clients: int, batch: int, iterations: int) -> Timing:
    """From the moment all jobd clients are connected until the last one is done.

    Clients are forked, so the claim query is loaded once here and no import is repeated; their
    clocks are comparable because ``time.perf_counter`` is the system-wide monotonic clock.
    """
    query("claim_jobs")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(clients)
    reports = ctx.Queue()
    processes = [
        ctx.Process(
            target=_claim_client, args=(dsn, i, batch, iterations, barrier, reports), daemon=True
        )
        for i in range(clients)
    ]
    try:
        for process in processes:
            process.start()
        results = collect_reports(reports, processes)
    except BaseException:
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            if process.pid is not None:
                process.join()
    errors = [report.error for report in results if report.error]
    if errors:
        raise RuntimeError("; ".join(errors))
    seconds = max(r.end for r in results) - min(r.start for r in results)
    return Timing(seconds, sum(r.cpu for r in results))


_PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)
_FAILED = re.compile(r"^number of failed transactions: (\d+)", re.MULTILINE)
_TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.MULTILINE)


def run_pgbench(bench: Bench, script: Path, clients: int, batch: int, iterations: int) -> Timing:
    """pgbench's benchmark duration (transactions / tps, connection time excluded)."""
    params = conninfo_to_dict(bench.dsn)
    env = dict(os.environ)
    if "password" in params:  # keep it out of the process list
        env["PGPASSWORD"] = str(params.pop("password"))
    command = [
        bench.pgbench,
        "--no-vacuum",
        "--protocol=prepared",
        f"--file={script}",
        f"--client={clients}",
        f"--jobs={clients}",
        f"--transactions={iterations}",
        f"--define=batch={batch}",
        make_conninfo(**params),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = result.stdout + result.stderr
    processed, failed, tps = (pattern.search(output) for pattern in (_PROCESSED, _FAILED, _TPS))
    if result.returncode != 0 or not (processed and failed and tps) or int(failed[1]):
        raise RuntimeError(f"pgbench failed (exit {result.returncode}):\n{output}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Timing(int(processed[1]) / float(tps[1]), cpu)


def write_pgbench_scripts(directory: Path) -> dict[str, Path]:
    paths = {}
    for name, script in PGBENCH_SCRIPTS.items():
        paths[name] = directory / f"{name.replace(' ', '_')}.sql"
        paths[name].write_text(script, encoding="utf-8")
    return paths


def claim_contenders(bench: Bench, batch: int, clients: int, jobs: int) -> list[Contender]:
    """jobd and the two bare pgbench scripts, each claiming and finishing ``jobs`` jobs."""
    if jobs % (batch * clients):
        raise ValueError(f"{jobs} jobs do not split into batches of {batch} for {clients}")
    iterations = jobs // (batch * clients)
    backlog = BACKLOG + batch * clients

    def prepare() -> None:
        refill_backlog(bench.conn, backlog)

    def measured(run: Callable[[], Timing], archives: bool) -> Callable[[], Sample]:
        def timed() -> Sample:
            timing = run()
            left = count_rows(bench.conn, "jobs")
            archived = count_rows(bench.conn, "jobs_archive")
            claimed = scalar(bench.conn, "SELECT count(*) FROM jobd.jobs WHERE state = 'claimed'")
            done = backlog - left
            if claimed or archived != (done if archives else 0):
                raise RuntimeError(
                    f"inconsistent result: {done} done, {archived} archived, {claimed} claimed"
                )
            return Sample(done, timing)

        return timed

    contenders = [
        Contender(
            "jobd",
            prepare,
            measured(lambda: run_jobd_clients(bench.dsn, clients, batch, iterations), True),
        )
    ]
    for name, path in bench.scripts.items():
        run = measured(
            lambda path=path: run_pgbench(bench, path, clients, batch, iterations),
            name == "bare archive",
        )
        contenders.append(Contender(name, prepare, run))
    return contenders


# --- running -----------------------------------------------------------------------------------


def measure(
    bench: Bench,
    operation: str,
    batch: int,
    clients: int,
    jobs: int,
    contenders: Sequence[Contender],
) -> list[Series]:
    """Every contender once per round, the order rotating so none always runs first."""
    series = {c.name: Series(operation, c.name, batch, clients, jobs) for c in contenders}
    for round_index in range(bench.rounds):
        shift = round_index % len(contenders)
        for contender in [*contenders[shift:], *contenders[:shift]]:
            contender.prepare()
            sample = contender.run()
            series[contender.name].samples.append(sample)
            log(
                f"{operation:<15} batch={batch:<5} clients={clients} "
                f"round {round_index + 1}/{bench.rounds} {contender.name:<12} "
                f"{sample.jobs:>6} jobs in {sample.timing.seconds:7.3f} s = "
                f"{sample.rate:>9,.0f} jobs/s, client CPU {sample.cpu_us_per_job:6.0f} us/job"
            )
    return [series[c.name] for c in contenders]


def run_all(bench: Bench, single_jobs: int, parts: Sequence[str]) -> list[Comparison]:
    comparisons = []
    if "single" in parts:
        jobd_series, bare = measure(
            bench,
            "enqueue.single",
            1,
            1,
            single_jobs,
            single_enqueue_contenders(bench, single_jobs),
        )
        comparisons.append(Comparison(jobd_series, [bare]))
    if "bulk" in parts:
        jobd_series, bare = measure(
            bench,
            "enqueue.bulk",
            BULK_JOBS,
            1,
            BULK_JOBS,
            bulk_enqueue_contenders(bench, BULK_JOBS),
        )
        comparisons.append(Comparison(jobd_series, [bare], target_rate=BULK_TARGET_JOBS_PER_S))
    if "claim" in parts:
        for batch in BATCH_SIZES:
            for clients in CLIENT_COUNTS:
                jobs = CLAIM_JOBS_PER_RUN[batch]
                jobd_series, *bares = measure(
                    bench,
                    "claim+complete",
                    batch,
                    clients,
                    jobs,
                    claim_contenders(bench, batch, clients, jobs),
                )
                comparisons.append(Comparison(jobd_series, bares, target_ratio=CLAIM_TARGET_RATIO,
                                              target_baseline=CLAIM_TARGET_BASELINE))
    return comparisons


# --- reporting ---------------------------------------------------------------------------------


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def describe_environment(conn: psycopg.Connection, admin_url: str, pgbench: str) -> dict[str, Any]:
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as admin:
        server_default = settings(admin, ["synchronous_commit"])["synchronous_commit"]
    current = settings(
        conn, ["server_version", "synchronous_commit", "shared_buffers", "fsync", "wal_sync_method"]
    )
    version = subprocess.run([pgbench, "--version"], capture_output=True, text=True, check=True)
    return {
        "server_version": current["server_version"],
        "synchronous_commit": current["synchronous_commit"],
        "synchronous_commit_server_default": server_default,
        "shared_buffers": current["shared_buffers"],
        "fsync": current["fsync"],
        "wal_sync_method": current["wal_sync_method"],
        "cores": os.cpu_count(),
        "pgbench": version.stdout.strip(),
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
        "python": sys.version.split()[0],
        "jobd": jobd.__version__,
    }


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def print_header(environment: dict[str, Any], dbname: str) -> None:
    e = environment
    print(f"jobd queue_ops benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC")
    print(
        f"PostgreSQL {e['server_version']}; synchronous_commit={e['synchronous_commit']} "
        f"(server default {e['synchronous_commit_server_default']}, forced on for every "
        f"benchmark connection); shared_buffers={e['shared_buffers']}; fsync={e['fsync']}; "
        f"wal_sync_method={e['wal_sync_method']}"
    )
    print(
        f"machine: {e['cores']} cores; {e['pgbench']}; psycopg {e['psycopg']}; "
        f"Python {e['python']}; jobd {e['jobd']}"
    )
    print(f"scratch database: {dbname} (dropped at exit); {load_average()}")
    if os.getloadavg()[0] > (e["cores"] or 1):
        print(
            "WARNING: the machine is already busy (load average above the core count): "
            "expect a wide min-max spread and a longer run"
        )
    if e["fsync"] != "on":
        print("WARNING: fsync is off, commits are not durable and the figures mean little")
    print(flush=True)


def verdict(comparison: Comparison, baseline: Series | None) -> str:
    if baseline is None and comparison.target_rate is not None:
        ok = comparison.jobd.median >= comparison.target_rate
        return f"{'met' if ok else 'MISSED'} (>= {comparison.target_rate:,.0f}/s)"
    if baseline is not None and comparison.target_ratio is not None:
        if not comparison.judges(baseline):
            return "reference"
        ok = comparison.ratio(baseline) >= comparison.target_ratio
        return f"{'met' if ok else 'MISSED'} (>= {comparison.target_ratio:.2f})"
    return ""


def table_rows(comparisons: Sequence[Comparison]) -> list[list[str]]:
    rows = []
    for comparison in comparisons:
        for series in [comparison.jobd, *comparison.baselines]:
            baseline = None if series is comparison.jobd else series
            rows.append(
                [
                    series.operation if baseline is None else "",
                    str(series.batch) if baseline is None else "",
                    str(series.clients) if baseline is None else "",
                    series.implementation,
                    f"{series.median:,.0f}",
                    f"{min(series.rates):,.0f}",
                    f"{max(series.rates):,.0f}",
                    f"{comparison.ratio(baseline):.2f}" if baseline else "",
                    f"{series.cpu_us_per_job:,.0f}",
                    verdict(comparison, baseline),
                ]
            )
    return rows


def print_table(comparisons: Sequence[Comparison], rounds: int) -> None:
    header = [
        "operation",
        "batch",
        "clients",
        "implementation",
        "median/s",
        "min/s",
        "max/s",
        "jobd/this",
        "cpu us/job",
        "target",
    ]
    rows = table_rows(comparisons)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {1, 2, 4, 5, 6, 7, 8}

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    print(
        f"jobs per second over {rounds} rounds; jobd/this = median(jobd) / median(this row); "
        "cpu us/job = client-side CPU (user + system) per job, median"
    )
    print(line(header))
    print(line(["-" * width for width in widths]))
    for row in rows:
        print(line(row))
    print(flush=True)


def json_lines(comparisons: Sequence[Comparison], environment: dict[str, Any]) -> Iterator[str]:
    for comparison in comparisons:
        for series in [comparison.jobd, *comparison.baselines]:
            record: dict[str, Any] = {
                "benchmark": "queue_ops",
                "operation": series.operation,
                "implementation": series.implementation,
                "batch": series.batch,
                "clients": series.clients,
                "jobs_per_run": series.jobs_per_run,
                "rounds": len(series.samples),
                "median_jobs_per_s": round(series.median, 1),
                "min_jobs_per_s": round(min(series.rates), 1),
                "max_jobs_per_s": round(max(series.rates), 1),
                "samples_jobs_per_s": [round(rate, 1) for rate in series.rates],
                "client_cpu_us_per_job": round(series.cpu_us_per_job, 1),
            }
            if series is comparison.jobd:
                if comparison.target_rate is not None:
                    record["target_jobs_per_s"] = comparison.target_rate
                    record["meets_target"] = series.median >= comparison.target_rate
            else:
                record["jobd_ratio"] = round(comparison.ratio(series), 3)
                if comparison.judges(series):
                    record["target_ratio"] = comparison.target_ratio
                    record["meets_target"] = comparison.ratio(series) >= comparison.target_ratio
            record.update(
                server_version=environment["server_version"],
                synchronous_commit=environment["synchronous_commit"],
                cores=environment["cores"],
            )
            yield json.dumps(record, sort_keys=False)


# --- entry point -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Throughput of jobd's enqueue, claim and complete next to bare SQL.",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get(URL_ENV, DEFAULT_ADMIN_URL),
        help=f"admin connection used to create the scratch database (default: ${URL_ENV}, "
        f"else {DEFAULT_ADMIN_URL})",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_SINGLE_JOBS,
        help=f"jobs per run of the single-enqueue measurement (default {DEFAULT_SINGLE_JOBS})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"rounds per measurement (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["single", "bulk", "claim"],
        default=["single", "bulk", "claim"],
        help="run only these parts",
    )
    parser.add_argument(
        "--pgbench",
        default=shutil.which("pgbench") or "/usr/bin/pgbench",
        help="pgbench executable (default: from PATH)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.rounds < 1:
        parser.error("--jobs and --rounds must be positive")
    return args


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    try:
        with (
            scratch_database(args.database_url) as dbname,
            tempfile.TemporaryDirectory(prefix="jobd-bench-") as script_dir,
        ):
            dsn = scratch_dsn(args.database_url, dbname)
            with open_bench_connection(dsn) as conn:
                migrate(conn, SCHEMA)
                environment = describe_environment(conn, args.database_url, args.pgbench)
                print_header(environment, dbname)
                scripts = write_pgbench_scripts(Path(script_dir))
                bench = Bench(dsn, conn, args.rounds, args.pgbench, scripts)
                comparisons = run_all(bench, args.jobs, args.only)
            print(f"at the end: {load_average()}")
            print_table(comparisons, args.rounds)
            for line in json_lines(comparisons, environment):
                print(line)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

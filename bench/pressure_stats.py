"""What bench/pressure.py reads from the database and the handler's files, and the figures it
derives from them.

- ``Monitor``: a connection to the benchmark database that takes snapshots of the state of
  ``jobd.jobs`` (dead and live tuples, heap and index size, per-index ``idx_scan`` and
  ``idx_tup_read``, rows read by sequential scans, vacuums) and of the claim statements in
  ``pg_stat_statements``, the backlog, the age of what holds the xmin horizon, and the
  database clock.
- ``RunFiles``: the files the handler (bench/pressure_handlers.py) appends to, read as they grow.
- ``Analysis``: after a scenario, the sent ids and the handler's runs are copied into tables of
  the ``pressure`` schema beside jobd's, and everything per job is computed in SQL: pickup
  delays per phase, jobs done per phase, pickup per second (for recovery), and the check that
  every sent job is done exactly once.

Cumulative statistics (``pg_stat_user_*``, ``pg_stat_statements``) are flushed by each backend
at most once a second while it is busy, so a phase's deltas lag its edges by about a second.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg

from bench.daemon_bench import percentile
from jobd import queries

# jobd.jobs and, should it ever be partitioned, its partitions (pg_partition_tree lists nothing
# for a plain table).
_JOBS_SNAPSHOT = """
WITH rels AS (SELECT 'jobd.jobs'::regclass AS relid
              UNION SELECT relid FROM pg_partition_tree('jobd.jobs'::regclass) WHERE isleaf)
SELECT (SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM rels)),
       (SELECT coalesce(sum(n_live_tup), 0) FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM rels)),
       (SELECT coalesce(sum(vacuum_count + autovacuum_count), 0) FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM rels)),
       (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
         WHERE relid IN (SELECT relid FROM rels)),
       (SELECT coalesce(sum(pg_relation_size(relid)), 0) FROM rels),
       (SELECT coalesce(sum(pg_indexes_size(relid)), 0) FROM rels),
       (SELECT coalesce(json_object_agg(i.indexrelname,
                                        json_build_array(i.idx_scan, i.idx_tup_read,
                                                         io.idx_blks_hit + io.idx_blks_read)),
                        '{}')
          FROM pg_stat_user_indexes AS i
          JOIN pg_statio_user_indexes AS io USING (indexrelid)
         WHERE i.relid IN (SELECT relid FROM rels)),
       clock_timestamp()
"""

# A claim is the statement that takes jobs with FOR UPDATE SKIP LOCKED; nothing else jobd
# runs, and nothing of this benchmark, uses SKIP LOCKED.
_CLAIM_STATEMENTS = """
SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(rows), 0)::bigint
  FROM public.pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND query ILIKE '%skip locked%'
"""

# Every statement of the benchmark database, for the heaviest of a phase (top_statements):
# calls, shared blocks touched (hit or read) and execution time. Statements inside jobd's
# functions count toward the call that ran them (pg_stat_statements.track = top).
_STATEMENTS = """
SELECT queryid, query, calls, shared_blks_hit + shared_blks_read, total_exec_time
  FROM public.pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

_BACKLOG = "SELECT count(*) FILTER (WHERE state <> 'claimed'), count(*) FROM jobd.jobs"
_DUE_UNCLAIMED = "SELECT count(*) FROM jobd.jobs WHERE state <> 'claimed' AND run_at <= now()"
# The oldest transaction that holds the xmin horizon back: by its snapshot (backend_xmin) or
# by its own transaction id (an idle-in-transaction session that wrote, or asked for one, has
# no snapshot between statements but still pins the horizon).
_HORIZON_AGE = """
SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0)::float8
  FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
   AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
"""


class Monitor:
    def __init__(self, url: str, statements: bool) -> None:
        self.conn = psycopg.connect(url, autocommit=True, application_name="pressure-monitor")
        self.statements = statements

    def close(self) -> None:
        self.conn.close()

    def now(self) -> datetime:
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    def snapshot(self) -> dict[str, Any]:
        row = self.conn.execute(_JOBS_SNAPSHOT).fetchone()
        assert row is not None
        dead, live, vacuums, seq_read, heap, index, indexes, at = row
        snap: dict[str, Any] = {
            "at": at.timestamp(), "dead_tuples": int(dead), "live_tuples": int(live),
            "vacuums": int(vacuums), "seq_tuples_read": int(seq_read),
            "heap_bytes": int(heap), "index_bytes": int(index),
            "indexes": {name: {"scans": int(v[0]), "tuples_read": int(v[1]),
                               "blocks": int(v[2])}
                        for name, v in indexes.items()},
        }
        if self.statements:
            calls, rows = self.conn.execute(_CLAIM_STATEMENTS).fetchone() or (0, 0)
            snap["claim_calls"], snap["claim_rows"] = int(calls), int(rows)
            snap["statements"] = {
                queryid: (text, int(calls), int(blocks), float(ms))
                for queryid, text, calls, blocks, ms in self.conn.execute(_STATEMENTS)}
        return snap

    def backlog(self) -> tuple[int, int]:
        """(jobs not claimed, all live jobs) in jobd.jobs."""
        row = self.conn.execute(_BACKLOG).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def due_unclaimed(self) -> int:
        row = self.conn.execute(_DUE_UNCLAIMED).fetchone()
        assert row is not None
        return int(row[0])

    def horizon_age_s(self) -> float:
        row = self.conn.execute(_HORIZON_AGE).fetchone()
        assert row is not None
        return float(row[0])


def claim_reads(before: dict[str, Any], after: dict[str, Any], claim_index: str,
                jobs_claimed: int) -> dict[str, Any]:
    """Index entries read between two snapshots, per claim statement and per claimed job.

    ``claim_index`` is the index the claim walks; if the schema has no index of that name,
    every index of jobd.jobs but the primary key counts (the primary key is probed by id, once
    per job, by every statement that touches a job)."""
    names = after["indexes"]
    chosen = ([claim_index] if claim_index in names
              else [n for n in names if not n.endswith("_pkey")])
    read = sum(names[n]["tuples_read"] - before["indexes"].get(n, {}).get("tuples_read", 0)
               for n in chosen)
    by_index = {n: v["tuples_read"] - before["indexes"].get(n, {}).get("tuples_read", 0)
                for n, v in names.items()}
    result: dict[str, Any] = {"claim_index": "+".join(chosen), "entries_read": read,
                              "per_job": read / jobs_claimed if jobs_claimed else math.nan,
                              "by_index": by_index}
    if "claim_calls" in after:
        calls = after["claim_calls"] - before["claim_calls"]
        result["claim_statements"] = calls
        result["jobs_per_claim"] = ((after["claim_rows"] - before["claim_rows"]) / calls
                                    if calls else math.nan)
        result["per_claim"] = read / calls if calls else math.nan
        # Index blocks of every index but the primary key, per claim: what the claim side
        # walks in all. The arming probe and the lease sweep read other indexes than the
        # claim's, and a scan that checks a condition inside the index steps over entries
        # without returning them, which idx_tup_read does not count.
        blocks = sum(v["blocks"] - before["indexes"].get(n, {}).get("blocks", 0)
                     for n, v in names.items() if not n.endswith("_pkey"))
        result["index_blocks_per_claim"] = blocks / calls if calls else math.nan
        # Rows of jobd.jobs read by sequential scans, per claim: when the planner walks the
        # table instead of the claim index (a small table, fresh statistics), the index
        # figure alone would look like a claim that reads nothing.
        seq = after["seq_tuples_read"] - before["seq_tuples_read"]
        result["seq_rows_per_claim"] = seq / calls if calls else math.nan
    return result


def top_statements(before: dict[str, Any], after: dict[str, Any],
                   count: int = 5) -> list[dict[str, Any]]:
    """The ``count`` statements that touched the most shared blocks between two snapshots:
    each with its label (statement_label), calls, blocks per call and milliseconds per call."""
    if "statements" not in after:
        return []
    rows = []
    for queryid, (text, calls, blocks, ms) in after["statements"].items():
        _text, calls0, blocks0, ms0 = before.get("statements", {}).get(queryid, ("", 0, 0, 0.0))
        if calls > calls0:
            rows.append({"statement": statement_label(text), "calls": calls - calls0,
                         "blocks": blocks - blocks0,
                         "blocks_per_call": (blocks - blocks0) / (calls - calls0),
                         "ms_per_call": (ms - ms0) / (calls - calls0)})
    return sorted(rows, key=lambda r: r["blocks"], reverse=True)[:count]


@functools.cache
def _jobd_query_names() -> dict[str, str]:
    """jobd's named queries by their first lines of SQL (the names of those that share them
    are joined with '|')."""
    names: dict[str, list[str]] = {}
    for name in queries.names():
        for start in dict.fromkeys(_code_start(queries.text(name), lines) for lines in (2, 1)):
            names.setdefault(start, []).append(name)
    return {start: "|".join(found) for start, found in names.items()}


# psycopg sends %(name)s as $n; pg_stat_statements shows constants as $n too.
_PARAMETER = re.compile(r"%\(\w+\)s|\$\d+")


def _code_start(text: str, lines: int = 2) -> str:
    """The first ``lines`` lines of SQL, comments left out, parameters as '?' and jobd's
    schema prefix dropped."""
    code = [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("--")][:lines]
    joined = " ".join(code).replace("{schema}.", "").replace("jobd.", "")
    return _PARAMETER.sub("?", joined)


def statement_label(text: str) -> str:
    """A statement's name in jobd/sql/queries.sql if it is one of jobd's, else its start (the
    benchmark's own statements, a migration's)."""
    # Constants show as parameters too, so a statement whose first two lines hold one may
    # only match by its first.
    known = _jobd_query_names()
    for lines in (2, 1):
        name = known.get(_code_start(text, lines))
        if name:
            return name
    return _code_start(text)[:60]


class RunFiles:
    """The handler's ``runs-<pid>.txt`` files in one directory, read as they grow."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.lines = 0

    def read_new(self) -> bytes:
        """The complete lines appended since the last call."""
        chunks = []
        for path in sorted(self.directory.glob("runs-*.txt")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            cut = data.rfind(b"\n") + 1
            if cut < len(data):
                self._partial[path] = data[cut:]
            chunks.append(data[:cut])
        new = b"".join(chunks)
        self.lines += new.count(b"\n")
        return new

    def all_lines(self) -> bytes:
        return b"".join(path.read_bytes() for path in sorted(self.directory.glob("runs-*.txt")))


def parse_runs(data: bytes) -> list[tuple[int, float, float]]:
    """(job id, lease_until epoch, start epoch) per line."""
    out = []
    for line in data.splitlines():
        job_id, lease_until, started = line.split()
        out.append((int(job_id), float(lease_until), float(started)))
    return out


# --- after a scenario: everything per job, in SQL -------------------------------------------

_SETUP = [
    "CREATE TABLE pressure.sent (id bigint NOT NULL, phase int NOT NULL)",
    "CREATE TABLE pressure.runs (id bigint NOT NULL, lease_until float8 NOT NULL, "
    "started float8 NOT NULL)",
    "CREATE TABLE pressure.phases (phase int PRIMARY KEY, name text NOT NULL, "
    "started timestamptz NOT NULL, ended timestamptz NOT NULL)",
    "CREATE TABLE pressure.pickups (id bigint, phase int, state text, run_at float8, "
    "claimed float8, started float8, runs bigint, finished_at timestamptz)",
]

# One row per sent job (and per row jobd.all_jobs has for it): when it was due, when its
# first recorded run was claimed (lease_until minus the visibility timeout: the claim
# statement's now()) and started, how often it ran, and when it finished.
_PICKUPS = """
INSERT INTO pressure.pickups
SELECT s.id, s.phase, a.state, extract(epoch FROM a.run_at), r.lease_until - %(vt)s,
       r.started, coalesce(r.runs, 0), a.finished_at
  FROM pressure.sent AS s
  LEFT JOIN (SELECT id, min(lease_until) AS lease_until, min(started) AS started,
                    count(*) AS runs
               FROM pressure.runs GROUP BY id) AS r USING (id)
  LEFT JOIN jobd.all_jobs AS a USING (id)
"""

_PHASE_PICKUPS = """
SELECT phase, count(*), count(claimed),
       percentile_disc(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY claimed - run_at),
       max(claimed - run_at),
       percentile_disc(0.99) WITHIN GROUP (ORDER BY started - run_at)
  FROM pressure.pickups GROUP BY phase
"""

_PHASE_DONE = """
SELECT ph.phase, count(k.id)
  FROM pressure.phases AS ph
  LEFT JOIN pressure.pickups AS k
         ON k.state = 'done' AND k.finished_at >= ph.started AND k.finished_at < ph.ended
 GROUP BY ph.phase
"""

# The jobs of one phase: when each was due (seconds since the phase began) and its pickup.
_PHASE_JOBS = """
SELECT k.run_at - extract(epoch FROM ph.started), k.claimed - k.run_at
  FROM pressure.pickups AS k JOIN pressure.phases AS ph USING (phase)
 WHERE k.phase = %(phase)s AND k.claimed IS NOT NULL
 ORDER BY 1
"""

_CHECK = """
SELECT (SELECT count(*) FROM pressure.sent),
       (SELECT count(DISTINCT id) FROM pressure.sent),
       (SELECT count(*) FROM pressure.pickups WHERE state = 'done'),
       (SELECT count(DISTINCT id) FROM pressure.pickups WHERE state = 'done'),
       (SELECT count(*) FROM pressure.pickups WHERE state IS NULL),
       (SELECT count(*) FROM pressure.pickups WHERE state <> 'done'),
       (SELECT count(*) FROM (SELECT id FROM pressure.runs GROUP BY id HAVING count(*) > 1)
            AS twice),
       (SELECT count(*) FROM pressure.pickups WHERE runs = 0),
       (SELECT count(*) FROM pressure.runs AS r
         WHERE NOT EXISTS (SELECT 1 FROM pressure.sent AS s WHERE s.id = r.id)),
       (SELECT count(*) FROM jobd.all_jobs AS a
         WHERE NOT EXISTS (SELECT 1 FROM pressure.sent AS s WHERE s.id = a.id)),
       (SELECT count(*) FROM jobd.jobs WHERE state = 'claimed'),
       (SELECT count(*) FROM jobd.jobs)
"""
CHECK_FIELDS = ("sent", "distinct_ids", "done_rows", "done_ids", "missing", "not_done",
                "ran_twice", "never_ran", "ran_unsent", "unsent_rows", "left_claimed",
                "left_live")


@dataclass
class PhaseWindow:
    phase: int
    name: str
    started: datetime
    ended: datetime


class Analysis:
    """The per-job figures of one scenario, computed in its database."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def load(self, sent: bytes, runs: bytes, phases: list[PhaseWindow],
             visibility_timeout_s: float) -> None:
        with self.conn.transaction():
            for statement in _SETUP:
                self.conn.execute(statement)
            with self.conn.cursor().copy("COPY pressure.sent (id, phase) FROM STDIN") as copy:
                copy.write(sent)
            with self.conn.cursor().copy(
                    "COPY pressure.runs (id, lease_until, started) FROM STDIN "
                    "(DELIMITER ' ')") as copy:
                copy.write(runs)
            with self.conn.cursor().copy(
                    "COPY pressure.phases (phase, name, started, ended) FROM STDIN") as copy:
                for p in phases:
                    copy.write_row((p.phase, p.name, p.started, p.ended))
            self.conn.execute("ANALYZE pressure.sent")
            self.conn.execute("ANALYZE pressure.runs")
            self.conn.execute(_PICKUPS, {"vt": visibility_timeout_s})
            self.conn.execute("ANALYZE pressure.pickups")

    def pickups(self) -> dict[int, dict[str, Any]]:
        """Per phase of sending: pickup delay percentiles in ms (claim time - run_at)."""
        out = {}
        for phase, jobs, claimed, pcts, worst, start_p99 in self.conn.execute(
                _PHASE_PICKUPS).fetchall():
            p50, p95, p99 = (pcts or [None] * 3)
            out[phase] = {"jobs": jobs, "claimed": claimed, "pickup_p50_ms": _ms(p50),
                          "pickup_p95_ms": _ms(p95), "pickup_p99_ms": _ms(p99),
                          "pickup_max_ms": _ms(worst), "start_p99_ms": _ms(start_p99)}
        return out

    def done(self) -> dict[int, int]:
        """Per phase: jobs that finished (state done) within its window, by finished_at."""
        return dict(self.conn.execute(_PHASE_DONE).fetchall())

    def phase_jobs(self, phase: int) -> list[tuple[float, float]]:
        """(seconds since the phase began that the job was due, pickup in ms), by due time."""
        return [(float(due), float(pickup) * 1000.0) for due, pickup in
                self.conn.execute(_PHASE_JOBS, {"phase": phase}).fetchall()]

    def check(self) -> dict[str, Any]:
        row = self.conn.execute(_CHECK).fetchone()
        assert row is not None
        result: dict[str, Any] = dict(zip(CHECK_FIELDS, (int(v) for v in row), strict=True))
        result["ok"] = (result["sent"] == result["distinct_ids"] == result["done_rows"]
                        == result["done_ids"]
                        and all(result[k] == 0 for k in (
                            "missing", "not_done", "ran_twice", "never_ran", "ran_unsent",
                            "unsent_rows", "left_claimed", "left_live")))
        return result


def _ms(seconds: float | None) -> float:
    return math.nan if seconds is None else float(seconds) * 1000.0


def per_second(jobs: list[tuple[float, float]]) -> list[tuple[int, int, float]]:
    """(second, jobs due in it, their pickup p99 in ms) for a phase's jobs."""
    seconds: dict[int, list[float]] = {}
    for due, pickup in jobs:
        seconds.setdefault(math.floor(due), []).append(pickup)
    return [(s, len(v), round(percentile(sorted(v), 99), 2)) for s, v in sorted(seconds.items())]


def recovered_after(jobs: list[tuple[float, float]], bound_ms: float,
                    window: int) -> int | None:
    """The first whole second s of the phase such that the jobs due in [s, s + window) have a
    pickup p99 at or under ``bound_ms``; None if the phase never gets there. The p99 is taken
    over the window's jobs pooled (2,000 of them at 400/s), not per second, so one stray slow
    job on a busy machine does not decide it."""
    if not jobs:
        return None
    last = math.floor(jobs[-1][0])
    for start in range(0, last - window + 2):
        pickups = sorted(p for due, p in jobs if start <= due < start + window)
        if pickups and percentile(pickups, 99) <= bound_ms:
            return start
    return None

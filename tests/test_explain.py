"""The hot queries ride their partial indexes on a table of a million jobs, few of them due.

The table: 1,000,000 pending jobs scheduled in the future (lanes default 40 %, bulk 30 %,
reports 30 %, ten priorities each), 3,000 due jobs in lane default (five priorities) and 2,000
claimed jobs whose leases expire over the next minute. A claim must find the due jobs without
visiting the future ones, whatever their number.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg import sql

from jobd import queue, recovery
from jobd.claim_floors import full_scan_params
from jobd.db import connect
from jobd.jobs import Lease
from jobd.queries import query

if TYPE_CHECKING:
    from conftest import Databases

FUTURE_JOBS = 1_000_000
DUE_JOBS = 3_000
CLAIMED_JOBS = 2_000

Plan = dict[str, Any]


@pytest.fixture(scope="module")
def big_queue(databases: Databases) -> Iterator[psycopg.Connection]:
    url = databases.migrated()
    with connect(url) as conn:
        conn.execute(
            """INSERT INTO jobs (lane, handler, priority, run_at)
               SELECT CASE WHEN i %% 10 < 4 THEN 'default'
                           WHEN i %% 10 < 7 THEN 'bulk' ELSE 'reports' END,
                      'send_email', (i / 10) %% 10,
                      now() + make_interval(secs => 60 + i %% 604800)
                 FROM generate_series(1, %s) AS i""",
            (FUTURE_JOBS,),
        )
        conn.execute(
            """INSERT INTO jobs (lane, handler, priority, run_at)
               SELECT 'default', 'send_email', i %% 5, now() - make_interval(secs => i)
                 FROM generate_series(1, %s) AS i""",
            (DUE_JOBS,),
        )
        add_claimed_jobs(conn, leases_from=-30)
        conn.execute("ANALYZE jobs")
        yield conn
    drop_database(databases, url)


def add_claimed_jobs(conn: psycopg.Connection, leases_from: int) -> None:
    """CLAIMED_JOBS claimed jobs whose leases end over the minute from ``leases_from``
    seconds from now."""
    conn.execute(
        """INSERT INTO jobs (lane, handler, state, run_at, attempts, claimed_by,
                             lease_token, lease_until)
           SELECT 'default', 'send_email', 'claimed', now() - interval '1 minute', 1,
                  'node-1:' || i %% 16, nextval('lease_token_seq'),
                  now() + make_interval(secs => i %% 60 + %s)
             FROM generate_series(1, %s) AS i""",
        (leases_from, CLAIMED_JOBS),
    )


def drop_database(databases: Databases, url: str) -> None:
    with databases.server.admin() as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(psycopg.conninfo.conninfo_to_dict(url)["dbname"])))


def nodes(plan: Plan) -> Iterator[Plan]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def seq_scans_on_jobs(plan: Plan) -> list[Plan]:
    return [n for n in nodes(plan) if n["Node Type"] == "Seq Scan"
            and n.get("Relation Name") == "jobs"]


def indexes_used(plan: Plan) -> set[str]:
    return {n["Index Name"] for n in nodes(plan) if "Index Name" in n}


def pages(plan: Plan) -> int:
    """Shared buffers the node and everything below it touched (hits and reads)."""
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def cte(plan: Plan, name: str) -> Plan:
    [found] = [n for n in nodes(plan) if n.get("Subplan Name") == f"CTE {name}"]
    return found


def explain(conn: psycopg.Connection, name: str, params: dict[str, Any], *,
            analyze: bool = False) -> Plan:
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    # EXPLAIN ANALYZE runs the statement: the claim's UPDATE is rolled back.
    with conn.transaction(force_rollback=True):
        row = conn.execute(f"EXPLAIN ({options}) {query(name)}", params).fetchone()
    assert row is not None
    return row[0][0]["Plan"]


def claim_params(lane: str, now: datetime | None = None) -> dict[str, Any]:
    return {"lane": lane, "worker": "node-2:7", "limit": 100, "visibility_timeout": 30.0,
            "now": now, **full_scan_params(),
            "ordered": False, "max_wait": None, "fair": False, "key_cursor": None,
            "lacking_handlers": [], "payload_bytes": None, "least": 1,
            "starting": None, "lane_max_attempts": None}


def test_the_table_has_a_million_rows_and_few_due(big_queue: psycopg.Connection) -> None:
    row = big_queue.execute(
        "SELECT count(*), count(*) FILTER (WHERE state = 'pending' AND run_at <= now()), "
        "count(*) FILTER (WHERE lane = 'bulk' AND run_at <= now()), "
        "count(*) FILTER (WHERE lane = 'bulk') FROM jobs").fetchone()
    assert row == (FUTURE_JOBS + DUE_JOBS + CLAIMED_JOBS, DUE_JOBS, 0, 300_000)


@pytest.mark.parametrize("lane", ["default", "bulk", "nonexistent"])
def test_claim_plan_rides_the_claimable_index(big_queue: psycopg.Connection, lane: str) -> None:
    plan = explain(big_queue, "claim_jobs", claim_params(lane))
    assert seq_scans_on_jobs(plan) == []
    assert "jobs_claimable_idx" in indexes_used(plan)


def test_claim_generic_plan_rides_the_claimable_index(big_queue: psycopg.Connection) -> None:
    # A worker runs the claim over and over on one connection: psycopg prepares it and the
    # server may switch to a generic plan that does not know the lane.
    big_queue.execute("SET plan_cache_mode = force_generic_plan")
    try:
        plan = explain(big_queue, "claim_jobs", claim_params("default"))
    finally:
        big_queue.execute("RESET plan_cache_mode")
    assert seq_scans_on_jobs(plan) == []
    assert "jobs_claimable_idx" in indexes_used(plan)


def test_claim_of_due_jobs_does_not_walk_the_future_ones(big_queue: psycopg.Connection) -> None:
    plan = explain(big_queue, "claim_jobs", claim_params("default"), analyze=True)
    assert plan["Actual Rows"] == 100
    assert seq_scans_on_jobs(plan) == []
    # Finding the jobs: a descent per priority plus the due range (observed ~180 pages);
    # walking the 400,000 future jobs of the lane would take thousands.
    finding = pages(cte(plan, "due"))  # the priorities (lane_priorities) are inlined in it
    assert finding < 400
    # The whole statement, including updating 100 rows and their index entries
    # (observed ~1,600 pages).
    assert pages(plan) < 2_500


def test_claim_in_a_lane_with_only_future_jobs_visits_almost_nothing(
    big_queue: psycopg.Connection,
) -> None:
    plan = explain(big_queue, "claim_jobs", claim_params("bulk"), analyze=True)
    assert plan["Actual Rows"] == 0
    assert seq_scans_on_jobs(plan) == []
    assert "jobs_claimable_idx" in indexes_used(plan)
    # Ten priorities, each a short index descent that stops at the first future run_at
    # (observed ~80 pages); 300,000 future rows span thousands of index pages.
    assert pages(plan) < 200


def test_claim_finds_jobs_due_at_an_injected_time_with_the_same_plan(
    big_queue: psycopg.Connection,
) -> None:
    row = big_queue.execute("SELECT now()").fetchone()
    assert row is not None
    # An hour ahead, the earliest few thousand of the future jobs are due as well.
    later = row[0] + timedelta(hours=1)
    plan = explain(big_queue, "claim_jobs", claim_params("bulk", later), analyze=True)
    assert plan["Actual Rows"] == 100
    assert pages(plan) < 2_500


def test_expired_leases_ride_the_lease_index(big_queue: psycopg.Connection) -> None:
    params = recovery.expired_leases_params()
    plan = explain(big_queue, "expired_leases", params)
    assert seq_scans_on_jobs(plan) == []
    assert "jobs_lease_idx" in indexes_used(plan)
    analyzed = explain(big_queue, "expired_leases", params, analyze=True)
    assert 0 < analyzed["Actual Rows"] <= CLAIMED_JOBS
    # One heap page per expired job at most, never the million pending rows.
    assert pages(analyzed) < CLAIMED_JOBS + 100


def test_a_paused_handlers_due_jobs_cost_a_claim_from_the_head_but_not_from_a_floor(
    big_queue: psycopg.Connection,
) -> None:
    # Every job here is send_email's: paused, the lane has nothing to claim. A scan from the
    # head steps over the 3,000 due jobs (their handler is in the heap, not the index) but
    # stops at the first future one, as always; a worker's scan from its floor (the lane
    # came back dry half a second ago) skips them. Workers scan from the head once a second.
    with big_queue.transaction(force_rollback=True):
        big_queue.execute("SELECT pause('default', 'send_email')")
        head = explain(big_queue, "claim_jobs", claim_params("default"), analyze=True)
        floored = explain(big_queue, "claim_jobs",
                          {**claim_params("default"), "default_floor_age": 0.5},
                          analyze=True)
    assert head["Actual Rows"] == floored["Actual Rows"] == 0
    # Observed ~290 pages (~2 ms) from the head, the due jobs lying together in the heap;
    # scattered among other jobs, each could cost a heap page of its own. ~40 from the floor.
    stepped_over, from_floor = pages(cte(head, "due")), pages(cte(floored, "due"))
    assert from_floor < 200
    assert 3 * from_floor < stepped_over < 4_000


def test_a_limited_claim_counts_the_claimed_jobs_through_the_lease_index(
    big_queue: psycopg.Connection,
) -> None:
    # max_running counts the lane's claimed jobs: the 2,000 claimed rows of every lane
    # through jobs_lease_idx, the lane checked in the heap (observed ~1,700 buffers and
    # ~1.5 ms in all against ~1,350 and ~1.2 ms for the plain claim). Never the million.
    params = {**claim_params("default"), "max_running": 100_000, "rate_limit": 1_000_000,
              "rate_per": 1.0}
    big_queue.execute("SET plan_cache_mode = force_generic_plan")
    try:
        generic = explain(big_queue, "claim_jobs_limited", params)
    finally:
        big_queue.execute("RESET plan_cache_mode")
    analyzed = explain(big_queue, "claim_jobs_limited", params, analyze=True)
    for plan in (generic, analyzed):
        assert seq_scans_on_jobs(plan) == []
        assert {"jobs_claimable_idx", "jobs_lease_idx"} <= indexes_used(plan)
    assert analyzed["Actual Rows"] == 100
    assert pages(analyzed) < 2_500 + CLAIMED_JOBS


@pytest.mark.parametrize("paused", [False, True])
def test_a_one_handler_lane_full_of_due_jobs_claims_by_an_ordered_index_scan(
    conn: psycopg.Connection, paused: bool,
) -> None:
    # The pause filter must not make the planner expect that no row of a lane with one
    # handler passes: it then sorted every due job of the lane for each claim.
    conn.execute("INSERT INTO jobs (lane, handler) SELECT 'default', 'noop'"
                 " FROM generate_series(1, 15000)")
    conn.execute("INSERT INTO jobs (lane, handler) SELECT 'default', 'bad'"
                 " FROM generate_series(1, 100)")
    conn.execute("ANALYZE jobs")
    if paused:
        conn.execute("SELECT pause('default', 'bad')")
    plan = explain(conn, "claim_jobs", {**claim_params("default"), "limit": 30},
                   analyze=True)
    assert plan["Actual Rows"] == 30
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "jobs"
             and n.get("Alias") == "jobs_1"]
    assert [n["Node Type"] for n in scans] == ["Index Scan"]
    assert scans[0]["Index Name"] == "jobs_claimable_idx"
    # The byte bound's sort of the claimed rows (at most the limit, on "due") is not one.
    assert not any(n["Node Type"] == "Sort" and "run_at" in str(n.get("Sort Key"))
                   and "due" not in str(n.get("Sort Key")) for n in nodes(plan))


FAIR_KEY_PROBE = """SELECT 1 FROM jobs AS j
                     WHERE j.lane = 'default' AND j.state IN ('pending', 'failed')
                       AND j.priority = 0 AND coalesce(j.fairness_key, j.handler) COLLATE "C" = 'h'
                     LIMIT 1"""


def test_only_the_fair_queries_can_be_planned_on_the_fair_index(
    conn: psycopg.Connection,
) -> None:
    # Without the claim index and with sequential scans priced out, the planner takes any
    # index it may. From jobs_fair_idx a claim's floor bounds nothing (the share key comes
    # before run_at), so a claim must not be able to use it (migration 0025); the fair
    # queries, which compare the share key, still do.
    conn.execute("INSERT INTO jobs (lane, handler) SELECT 'default', 'h'"
                 " FROM generate_series(1, 100)")
    conn.execute("ANALYZE jobs")
    with conn.transaction(force_rollback=True):
        conn.execute("DROP INDEX jobs_claimable_idx")
        conn.execute("SET LOCAL enable_seqscan = off")
        claim = explain(conn, "claim_jobs", claim_params("default"))
        assert "jobs_fair_idx" not in indexes_used(claim)
        row = conn.execute(f"EXPLAIN (FORMAT JSON) {FAIR_KEY_PROBE}").fetchone()
        assert row is not None
        assert indexes_used(row[0][0]["Plan"]) == {"jobs_fair_idx"}


# --- the metrics sampler's counts ----------------------------------------------------------
#
# Last in this module: they vacuum the table first. A live queue table is vacuumed often
# (migrations/0001 sets an aggressive autovacuum), which keeps its visibility map set for the
# pages of waiting jobs; index-only scans rely on it, and before any vacuum the planner
# rightly prefers reading the heap.

SAMPLED_LANES = ["bulk", "default", "nonexistent", "reports"]


DEAD_JOBS = 50_000


@pytest.fixture(scope="module")
def vacuumed_queue(big_queue: psycopg.Connection) -> psycopg.Connection:
    """The big queue, vacuumed, with a dead-letter queue of DEAD_JOBS over the three lanes."""
    big_queue.execute(
        """INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,
                                    created_at, errors)
           SELECT -i, (ARRAY['default', 'bulk', 'reports'])[1 + i %% 3], 'send_email', '{}',
                  0, now(), 8, now(), '[]'
             FROM generate_series(1, %s) AS i""", (DEAD_JOBS,))
    big_queue.execute("VACUUM (ANALYZE) jobs")
    big_queue.execute("VACUUM (ANALYZE) dead_letter")
    return big_queue


def scans(plan: Plan) -> list[tuple[str, str, str]]:
    """(node type, relation, index) of every scan in the plan."""
    return [(n["Node Type"], n.get("Relation Name", ""), n.get("Index Name", ""))
            for n in nodes(plan) if "Scan" in n["Node Type"] and "Relation Name" in n]


def check_sampler_plan(plan: Plan) -> None:
    assert seq_scans_on_jobs(plan) == []
    found = scans(plan)
    # Waiting and retrying jobs are counted from their indexes alone; claimed ones through
    # the lease index (one heap row per job in flight); the DLQ from its lane index.
    assert ("Index Only Scan", "jobs", "jobs_claimable_idx") in found
    assert ("Index Only Scan", "jobs", "jobs_retrying_idx") in found
    assert indexes_used(plan) == {"jobs_claimable_idx", "jobs_retrying_idx", "jobs_lease_idx",
                                  "dead_letter_lane_idx"}
    # Nothing else is read: no archive, no sequential scan of either table.
    assert {relation for _type, relation, _index in found} == {"jobs", "dead_letter"}
    assert all(node_type != "Seq Scan" for node_type, _relation, _index in found)


def test_the_sampler_counts_from_indexes(vacuumed_queue: psycopg.Connection) -> None:
    plan = explain(vacuumed_queue, "metrics_queue_state",
                   {"lanes": SAMPLED_LANES, "now": None})
    check_sampler_plan(plan)


def test_the_sampler_generic_plan_counts_from_indexes(
        vacuumed_queue: psycopg.Connection) -> None:
    # The supervisor runs it every few seconds on one connection: psycopg prepares it.
    vacuumed_queue.execute("SET plan_cache_mode = force_generic_plan")
    try:
        plan = explain(vacuumed_queue, "metrics_queue_state",
                       {"lanes": SAMPLED_LANES, "now": None})
    finally:
        vacuumed_queue.execute("RESET plan_cache_mode")
    check_sampler_plan(plan)


def test_the_sampler_reads_index_pages_not_the_heap(
        vacuumed_queue: psycopg.Connection) -> None:
    plan = explain(vacuumed_queue, "metrics_queue_state",
                   {"lanes": SAMPLED_LANES, "now": None}, analyze=True)
    rows = {n.get("Index Name"): n for n in nodes(plan)
            if n["Node Type"] == "Index Only Scan"}
    claimable = rows["jobs_claimable_idx"]
    # One scan per lane: EXPLAIN gives rows per loop.
    assert claimable["Actual Rows"] * claimable["Actual Loops"] == FUTURE_JOBS + DUE_JOBS
    # A vacuumed table: the counts never visit the heap of the million waiting jobs.
    assert claimable["Heap Fetches"] == 0
    # The whole sample reads the two counted indexes once, plus the claimed jobs' heap
    # pages, the small indexes and the oldest-wait probes of each lane's priorities
    # (observed: the indexes' pages + ~350); never the table of a million rows.
    row = vacuumed_queue.execute(
        "SELECT sum(relpages) FILTER (WHERE relname IN ('jobs_claimable_idx', "
        "                                               'dead_letter_lane_idx')), "
        "       sum(relpages) FILTER (WHERE relname = 'jobs') "
        "  FROM pg_class WHERE relnamespace = 'jobd'::regnamespace").fetchone()
    assert row is not None
    index_pages, table_pages = row
    # A read of the heap would add its 14,000 pages. (A bound of half the table's pages was
    # met under load, at 7,190 against 7,186: the counted index alone is nearly half.)
    assert table_pages > 2 * 600
    assert pages(plan) < index_pages + 600


@pytest.fixture(scope="module")
def held_queue(databases: Databases) -> Iterator[psycopg.Connection]:
    """A queue of its own (the fenced writes below leave dead versions that would change
    the sampler's reads of big_queue): 100,000 future jobs and CLAIMED_JOBS claimed."""
    url = databases.migrated()
    with connect(url) as conn:
        conn.execute(
            """INSERT INTO jobs (lane, handler, run_at)
               SELECT 'default', 'send_email', now() + make_interval(secs => 60 + i)
                 FROM generate_series(1, 100000) AS i""")
        add_claimed_jobs(conn, leases_from=30)
        conn.execute("ANALYZE jobs")
        yield conn
    drop_database(databases, url)


def held_leases(conn: psycopg.Connection, count: int) -> list[Lease]:
    rows = conn.execute("SELECT id, lease_token FROM jobs WHERE state = 'claimed' ORDER BY id"
                        " LIMIT %s", [count]).fetchall()
    return [Lease(job_id, token) for job_id, token in rows]


def fenced_params(name: str, leases: list[Lease]) -> dict[str, Any]:
    if name == "fail_jobs":
        failures = [queue.Failure(lease, "boom", 1.0, 8) for lease in leases]
        return queue._fail_params(failures, None, expired_only=False)
    return {**queue.lease_arrays(leases), "visibility_timeout": 30.0, "now": None}


@pytest.mark.parametrize("name", ["heartbeat", "complete_jobs", "fail_jobs", "release_jobs",
                                  "release_as_suspects"])
def test_fenced_batch_writes_probe_the_primary_key_in_the_generic_plan(
    held_queue: psycopg.Connection, name: str,
) -> None:
    """A worker's outcomes, renewals and give-backs find their rows by id, whatever plan
    the server settled on, and check the tokens by a join: one pass over the batch, not one
    per row (a completion of 500 jobs cost 16.9 µs a job with a lookup per row, 6.5 with the
    join)."""
    leases = held_leases(held_queue, 500)
    held_queue.execute("SET plan_cache_mode = force_generic_plan")
    try:
        plan = explain(held_queue, name, fenced_params(name, leases), analyze=True)
    finally:
        held_queue.execute("RESET plan_cache_mode")
    assert seq_scans_on_jobs(plan) == []
    assert "jobs_pkey" in indexes_used(plan)
    assert "jobs_lease_idx" not in indexes_used(plan)
    # No scan of jobs returns more rows than the batch has (2,000 are claimed).
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "jobs" and "Index Name" in n]
    assert scans and all(n["Actual Rows"] * n["Actual Loops"] <= len(leases) for n in scans)
    # Every lease matched its row: the rows written are the batch, no more, no fewer.
    assert plan["Actual Rows"] == len(leases)


# --- the dead-letter queue's purge -----------------------------------------------------------

KEYED_JOBS = 20_000


def test_a_purge_finds_the_purged_jobs_keys_by_key_not_by_reading_every_key(
    conn: psycopg.Connection,
) -> None:
    """`jobd dlq purge` frees the keys of the jobs it purges. It looked them up by job id,
    which job_keys has no index for: every purge read the whole table, every keyed job of the
    retention period (hundreds of millions of rows at 500 jobs/s for a week), to purge even
    one job. Each key is now one probe of the primary key; the other keys are not read."""
    conn.execute(
        """INSERT INTO job_keys (idempotency_key, job_id)
           SELECT 'kept-' || i, i FROM generate_series(1, %s) AS i""", (KEYED_JOBS,))
    conn.execute(
        """INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,
                                    idempotency_key, created_at, errors, died_at)
           SELECT 100000 + i, 'default', 'send_email', '{}', 0, now(), 8,
                  CASE WHEN i <= 3 THEN 'dead-' || i END, now(), '[]',
                  now() - interval '2 days'
             FROM generate_series(1, 5) AS i""")
    conn.execute("""INSERT INTO job_keys (idempotency_key, job_id)
                    SELECT 'dead-' || i, 100000 + i FROM generate_series(1, 3) AS i""")
    conn.execute("ANALYZE job_keys")
    conn.execute("ANALYZE dead_letter")
    plan = explain(conn, "purge_dead", {"before": datetime.now().astimezone()
                                         - timedelta(days=1)}, analyze=True)
    key_scans = [n for n in nodes(plan) if n.get("Relation Name") == "job_keys"
                 and n["Node Type"] != "ModifyTable"]
    assert key_scans
    assert all(n["Node Type"] != "Seq Scan" for n in key_scans)
    assert all(n["Actual Rows"] * n["Actual Loops"] <= 3 for n in key_scans)
    # EXPLAIN ANALYZE rolled back: purged for real, the dead jobs' keys go, the others stay.
    assert conn.execute(query("purge_dead"), {"before": datetime.now().astimezone()}
                        ).fetchone() == (5,)
    assert conn.execute("SELECT count(*) FROM job_keys WHERE idempotency_key LIKE 'dead-%'"
                        ).fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM job_keys").fetchone() == (KEYED_JOBS,)

-- Every statement jobd runs against its own schema, by name. jobd/queries.py loads the blocks
-- into a dict; Python never assembles SQL from strings.
--
-- Conventions: the connection's search_path is the jobd schema, so names are unqualified.
-- Queries that compare time take %(now)s: NULL in production (the database clock, now()),
-- a fixed instant in tests. Statements that finish jobs check the fencing pair
-- (id, lease_token), so a worker that lost its lease changes nothing.
--
-- A matching lease_token implies state = 'claimed' (a CHECK constraint ties a token to that
-- state and every other transition clears it), so fenced statements test the token alone.
--
-- Plan shape: psycopg prepares a statement after a few uses and PostgreSQL then settles on a
-- generic plan that cannot see the parameters. Batch statements therefore select their rows
-- with `id = ANY(%(ids)s)` (a primary-key probe in any plan), and join them to
-- `unnest(ids, tokens) AS lease(id, token)` on both columns to check each row's token (and
-- to read the other per-job arrays at the row's position). Without the ANY probe, the join
-- alone, or `state = 'claimed'`, let the generic plan walk every claimed row through
-- jobs_lease_idx. The join is hashed: `tokens[array_position(ids, id)]`, used before, reads
-- the arrays once per row, and a completion of 500 jobs cost 16.9 µs a job against 6.5.

-- name: enqueue_qualified
-- The single-job path, also used on callers' own connections, so the schema is an identifier
-- supplied with psycopg.sql. Seven arguments, as before migration 0013: a producer upgraded
-- before the database still enqueues (docs/upgrades.md).
SELECT {schema}.enqueue(%(handler)s, %(payload)s, %(lane)s,
                        coalesce(%(run_at)s, now() + make_interval(secs => %(delay)s)),
                        %(priority)s, %(idempotency_key)s, %(max_attempts)s)

-- name: enqueue_with_fairness_key_qualified
-- enqueue_qualified for a job with a fairness key (migration 0013).
SELECT {schema}.enqueue(%(handler)s, %(payload)s, %(lane)s,
                        coalesce(%(run_at)s, now() + make_interval(secs => %(delay)s)),
                        %(priority)s, %(idempotency_key)s, %(max_attempts)s, %(fairness_key)s)

-- name: open_transaction
-- Nothing but the statement that makes psycopg begin the caller's transaction (it sends
-- BEGIN before a connection's first statement outside autocommit): enqueue_many then
-- writes in a savepoint of it.
SELECT 1

-- name: reserve_ids_qualified
-- Job ids for a bulk enqueue, and the transaction's now() for rows that give no run_at; the
-- size of the batch's largest payload is checked against the database's limit on the way.
SELECT now(), ARRAY(SELECT nextval({job_id_seq}) FROM generate_series(1, %(count)s)),
       {schema}.check_payload_size(%(largest_payload)s)

-- name: reserve_keys_qualified
-- Claims idempotency keys for a bulk enqueue: the returned keys are new and their jobs must be
-- inserted; keys already taken are looked up with lookup_keys_qualified.
INSERT INTO {schema}.job_keys AS k (idempotency_key, job_id)
SELECT key, nextval({job_id_seq})
  FROM unnest(%(keys)s::text[]) AS key
ON CONFLICT DO NOTHING
RETURNING k.idempotency_key, k.job_id

-- name: lookup_keys_qualified
SELECT idempotency_key, job_id FROM {schema}.job_keys WHERE idempotency_key = ANY(%(keys)s::text[])

-- name: copy_jobs_qualified
-- Without fairness_key, as before migration 0013: a producer upgraded before the database
-- still enqueues in bulk (docs/upgrades.md).
COPY {schema}.jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts)
FROM STDIN (FORMAT BINARY)

-- name: copy_jobs_with_fairness_keys_qualified
COPY {schema}.jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts,
                    fairness_key)
FROM STDIN (FORMAT BINARY)

-- name: claim_jobs
-- Claims up to %(limit)s due jobs of one lane, highest priority first, then oldest run_at.
-- The lane's priorities come from lane_priorities; within each, the scan starts at the
-- worker's floor for it (lane_floors(), jobd/claim_floors.py; the head without one), so it
-- does not walk the dead index entries of jobs claimed before, which vacuum cannot remove
-- while an old transaction holds the horizon back (docs/design/queue.md, "Claim floors").
-- run_at bounds the range from above: future scheduled jobs are never visited. SKIP LOCKED
-- lets concurrent claimers pass each other. The attempt is counted here, so a job that
-- kills its worker still spends its budget. Suspects (see claim_suspect) are left out.
-- claimed_at records the claim for the archive (pickup delay and claim-to-finish time, see
-- lane_latency). Pauses (jobd.pause, a probe of the tiny lane_pauses): a paused lane claims
-- nothing, a paused handler's jobs are stepped over (runnable(), in migrations/0011: a
-- function the planner does not see into, so that the filter keeps this plan), and so are
-- %(lacking_handlers)s, the handlers the claiming worker's node does not have (usually none;
-- jobd/claimer.py learns them from the jobs it claimed and gave back). runnable() is a call
-- per row (0.3-0.5 us); with no handler to step over, the OR's first arm, evaluated once,
-- spares every row the call (a claim of 500 rows' locking select: 1.7 -> 1.2 us a row).
WITH paused AS (
    SELECT coalesce(bool_or(handler IS NULL), false) AS whole_lane,
           coalesce(array_agg(handler) FILTER (WHERE handler IS NOT NULL), '{}')
           || %(lacking_handlers)s::text[] AS handlers
      FROM lane_pauses
     WHERE lane = %(lane)s
),
levels AS (
    SELECT priority, floor_at, floor_id
      FROM lane_floors(%(lane)s, %(floor_priorities)s::int[], %(floor_run_ats)s::timestamptz[],
                       %(floor_ids)s::bigint[], %(floor_ages)s::float8[],
                       %(default_floor_age)s::float8, coalesce(%(now)s::timestamptz, now()))
     WHERE NOT (SELECT whole_lane FROM paused)
     ORDER BY priority DESC
),
due AS (
    SELECT d.id, l.priority, d.run_at, d.stored, d.last
      FROM levels AS l
     CROSS JOIN LATERAL (
           SELECT id, run_at, pg_column_size(payload) AS stored,
                  attempts + 1 >= coalesce(max_attempts, %(lane_max_attempts)s::int) AS last
             FROM jobs
            WHERE lane = %(lane)s AND state IN ('pending', 'failed')
              AND priority = l.priority
              AND (run_at, id) >= (l.floor_at, l.floor_id)
              AND run_at <= coalesce(%(now)s::timestamptz, now())
              AND NOT suspect
              AND ((SELECT cardinality(handlers) = 0 FROM paused)
                   OR runnable(handler, (SELECT handlers FROM paused)))
            ORDER BY run_at, id
            LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED) AS d
     -- A worker that holds a suspect runs it alone (claim_suspect); a one-time probe of
     -- the suspect index, empty but for the rare crash.
     WHERE NOT EXISTS (SELECT 1 FROM jobs AS s
                        WHERE s.lane = %(lane)s AND s.suspect AND s.state = 'claimed'
                          AND s.claimed_by = %(worker)s)
     LIMIT %(limit)s
),
-- Two cuts, each only when it applies (the CASE below evaluates one of its arrays, so a claim
-- of small payloads and first attempts pays for a sum and a bool_or). The byte bound: when the
-- payload the jobs locked above hold in all (their size on disk, as compressed there: all a
-- claim can read without decompressing them) is over %(payload_bytes)s, the claim takes them
-- in claim order while the payload before each is under it, and never fewer than %(least)s.
-- The last attempts: a job whose claim spends its last attempt is taken only among the first
-- %(starting)s, the jobs that start at once; the claim ends before the first other one. A
-- job held ahead of a free slot spends its attempt if the whole node dies (its run board dies
-- with it: docs/design/queue.md, "What an expired lease cannot tell"), and on its last
-- attempt it would reach the dead-letter queue unrun. NULL: no bound, no cut. The jobs left
-- stay locked only until this statement's transaction ends. Every row ends with one number
-- (queue._claimed reads it; one column, as two more cost a claim's rows 1-2 percent to load):
-- 4 x the count of the jobs locked, which tells the worker the claim was cut short, not dry;
-- + 2 if the byte bound ended the claim (cuts, below), which tells it the size the bound
-- stands for; + 1 if a job on its last attempt was locked, which tells it to start the jobs
-- in claim order (the rows come back in the order the UPDATE finds them).
totals AS (
    SELECT count(*)::int AS locked,
           coalesce(sum(stored) > %(payload_bytes)s::bigint, false) AS over_bound,
           coalesce(bool_or(last), false) AND %(starting)s::int IS NOT NULL AS any_last
      FROM due
),
-- The locked jobs in claim order, and which of them each cut leaves: read only for a claim
-- that is cut (the CASE's first arm, and the byte bound's bit below).
numbered AS (
    SELECT id, n,
           NOT (SELECT over_bound FROM totals) OR n <= %(least)s
           OR before < %(payload_bytes)s::bigint AS within_bound,
           last AND n > %(starting)s::int AS past_starting
      FROM (SELECT id, last, row_number() OVER w AS n, sum(stored) OVER w - stored AS before
              FROM due
            WINDOW w AS (ORDER BY priority DESC, run_at, id ROWS UNBOUNDED PRECEDING)) AS s
),
-- What a cut claim takes: the jobs within the bound, up to the first last attempt past the
-- jobs that start at once.
kept AS (
    SELECT id
      FROM (SELECT id, within_bound,
                   bool_or(past_starting) OVER (ORDER BY n ROWS UNBOUNDED PRECEDING)
                       AS at_or_past_last
              FROM numbered) AS cut
     WHERE within_bound AND NOT coalesce(at_or_past_last, false)
),
-- What the number at the end of each row tells: the byte bound's 2 only when the byte bound
-- ended the claim, not when a last attempt ended it before the job the bound would have
-- (its jobs then hold less than the bound, and taken for it they would teach the worker a
-- size per job too large: jobd/prefetch.py).
cuts AS (
    SELECT locked, any_last,
           CASE WHEN NOT (over_bound AND any_last) THEN over_bound
                ELSE coalesce((SELECT min(n) FILTER (WHERE NOT within_bound)
                                      <= coalesce(min(n) FILTER (WHERE past_starting),
                                                  %(limit)s::int + 1)
                                 FROM numbered), false) END AS bytes_cut
      FROM totals
)
UPDATE jobs
   SET state = 'claimed',
       attempts = jobs.attempts + 1,
       claimed_by = %(worker)s,
       claimed_at = coalesce(%(now)s::timestamptz, now()),
       lease_until = coalesce(%(now)s::timestamptz, now())
                     + make_interval(secs => %(visibility_timeout)s),
       lease_token = (SELECT new_lease_token())
 WHERE jobs.id = ANY(CASE WHEN (SELECT over_bound OR any_last FROM totals)
                         THEN ARRAY(SELECT id FROM kept)
                         ELSE ARRAY(SELECT id FROM due) END)
RETURNING jobs.id, jobs.lease_token, jobs.lane, jobs.handler, jobs.payload::text, jobs.priority,
          jobs.run_at, jobs.attempts, jobs.max_attempts, jobs.idempotency_key,
          jobs.created_at, jobs.lease_until, jobs.fairness_key,
          (SELECT 4 * locked + 2 * bytes_cut::int + any_last::int FROM cuts)

-- name: claim_jobs_ordered
-- claim_jobs for a lane with max_wait or fair_by (docs/design/fairness.md): claim_order()
-- (migrations/0013_fairness.sql) picks and locks the jobs, overdue ones first and shared
-- across keys, and this statement claims them as claim_jobs does. The pause and suspect
-- rules are claim_jobs'. So is the last attempts' cut: a job whose claim spends its last
-- attempt is taken only among the jobs that start at once, counted in claim order, and the
-- claim ends before the first other one (no count: no cut). No byte bound here. The rows
-- come back in claim order, which the worker starts them in (the UPDATE returns them in
-- the order it finds them by id), each ending with claim_jobs' number: 4 x the count of the
-- jobs claim_order locked (no + 1 for a last attempt: the order is the claim's already).
WITH paused AS (
    SELECT coalesce(bool_or(handler IS NULL), false) AS whole_lane,
           coalesce(array_agg(handler) FILTER (WHERE handler IS NOT NULL), '{}')
           || %(lacking_handlers)s::text[] AS handlers
      FROM lane_pauses
     WHERE lane = %(lane)s
),
chosen AS MATERIALIZED (
    SELECT claim_order(%(lane)s, %(floor_priorities)s::int[], %(floor_run_ats)s::timestamptz[],
                       %(floor_ids)s::bigint[], %(floor_ages)s::float8[],
                       %(default_floor_age)s::float8, coalesce(%(now)s::timestamptz, now()),
                       %(max_wait)s::float8, %(fair)s::boolean, %(key_cursor)s::text,
                       %(limit)s::int, p.handlers, %(key_floor_priorities)s::int[],
                       %(key_floor_keys)s::text[], %(key_floor_run_ats)s::timestamptz[],
                       %(key_floor_ids)s::bigint[]) AS ids
      FROM paused AS p
     WHERE NOT p.whole_lane
       AND NOT EXISTS (SELECT 1 FROM jobs AS s
                        WHERE s.lane = %(lane)s AND s.suspect AND s.state = 'claimed'
                          AND s.claimed_by = %(worker)s)
),
picked AS MATERIALIZED (
    SELECT u.id, u.n FROM chosen AS c, unnest(c.ids) WITH ORDINALITY AS u(id, n)
),
-- Where the cut falls: the place of the first job past the ones that start at once that is
-- on its last attempt (none: no cut).
cut AS (
    SELECT min(p.n) AS at
      FROM picked AS p
      JOIN jobs AS j ON j.id = p.id
     WHERE p.n > %(starting)s::int
       AND j.attempts + 1 >= coalesce(j.max_attempts, %(lane_max_attempts)s::int)
),
claimed AS (
    UPDATE jobs
       SET state = 'claimed',
           attempts = jobs.attempts + 1,
           claimed_by = %(worker)s,
           claimed_at = coalesce(%(now)s::timestamptz, now()),
           lease_until = coalesce(%(now)s::timestamptz, now())
                         + make_interval(secs => %(visibility_timeout)s),
           lease_token = (SELECT new_lease_token())
      FROM picked AS p
     WHERE jobs.id = p.id AND p.n < coalesce((SELECT at FROM cut), %(limit)s::int + 1)
    RETURNING jobs.id, jobs.lease_token, jobs.lane, jobs.handler, jobs.payload::text,
              jobs.priority, jobs.run_at, jobs.attempts, jobs.max_attempts,
              jobs.idempotency_key, jobs.created_at, jobs.lease_until, jobs.fairness_key, p.n
)
SELECT id, lease_token, lane, handler, payload, priority, run_at, attempts, max_attempts,
       idempotency_key, created_at, lease_until, fairness_key,
       (SELECT 4 * count(*)::int FROM picked)
  FROM claimed
 ORDER BY n

-- name: claim_jobs_limited
-- claim_jobs for a lane with limits across all nodes (lanes.<l>.max_running, lanes.<l>.rate):
-- the same scan, capped by the lane's budget and cut by the byte bound and the last attempts
-- as claim_jobs is (its rows end with the same number as claim_jobs'). The worker sends
-- lock_lane_budget first in the same transaction, so the claims of a limited lane take turns and each one's
-- snapshot sees every claim before it: the count of claimed jobs (through jobs_lease_idx) and the token
-- bucket in lane_tokens are exact. The bucket holds up to rate_limit tokens and refills at
-- rate_limit per rate_per seconds (clock_timestamp(): claims taking turns see their clock
-- move forward); the claim spends a token per job it takes. A query of its own, so lanes
-- without limits pay nothing for them. Keep the scan (paused, levels, due) in step with
-- claim_jobs: tests/test_limits.py compares the two.
WITH budget AS (
    SELECT greatest(0, least(%(limit)s::int, %(max_running)s::int - running.n,
                             floor(tokens.available)::int)) AS cap,
           tokens.available, tokens.at
      FROM (SELECT count(*)::int AS n FROM jobs
             WHERE state = 'claimed' AND lane = %(lane)s
               AND %(max_running)s::int IS NOT NULL) AS running,
           (SELECT clock.at,
                   least(%(rate_limit)s::float8,
                         t.tokens + %(rate_limit)s::float8 / %(rate_per)s::float8
                                    * greatest(0, extract(epoch FROM clock.at - t.refilled_at)))
                       AS available
              FROM (SELECT coalesce(%(now)s::timestamptz, clock_timestamp()) AS at) AS clock
              LEFT JOIN lane_tokens AS t ON t.lane = %(lane)s) AS tokens
),
paused AS (
    SELECT coalesce(bool_or(handler IS NULL), false) AS whole_lane,
           coalesce(array_agg(handler) FILTER (WHERE handler IS NOT NULL), '{}')
           || %(lacking_handlers)s::text[] AS handlers
      FROM lane_pauses
     WHERE lane = %(lane)s
),
levels AS (
    SELECT priority, floor_at, floor_id
      FROM lane_floors(%(lane)s, %(floor_priorities)s::int[], %(floor_run_ats)s::timestamptz[],
                       %(floor_ids)s::bigint[], %(floor_ages)s::float8[],
                       %(default_floor_age)s::float8, coalesce(%(now)s::timestamptz, now()))
     WHERE NOT (SELECT whole_lane FROM paused)
     ORDER BY priority DESC
),
due AS (
    SELECT d.id, l.priority, d.run_at, d.stored, d.last
      FROM levels AS l
     CROSS JOIN LATERAL (
           SELECT id, run_at, pg_column_size(payload) AS stored,
                  attempts + 1 >= coalesce(max_attempts, %(lane_max_attempts)s::int) AS last
             FROM jobs
            WHERE lane = %(lane)s AND state IN ('pending', 'failed')
              AND priority = l.priority
              AND (run_at, id) >= (l.floor_at, l.floor_id)
              AND run_at <= coalesce(%(now)s::timestamptz, now())
              AND NOT suspect
              AND ((SELECT cardinality(handlers) = 0 FROM paused)
                   OR runnable(handler, (SELECT handlers FROM paused)))
            ORDER BY run_at, id
            LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED) AS d
     -- A worker that holds a suspect runs it alone (claim_suspect); a one-time probe of
     -- the suspect index, empty but for the rare crash.
     WHERE NOT EXISTS (SELECT 1 FROM jobs AS s
                        WHERE s.lane = %(lane)s AND s.suspect AND s.state = 'claimed'
                          AND s.claimed_by = %(worker)s)
     LIMIT (SELECT cap FROM budget)
),
-- The byte bound and the last attempts' cut, as claim_jobs applies them: a lane with a rate
-- but no max_running claims ahead as a plain lane does. A lane with max_wait or fair_by has
-- neither (the worker sends no bound), and its totals do not read due.
totals AS (
    SELECT count(*)::int AS locked,
           coalesce(sum(stored) > %(payload_bytes)s::bigint, false) AS over_bound,
           coalesce(bool_or(last), false) AND %(starting)s::int IS NOT NULL AS any_last
      FROM due
     WHERE NOT %(ordered)s::boolean
),
-- The locked jobs in claim order, and which of them each cut leaves (as in claim_jobs).
numbered AS (
    SELECT id, n,
           NOT (SELECT over_bound FROM totals) OR n <= %(least)s
           OR before < %(payload_bytes)s::bigint AS within_bound,
           last AND n > %(starting)s::int AS past_starting
      FROM (SELECT id, last, row_number() OVER w AS n, sum(stored) OVER w - stored AS before
              FROM due
            WINDOW w AS (ORDER BY priority DESC, run_at, id ROWS UNBOUNDED PRECEDING)) AS s
),
-- A lane with max_wait or fair_by as well: claim_order() picks within the budget instead
-- (one-time filters leave out the branches that do not apply).
chosen AS (
    SELECT id FROM due
     WHERE NOT %(ordered)s::boolean AND NOT (SELECT over_bound OR any_last FROM totals)
    UNION ALL
    SELECT id
      FROM (SELECT id, within_bound,
                   bool_or(past_starting) OVER (ORDER BY n ROWS UNBOUNDED PRECEDING)
                       AS at_or_past_last
              FROM numbered) AS cut
     WHERE (SELECT over_bound OR any_last FROM totals)
       AND within_bound AND NOT coalesce(at_or_past_last, false)
    UNION ALL
    SELECT unnest(claim_order(%(lane)s, %(floor_priorities)s::int[],
                              %(floor_run_ats)s::timestamptz[], %(floor_ids)s::bigint[],
                              %(floor_ages)s::float8[], %(default_floor_age)s::float8,
                              coalesce(%(now)s::timestamptz, now()), %(max_wait)s::float8,
                              %(fair)s::boolean, %(key_cursor)s::text,
                              (SELECT cap FROM budget), p.handlers,
                              %(key_floor_priorities)s::int[], %(key_floor_keys)s::text[],
                              %(key_floor_run_ats)s::timestamptz[],
                              %(key_floor_ids)s::bigint[]))
      FROM paused AS p
     WHERE %(ordered)s::boolean AND NOT p.whole_lane
       AND NOT EXISTS (SELECT 1 FROM jobs AS s
                        WHERE s.lane = %(lane)s AND s.suspect AND s.state = 'claimed'
                          AND s.claimed_by = %(worker)s)
),
-- What the number at the end of each row tells, as in claim_jobs: the byte bound's 2 only
-- when the byte bound ended the claim, not a last attempt before the job it would have.
cuts AS (
    SELECT locked, any_last,
           CASE WHEN NOT (over_bound AND any_last) THEN over_bound
                ELSE coalesce((SELECT min(n) FILTER (WHERE NOT within_bound)
                                      <= coalesce(min(n) FILTER (WHERE past_starting),
                                                  %(limit)s::int + 1)
                                 FROM numbered), false) END AS bytes_cut
      FROM totals
),
claimed AS (
    UPDATE jobs
       SET state = 'claimed',
           attempts = jobs.attempts + 1,
           claimed_by = %(worker)s,
           claimed_at = coalesce(%(now)s::timestamptz, now()),
           lease_until = coalesce(%(now)s::timestamptz, now())
                         + make_interval(secs => %(visibility_timeout)s),
           lease_token = (SELECT new_lease_token())
     WHERE jobs.id = ANY(ARRAY(SELECT id FROM chosen))
    RETURNING jobs.id, jobs.lease_token, jobs.lane, jobs.handler, jobs.payload::text,
              jobs.priority, jobs.run_at, jobs.attempts, jobs.max_attempts,
              jobs.idempotency_key, jobs.created_at, jobs.lease_until, jobs.fairness_key,
              (SELECT 4 * locked + 2 * bytes_cut::int + any_last::int FROM cuts)
),
spent AS (
    INSERT INTO lane_tokens AS t (lane, tokens, refilled_at)
    SELECT %(lane)s, coalesce(b.available, %(rate_limit)s) - (SELECT count(*) FROM claimed),
           b.at
      FROM budget AS b
     WHERE %(rate_limit)s::int IS NOT NULL
    ON CONFLICT (lane) DO UPDATE SET tokens = excluded.tokens, refilled_at = excluded.refilled_at
)
SELECT * FROM claimed

-- name: outcomes_plans_generic
-- First in a transaction of outcomes alone, of a small batch (queue.settle_and_claim,
-- GENERIC_PLANS_BELOW): its statements run their generic plans. Left to choose, PostgreSQL
-- prices complete_jobs' custom plan for a batch of one id (a primary-key probe) below its
-- generic plan (a bitmap scan sized for ten ids), so it planned the statement afresh at
-- most executions: at 200 jobs/s, 0.16 ms of planning for 0.07 ms of execution
-- (docs/performance.md). The generic plans read by the primary key too (sequential scans
-- are priced out of a worker's sessions: db.worker_session). Transaction-local: a claim
-- sent in the same exchange runs in a transaction of its own.
SELECT set_config('plan_cache_mode', 'force_generic_plan', true)

-- name: claim_commits_async
-- First in a claim's own transaction (queue.settle_and_claim): it commits asynchronously, so
-- the claimed jobs start when the claim is visible rather than after its WAL flush (a third
-- of the time from a wake-up's claim to its handler: p50 1.68 -> 1.13 ms at 200 jobs/s on a
-- 2-core machine, docs/performance.md). Losing a claim to a crash of the server
-- is safe: the job is as it was before the claim, and every later write of the claim's
-- worker is fenced by a lease token that no longer exists (at-least-once: the job runs
-- again). A handler's own transaction (exactly-once) commits synchronously, and its WAL
-- flush covers the claim's commit record before it: a durable effect implies a durable
-- claim. Outcomes are never in such a transaction: they commit synchronously, on their own
-- or with a claim that then waits for their flush.
SELECT set_config('synchronous_commit', 'off', true)

-- name: lock_lane_budget
-- Claims of a lane with limits take turns (claim_jobs_limited): the lock is held until the
-- claim's transaction commits, so the next claim sees it. The key carries the schema, as
-- wake_lock_key does. The claim's transaction commits asynchronously (claim_commits_async),
-- so the turn ends when the claim is visible rather than after its WAL flush: held across
-- flushes, the lock made the lane's claims wait for each other's fsync, which cost a
-- 2-worker drain a quarter. The worker writes outcomes in a transaction of their own before
-- it (queue.settle_and_claim).
-- Returns how long the statement waited for the lock (seconds, the server's clock): the
-- worker takes it out of the claim's round trip before timing a scan from the head
-- (Exchange._round_trip_took), which the other claims' turns would otherwise space out.
-- The select list is evaluated in order: the clock is read once the lock is held.
SELECT pg_advisory_xact_lock(hashtextextended(current_schema() || '.' || %(lane)s || '#budget',
                                              0)) AS locked,
       extract(epoch FROM clock_timestamp() - statement_timestamp())::float8 AS waited

-- name: arm_waiter
-- See arm_waiter() in migrations/0011_lane_controls.sql: 'armed', 'work', 'contended' or
-- 'paused'.
SELECT arm_waiter(%(lane)s, %(worker)s, %(floor_priorities)s::int[],
                  %(floor_run_ats)s::timestamptz[], %(floor_ids)s::bigint[],
                  %(floor_ages)s::float8[], %(default_floor_age)s::float8)

-- name: arm_waiter_register
-- Arming, first transaction: see arm_waiter_register() in migrations/0020_arming_apart.sql:
-- 'paused', 'contended' or 'registered'.
SELECT arm_waiter_register(%(lane)s, %(worker)s)

-- name: arm_waiter_probe
-- Arming, second transaction (arm_waiter_probe() in migrations/0020_arming_apart.sql, its
-- body since 0024, its last parameter since 0026: the handlers the worker's node does not
-- have): 'work' (the worker's row stays: it claims armed) or 'armed'.
SELECT arm_waiter_probe(%(lane)s, %(worker)s, %(floor_priorities)s::int[],
                        %(floor_run_ats)s::timestamptz[], %(floor_ids)s::bigint[],
                        %(floor_ages)s::float8[], %(default_floor_age)s::float8,
                        %(lacking_handlers)s::text[])

-- name: disarm_waiter
-- A worker that takes work (or stops) no longer waits: enqueues stop notifying for it.
DELETE FROM lane_waiters WHERE worker_id = %(worker)s

-- name: claim_suspect
-- Claims the lane's oldest due suspect, one job, for a worker that holds nothing: the jobs of
-- a worker that died while running several of them, each run alone until the one that kills
-- its worker is found (it then spends an attempt; the others keep theirs). A worker idle
-- enough to ask sends this before claim_jobs in the same transaction, and claim_jobs then
-- takes nothing while the suspect is held. Pauses and lacking handlers apply as in
-- claim_jobs. In a lane with limits (%(max_running)s, %(rate_limit)s: NULL otherwise) it is
-- sent after lock_lane_budget, as claim_jobs_limited, and a suspect is budgeted as any
-- claimed job: none is taken while the lane is full or its bucket holds less than a token,
-- and a suspect taken spends one (the bucket's arithmetic as in claim_jobs_limited).
WITH tokens AS (
    SELECT clock.at,
           least(%(rate_limit)s::float8,
                 t.tokens + %(rate_limit)s::float8 / %(rate_per)s::float8
                            * greatest(0, extract(epoch FROM clock.at - t.refilled_at)))
               AS available
      FROM (SELECT coalesce(%(now)s::timestamptz, clock_timestamp()) AS at) AS clock
      LEFT JOIN lane_tokens AS t ON t.lane = %(lane)s
     WHERE %(rate_limit)s::int IS NOT NULL
),
claimed AS (
    UPDATE jobs
       SET state = 'claimed',
           attempts = jobs.attempts + 1,
           claimed_by = %(worker)s,
           claimed_at = coalesce(%(now)s::timestamptz, now()),
           lease_until = coalesce(%(now)s::timestamptz, now())
                         + make_interval(secs => %(visibility_timeout)s),
           lease_token = (SELECT new_lease_token())
     WHERE jobs.id = (SELECT id FROM jobs
                       WHERE lane = %(lane)s AND suspect AND state IN ('pending', 'failed')
                         AND run_at <= coalesce(%(now)s::timestamptz, now())
                         AND NOT EXISTS (SELECT 1 FROM lane_pauses AS p
                                          WHERE p.lane = %(lane)s
                                            AND (p.handler IS NULL OR p.handler = jobs.handler))
                         AND runnable(handler, %(lacking_handlers)s::text[])
                         AND (%(max_running)s::int IS NULL
                              OR (SELECT count(*) FROM jobs AS r
                                   WHERE r.state = 'claimed' AND r.lane = %(lane)s)
                                 < %(max_running)s::int)
                         -- A lane's first claim finds no bucket: it starts full.
                         AND (%(rate_limit)s::int IS NULL
                              OR coalesce((SELECT available FROM tokens), %(rate_limit)s) >= 1)
                       ORDER BY run_at
                       LIMIT 1
                         FOR UPDATE SKIP LOCKED)
    RETURNING jobs.id, jobs.lease_token, jobs.lane, jobs.handler, jobs.payload::text,
              jobs.priority, jobs.run_at, jobs.attempts, jobs.max_attempts,
              jobs.idempotency_key, jobs.created_at, jobs.lease_until, jobs.fairness_key
),
spent AS (
    INSERT INTO lane_tokens AS t (lane, tokens, refilled_at)
    SELECT %(lane)s, coalesce(b.available, %(rate_limit)s) - 1, b.at
      FROM tokens AS b
     WHERE EXISTS (SELECT 1 FROM claimed)
    ON CONFLICT (lane) DO UPDATE SET tokens = excluded.tokens, refilled_at = excluded.refilled_at
)
SELECT * FROM claimed

-- name: heartbeat
-- Extends every lease a worker still holds, in one statement. Returns the jobs whose lease was
-- extended, and whether each was asked to stop (jobd.cancel): so the worker learns of a
-- cancellation without a round trip of its own. A job missing from the result was lost
-- (expired and swept or re-claimed).
UPDATE jobs
   SET lease_until = coalesce(%(now)s::timestamptz, now())
                     + make_interval(secs => %(visibility_timeout)s)
  FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS lease(id, token)
 WHERE jobs.id = ANY(%(ids)s::bigint[])
   AND jobs.id = lease.id AND jobs.lease_token = lease.token
RETURNING jobs.id, jobs.cancel_requested_at IS NOT NULL

-- name: complete_jobs
-- Finishes a batch: the rows leave the hot table and enter the archive in one statement. A
-- job that was asked to stop (jobd.cancel) is archived as 'cancelled' however it ended;
-- each row comes back with the state it was archived in.
-- It also runs inside transactional handlers' transactions, on connections whose search_path
-- is the user's: hence {schema}. (see jobd/queries.py).
WITH finished AS (
    DELETE FROM {schema}.jobs
     USING unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS lease(id, token)
     WHERE jobs.id = ANY(%(ids)s::bigint[])
       AND jobs.id = lease.id AND jobs.lease_token = lease.token
    RETURNING jobs.*
)
INSERT INTO {schema}.jobs_archive (id, lane, handler, payload, state, priority, run_at, attempts,
                          max_attempts, claimed_by, idempotency_key, created_at, last_error,
                          errors, finished_at, claimed_at, fairness_key)
SELECT id, lane, handler, payload,
       CASE WHEN cancel_requested_at IS NULL THEN 'done' ELSE 'cancelled' END, priority,
       run_at, attempts, max_attempts, claimed_by, idempotency_key, created_at, last_error,
       errors, coalesce(%(now)s::timestamptz, now()), claimed_at, fairness_key
  FROM finished
RETURNING id, state

-- name: fail_jobs
-- Records a failed attempt for a batch. Each row carries its retry delay (computed by
-- jobd.backoff), the lane's default attempt budget and whether the failure is final (a
-- payload that cannot be decoded: retrying cannot help), at the same position as its id. A job
-- with budget left waits as 'failed' until run_at; a job without is moved to the dead-letter
-- queue in the same statement. With %(expired_only)s, only rows whose lease has run out are
-- touched (the sweep must not fail a job whose worker renewed its lease in the meantime).
-- A job that was asked to stop (jobd.cancel) is archived as 'cancelled' instead, its error
-- (the handler's CancelledError, say) recorded: it is not retried, whatever its budget.
WITH failure AS (
    SELECT jobs.id,
           lease.position,
           jobs.cancel_requested_at IS NOT NULL AS cancelled,
           lease.final
           OR jobs.attempts >= coalesce(jobs.max_attempts, lease.default_max_attempts)
               AS spent
      FROM jobs
      JOIN unnest(%(ids)s::bigint[], %(tokens)s::bigint[], %(final)s::bool[],
                  %(default_max_attempts)s::int[]) WITH ORDINALITY
           AS lease(id, token, final, default_max_attempts, position)
        ON jobs.id = lease.id AND jobs.lease_token = lease.token
     WHERE jobs.id = ANY(%(ids)s::bigint[])
       AND (NOT %(expired_only)s
            OR jobs.lease_until < coalesce(%(now)s::timestamptz, now()))
       FOR UPDATE OF jobs
),
retried AS (
    UPDATE jobs
       SET state = 'failed',
           run_at = coalesce(%(now)s::timestamptz, now())
                    + make_interval(secs => (%(delays)s::float8[])[f.position]),
           lease_until = NULL,
           lease_token = NULL,
           last_error = (%(errors)s::text[])[f.position],
           errors = jobs.errors || jsonb_build_object(
               'attempt', jobs.attempts, 'at', coalesce(%(now)s::timestamptz, now()),
               'error', (%(errors)s::text[])[f.position], 'worker', jobs.claimed_by)
      FROM failure AS f
     WHERE jobs.id = f.id AND NOT f.spent AND NOT f.cancelled
    RETURNING jobs.id, jobs.run_at
),
died AS (
    DELETE FROM jobs
     USING failure AS f
     WHERE jobs.id = f.id AND f.spent AND NOT f.cancelled
    RETURNING jobs.*, (%(errors)s::text[])[f.position] AS final_error
),
buried AS (
    INSERT INTO dead_letter (id, lane, handler, payload, priority, run_at, attempts,
                             max_attempts, claimed_by, idempotency_key, created_at,
                             last_error, errors, died_at, fairness_key)
    SELECT id, lane, handler, payload, priority, run_at, attempts, max_attempts, claimed_by,
           idempotency_key, created_at, final_error,
           errors || jsonb_build_object(
               'attempt', attempts, 'at', coalesce(%(now)s::timestamptz, now()),
               'error', final_error, 'worker', claimed_by),
           coalesce(%(now)s::timestamptz, now()), fairness_key
      FROM died
    RETURNING id
),
stopped AS (
    DELETE FROM jobs
     USING failure AS f
     WHERE jobs.id = f.id AND f.cancelled
    RETURNING jobs.*, (%(errors)s::text[])[f.position] AS final_error
),
-- An outbox delivery whose run ended without delivering (a delivery marks its entry
-- delivered in the transaction that completes it): its entry will not be delivered.
undelivered AS (
    UPDATE outbox AS o SET state = 'dead', last_error = 'cancelled before delivery'
      FROM stopped AS s
     WHERE (s.handler = 'jobd.outbox' OR starts_with(s.handler, 'jobd.outbox:'))
       AND o.delivery_job_id = s.id AND o.state = 'pending'
),
cancelled AS (
    INSERT INTO jobs_archive (id, lane, handler, payload, state, priority, run_at, attempts,
                              max_attempts, claimed_by, idempotency_key, created_at,
                              last_error, errors, finished_at, claimed_at,
                              fairness_key)
    SELECT id, lane, handler, payload, 'cancelled', priority, run_at, attempts, max_attempts,
           claimed_by, idempotency_key, created_at, final_error,
           errors || jsonb_build_object(
               'attempt', attempts, 'at', coalesce(%(now)s::timestamptz, now()),
               'error', final_error, 'worker', claimed_by),
           coalesce(%(now)s::timestamptz, now()), claimed_at, fairness_key
      FROM stopped
    RETURNING id
)
SELECT id, 'failed' AS outcome, run_at FROM retried
UNION ALL
SELECT id, 'dead', NULL FROM buried
UNION ALL
SELECT id, 'cancelled', NULL FROM cancelled

-- name: outcomes_on_record
-- After a write of outcomes whose answer never came (a lost connection), sent again and
-- refused by the fence: the attempts whose first write did commit (jobd/unanswered.py). Each
-- is (id, attempt, error; NULL: a success). A success is on record as the archived row of that
-- attempt, claimed by this worker, with no error entry for the attempt (a lease sweep that
-- archived it as cancelled leaves one; complete_jobs never does). A failure is on record as
-- its own entry in the job's errors (attempt, worker and text), wherever the job is now: dead
-- or cancelled by that write if it ended there at that attempt, retried otherwise.
WITH sent AS (
    SELECT a.id, a.attempt, a.error,
           jsonb_build_array(jsonb_build_object('attempt', a.attempt, 'worker', %(worker)s::text,
                                                'error', a.error)) AS entry
      FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(errors)s::text[])
           AS a(id, attempt, error)
)
SELECT s.id, x.state
  FROM sent AS s
  JOIN jobs_archive AS x ON x.id = s.id
 WHERE s.error IS NULL AND x.attempts = s.attempt AND x.claimed_by = %(worker)s
   AND NOT x.errors @> jsonb_build_array(jsonb_build_object('attempt', s.attempt))
UNION ALL
SELECT s.id,
       CASE WHEN r.attempts <> s.attempt THEN 'failed'
            WHEN r.place = 'dead_letter' THEN 'dead'
            WHEN r.state = 'cancelled' THEN 'cancelled'
            ELSE 'failed' END
  FROM sent AS s
 CROSS JOIN LATERAL (
       SELECT 'jobs' AS place, j.state, j.attempts FROM jobs AS j
        WHERE j.id = s.id AND j.errors @> s.entry
       UNION ALL
       SELECT 'jobs_archive', x.state, x.attempts FROM jobs_archive AS x
        WHERE x.id = s.id AND x.errors @> s.entry
       UNION ALL
       SELECT 'dead_letter', 'dead', d.attempts FROM dead_letter AS d
        WHERE d.id = s.id AND d.errors @> s.entry
       LIMIT 1) AS r
 WHERE s.error IS NOT NULL

-- name: release_jobs
-- Gives claimed jobs back without spending their attempt (a drain, a worker's buffer, a dead
-- worker's unstarted jobs): they are claimable again at once, by any node, and their lanes
-- are woken as an enqueue would wake them (the insert trigger does not see an UPDATE),
-- 'behind' included: a job due since before the claim floors' margin sits below the floors
-- the lane's workers have moved past, where a claim from the floors would not see it for up
-- to a second. A job asked to stop (jobd.cancel) is not given back: its worker finishes it
-- as cancelled when it learns of the request at its next renewal, which the cancel's
-- notification makes immediate, or from this release itself (held_asked_to_stop), else the
-- lease sweep does.
WITH released AS (
    UPDATE jobs
       SET state = 'pending',
           attempts = greatest(jobs.attempts - 1, 0),
           lease_until = NULL,
           lease_token = NULL,
           claimed_by = NULL
      FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS lease(id, token)
     WHERE jobs.id = ANY(%(ids)s::bigint[])
       AND jobs.id = lease.id AND jobs.lease_token = lease.token
       AND jobs.cancel_requested_at IS NULL
    RETURNING jobs.id, jobs.lane, jobs.run_at
),
woken AS (
    SELECT pg_notify(current_schema() || '_wakeup', lane || '#' || count(*)),
           CASE WHEN min(run_at) < clock_timestamp() - interval '0.5 seconds'
                THEN pg_notify(current_schema() || '_wakeup', lane || '!behind') END
      FROM released GROUP BY lane
)
SELECT id FROM released WHERE (SELECT count(*) FROM woken) >= 0

-- name: held_asked_to_stop
-- After a worker's release of its buffered jobs: those it still holds under the same lease
-- because they were asked to stop (release_jobs leaves them), which it finishes as
-- cancelled at once; a job missing here was not its own any more.
SELECT jobs.id
  FROM jobs, unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS lease(id, token)
 WHERE jobs.id = ANY(%(ids)s::bigint[])
   AND jobs.id = lease.id AND jobs.lease_token = lease.token
   AND jobs.cancel_requested_at IS NOT NULL

-- name: end_lost_backends
-- A worker whose connection was lost, before it looks for claims whose rows never reached
-- it: ends the backends of its lost connections (%(pids)s, named as its connection is, as
-- the server keeps the name: a pid reused since by another session is left alone), so that
-- a claim still running there (waiting on a lock) cannot commit after the look. Waits up to
-- %(wait_ms)s for each to exit; returns those that did not (a backend already gone is not
-- listed; one that exits between the two reads is, and is looked for again). The backends
-- are chosen in a materialized CTE first: in one WHERE the planner orders the conditions
-- by cost and ran pg_terminate_backend before the name and own-pid checks.
WITH ours AS MATERIALIZED (
    SELECT pid
      FROM pg_stat_activity
     WHERE pid = ANY(%(pids)s::int[])
       AND application_name = current_setting('application_name')
       AND pid <> pg_backend_pid()
)
SELECT pid FROM ours WHERE NOT pg_terminate_backend(pid, %(wait_ms)s)

-- name: release_as_suspects
-- Crash attribution for a worker that died holding several jobs: each gets its attempt back
-- and becomes a suspect, to be run alone (claim_suspect). Jobs asked to stop are not among
-- them: crash attribution fails those (fail_jobs archives them as cancelled).
UPDATE jobs
   SET state = 'pending',
       attempts = greatest(jobs.attempts - 1, 0),
       lease_until = NULL,
       lease_token = NULL,
       claimed_by = NULL,
       suspect = true
  FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]) AS lease(id, token)
 WHERE jobs.id = ANY(%(ids)s::bigint[])
   AND jobs.id = lease.id AND jobs.lease_token = lease.token
   AND jobs.cancel_requested_at IS NULL
RETURNING jobs.id

-- name: mark_suspect
-- A job that killed its worker alone keeps running alone on its retries, and the failure
-- fail_jobs just recorded (the last of its errors) is marked as a crash it caused: crash
-- attribution counts them against the lane's max_crashes (jobs_held_by).
UPDATE jobs
   SET suspect = true,
       errors = CASE WHEN jsonb_array_length(errors) = 0 THEN errors
                     ELSE jsonb_set(errors, ARRAY[(jsonb_array_length(errors) - 1)::text],
                                    (errors -> -1) || '{"killed_worker": true}') END
 WHERE id = ANY(%(ids)s::bigint[])

-- name: mark_killed_worker_dead
-- The crash that dead-lettered a job that killed its worker alone (its budget of attempts
-- or of crashes spent) is marked in its history as the crashes before it were
-- (mark_suspect): the dead-letter queue shows every failure that was a crash it caused.
UPDATE dead_letter
   SET errors = jsonb_set(errors, ARRAY[(jsonb_array_length(errors) - 1)::text],
                          (errors -> -1) || '{"killed_worker": true}')
 WHERE id = ANY(%(ids)s::bigint[]) AND jsonb_array_length(errors) > 0

-- name: terminate_worker_backends
-- Crash attribution, first: ends the backends of a worker process that died (its
-- connections' application_name starts with %(prefix)s) and waits up to a second for each
-- to exit, so nothing it sent can still commit. Usually there is none left.
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 1000))
  FROM pg_stat_activity
 WHERE datname = current_database()
   AND starts_with(application_name, %(prefix)s)
   AND pid <> pg_backend_pid()

-- name: terminate_stale_handlers
-- The lease sweep's second half: a transactional handler of an expired lease may still hold
-- its transaction open (a frozen process or node), and with it the locks its next run needs.
-- Its backend carries the lease in application_name (set in record_effect_key).
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
  FROM pg_stat_activity
 WHERE datname = current_database()
   AND application_name = ANY(%(names)s::text[])
   AND pid <> pg_backend_pid()

-- name: expired_leases
-- Candidates for the lease-expiry sweep; rides jobs_lease_idx. With a look back (seconds),
-- only leases that ran out since now() less that: the scan starts there instead of at the
-- head, past the dead entries a held horizon keeps (jobd/head_scans.py).
-- With %(lanes)s (the lanes the sweeping node configures), a lane it does not configure is
-- left to the nodes that do, while one of them is live (judged as live_nodes judges it): the
-- failed attempt is retried on the lane's backoff and budget, which this node does not know
-- (its defaults would retry on the wrong backoff, or dead-letter the job early).
SELECT id, lease_token, lane, attempts, claimed_by
  FROM jobs
 WHERE state = 'claimed' AND lease_until < coalesce(%(now)s::timestamptz, now())
   AND lease_until >= coalesce(coalesce(%(now)s::timestamptz, now())
                               - make_interval(secs => %(look_back)s::float8), '-infinity')
   AND (%(lanes)s::text[] IS NULL OR lane = ANY(%(lanes)s::text[])
        OR NOT EXISTS (
            SELECT 1 FROM nodes AS n
             WHERE n.workers ? jobs.lane
               AND coalesce(%(now)s::timestamptz, now()) - n.seen_at
                   <= make_interval(secs => coalesce(
                          greatest(%(misses)s * n.heartbeat_interval,
                                   n.heartbeat_interval + %(grace)s),
                          %(unknown)s))))
 ORDER BY lease_until
 LIMIT %(limit)s

-- name: lock_expired
-- The expired leases' rows the sweep can lock, locked for its fail_jobs in the same
-- transaction. A row another session holds (a transactional handler's transaction left open
-- by a frozen or disconnected worker, having deleted the row) must not make the sweep wait on
-- it, nor its lock_timeout roll back the sweep of every other expired lease with the duties'
-- transaction: it is left to a later sweep.
SELECT id FROM jobs WHERE id = ANY(%(ids)s::bigint[]) FOR UPDATE SKIP LOCKED

-- name: jobs_held_by
-- The jobs a worker holds: failed at once when the supervisor sees it die, or by the worker
-- itself when a claim took jobs whose rows it never received. Rare, so no index of its own:
-- it reads the live jobs table. The sixth column says whether the job was asked to stop;
-- the handler is for the log; the last, how many times the job killed its worker before,
-- running alone (the failures mark_suspect marked; crash attribution's max_crashes), since
-- it was last replayed: a replay gives it a fresh budget of crashes as of attempts.
SELECT id, lease_token, lane, attempts, claimed_by, cancel_requested_at IS NOT NULL, handler,
       (SELECT count(*) FROM jsonb_array_elements(errors) WITH ORDINALITY AS e(entry, n)
         WHERE e.entry ? 'killed_worker'
           AND e.n > (SELECT coalesce(max(r.n), 0)
                        FROM jsonb_array_elements(errors) WITH ORDINALITY AS r(entry, n)
                       WHERE r.entry ? 'replayed_at'))::int
  FROM jobs
 WHERE state = 'claimed' AND claimed_by = %(worker)s

-- name: get_job
SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
       lease_until, claimed_by, idempotency_key, created_at, last_error, errors, finished_at,
       cancel_requested_at, fairness_key
  FROM all_jobs
 WHERE id = %(id)s

-- name: list_jobs
-- Newest first, from below an id when paging (jobd jobs list --before). It walks the ids
-- down and filters as it goes: a lane or state that few jobs have is read past every other
-- job's row (docs/operations.md, "Reading the queue at size").
SELECT id, lane, handler, state, priority, run_at, attempts, max_attempts, claimed_by,
       created_at, last_error, finished_at
  FROM all_jobs
 WHERE (%(state)s::text IS NULL OR state = %(state)s)
   AND (%(lane)s::text IS NULL OR lane = %(lane)s)
   AND (%(before)s::bigint IS NULL OR id < %(before)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: jobs_of_unlisted_handlers
-- jobd status: per lane and handler, the live jobs waiting to be claimed (pending or failed)
-- whose handler is not in the list (the handlers of the config it was given). A node with
-- that config gives such jobs back for the nodes that have the handler; if none has it, they
-- wait until one does. One scan of the live jobs, as lane_stats.
SELECT lane, handler, count(*)
  FROM jobs
 WHERE state IN ('pending', 'failed') AND handler <> ALL(%(handlers)s::text[])
 GROUP BY lane, handler
 ORDER BY lane, handler

-- name: lane_stats
-- Per lane: counts of live jobs by state, the longest wait of a due unclaimed job (from its
-- run_at, or its enqueue if that was later), DLQ depth,
-- and the live jobs split by what they wait for: due (claimable now), scheduled (pending,
-- run_at ahead), retrying (failed, waiting out the backoff); with claimed, the four add up
-- to the lane's depth. Jobs an operator paused (the lane, or their handler) count in due
-- but not in the longest wait: they wait by choice, and the wait is what the pickup SLO
-- judges, as jobd_oldest_unclaimed_age_seconds does (lane_waiting_since, migration 0039).
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
paused AS (
    SELECT lp.lane, bool_or(lp.handler IS NULL) AS whole_lane,
           coalesce(array_agg(lp.handler) FILTER (WHERE lp.handler IS NOT NULL), '{}')
               AS handlers
      FROM lane_pauses AS lp
     GROUP BY lp.lane
),
live AS (
    SELECT j.lane,
           count(*) FILTER (WHERE j.state = 'pending') AS pending,
           count(*) FILTER (WHERE j.state = 'claimed') AS claimed,
           count(*) FILTER (WHERE j.state = 'failed') AS failed,
           extract(epoch FROM clock.now
                   - min(greatest(j.run_at, j.created_at))
                         FILTER (WHERE j.state IN ('pending', 'failed')
                                   AND j.run_at <= clock.now
                                   AND (p.lane IS NULL
                                        OR (NOT p.whole_lane
                                            AND j.handler <> ALL (p.handlers)))))
               AS oldest_unclaimed_age,
           count(*) FILTER (WHERE j.state IN ('pending', 'failed') AND j.run_at <= clock.now)
               AS due,
           count(*) FILTER (WHERE j.state = 'pending' AND j.run_at > clock.now) AS scheduled,
           count(*) FILTER (WHERE j.state = 'failed' AND j.run_at > clock.now) AS retrying
      FROM jobs AS j
     CROSS JOIN clock
      LEFT JOIN paused AS p ON p.lane = j.lane
     GROUP BY j.lane, clock.now
),
dead AS (
    SELECT lane, count(*) AS dead FROM dead_letter GROUP BY lane
)
SELECT coalesce(live.lane, dead.lane) AS lane,
       coalesce(live.pending, 0) AS pending,
       coalesce(live.claimed, 0) AS claimed,
       coalesce(live.failed, 0) AS failed,
       coalesce(dead.dead, 0) AS dead,
       coalesce(live.oldest_unclaimed_age, 0)::float8 AS oldest_unclaimed_age,
       coalesce(live.due, 0) AS due,
       coalesce(live.scheduled, 0) AS scheduled,
       coalesce(live.retrying, 0) AS retrying
  FROM live
  FULL JOIN dead ON dead.lane = live.lane
 ORDER BY 1

-- name: lane_latency
-- Per lane, over its jobs finished in the last %(window)s seconds, at most the %(sample)s
-- newest: how many, and the 50th and 99th percentiles of the time from claim to finish and
-- of the pickup delay (from due, or from the enqueue of a job enqueued due in the past, to
-- claimed). Each lane is one backward range scan of
-- jobs_archive_lane_finished_idx, and partition pruning on finished_at keeps it to the
-- partitions the window touches: the cost is bounded by the sample, whatever the archive
-- holds. Failed attempts and dead jobs are not in the archive, so they are not counted;
-- jobs claimed before claimed_at existed count in neither percentile.
SELECT l.lane,
       count(r.finished_at) AS finished,
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY r.run_seconds) AS run,
       percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY r.pickup_seconds) AS pickup
  FROM unnest(%(lanes)s::text[]) AS l(lane)
  LEFT JOIN LATERAL (
        SELECT a.finished_at,
               extract(epoch FROM a.finished_at - a.claimed_at)::float8 AS run_seconds,
               extract(epoch FROM a.claimed_at - greatest(a.run_at, a.created_at))::float8
                   AS pickup_seconds
          FROM jobs_archive AS a
         WHERE a.lane = l.lane
           AND a.finished_at > coalesce(%(now)s::timestamptz, now())
                               - make_interval(secs => %(window)s)
           AND a.finished_at <= coalesce(%(now)s::timestamptz, now())
         ORDER BY a.finished_at DESC
         LIMIT %(sample)s
       ) AS r ON true
 GROUP BY l.lane
 ORDER BY l.lane

-- name: database_clock
SELECT coalesce(%(now)s::timestamptz, now())

-- name: connection_probe
-- A round trip that proves an idle connection still works (the listener's, between
-- notifications).
SELECT 1

-- name: search_path_setting
SELECT current_setting('search_path')

-- name: listen_qualified
LISTEN {channel}

-- name: lanes_enqueued_to
-- Every lane with a priority in use (lane_priorities: every enqueue records its pair, and the
-- retention duty forgets the pairs of lanes without live jobs), configured anywhere or not,
-- and every lane with dead jobs: its DLQ depth must not vanish from the gauges once its last
-- live job is gone (dead_letter_lane_idx).
SELECT lane FROM lane_priorities
UNION
SELECT DISTINCT lane FROM dead_letter

-- name: metrics_queue_state
-- The metrics sampler (jobd/duties/metrics_sampler.py), once per sampling interval for the
-- configured lanes: live jobs by state, the wait of the oldest due job and the DLQ depth.
-- due: claimable now; scheduled: pending with a later run_at; retrying: failed, waiting for
-- its retry; claimed: running or buffered by a worker. One pass per index, all lanes at
-- once: due and later from jobs_claimable_idx, retrying from jobs_retrying_idx (index-only
-- where the visibility map allows), claimed through jobs_lease_idx (as many rows as jobs in
-- flight), dead from dead_letter_lane_idx; the oldest wait is one probe per priority
-- (lane_waiting_since). Finished jobs are never read: their rows are in the archive.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS at
),
waiting AS (
    -- One index-only range scan per lane: over all lanes at once, the planner would rather
    -- read the whole table once the claim index is as wide as it is.
    SELECT l.lane, w.due, w.later
      FROM unnest(%(lanes)s::text[]) AS l(lane), clock
     CROSS JOIN LATERAL (
           SELECT count(*) FILTER (WHERE j.run_at <= clock.at) AS due,
                  count(*) FILTER (WHERE j.run_at > clock.at) AS later
             FROM jobs AS j
            WHERE j.lane = l.lane AND j.state IN ('pending', 'failed')) AS w
),
retrying AS (
    SELECT j.lane, count(*) AS jobs
      FROM jobs AS j, clock
     WHERE j.lane = ANY(%(lanes)s::text[]) AND j.state = 'failed' AND j.run_at > clock.at
     GROUP BY j.lane
),
claimed AS (
    SELECT j.lane, count(*) AS jobs FROM jobs AS j WHERE j.state = 'claimed' GROUP BY j.lane
),
dead AS (
    SELECT d.lane, count(*) AS jobs
      FROM dead_letter AS d
     WHERE d.lane = ANY(%(lanes)s::text[])
     GROUP BY d.lane
)
SELECT l.lane,
       coalesce(waiting.due, 0) AS due,
       coalesce(waiting.later, 0) - coalesce(retrying.jobs, 0) AS scheduled,
       coalesce(retrying.jobs, 0) AS retrying,
       coalesce(claimed.jobs, 0) AS claimed,
       coalesce(dead.jobs, 0) AS dead,
       -- NULL for a lane with nothing claimable, and greatest() skips NULLs.
       greatest(extract(epoch FROM clock.at - lane_waiting_since(l.lane)), 0)::float8
           AS oldest_unclaimed_age
  FROM unnest(%(lanes)s::text[]) AS l(lane)
 CROSS JOIN clock
  LEFT JOIN waiting ON waiting.lane = l.lane
  LEFT JOIN retrying ON retrying.lane = l.lane
  LEFT JOIN claimed ON claimed.lane = l.lane
  LEFT JOIN dead ON dead.lane = l.lane
 ORDER BY l.lane

-- name: shared_queue_state
-- The counts of metrics_queue_state that any node stored less than %(max_age)s seconds ago,
-- for the lanes asked, with their age in seconds (see migrations/0016).
SELECT lane, due, scheduled, retrying, claimed, dead, oldest_unclaimed_age,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - taken_at)::float8
  FROM queue_samples
 WHERE lane = ANY(%(lanes)s::text[])
   AND taken_at > coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(max_age)s)

-- name: store_queue_state
-- What this node just counted, for the others to use within the sampling interval.
INSERT INTO queue_samples AS q (lane, due, scheduled, retrying, claimed, dead,
                                oldest_unclaimed_age, taken_at)
SELECT s.lane, s.due, s.scheduled, s.retrying, s.claimed, s.dead, s.oldest,
       coalesce(%(now)s::timestamptz, now())
  FROM unnest(%(lanes)s::text[], %(due)s::bigint[], %(scheduled)s::bigint[],
              %(retrying)s::bigint[], %(claimed)s::bigint[], %(dead)s::bigint[],
              %(oldest)s::float8[])
       AS s(lane, due, scheduled, retrying, claimed, dead, oldest)
ON CONFLICT (lane) DO UPDATE
   SET due = excluded.due, scheduled = excluded.scheduled, retrying = excluded.retrying,
       claimed = excluded.claimed, dead = excluded.dead,
       oldest_unclaimed_age = excluded.oldest_unclaimed_age, taken_at = excluded.taken_at

-- name: metrics_database_hazards
-- The metrics sampler: what holds back vacuum of the hot table and what fills the
-- notification queue. The oldest open transaction of this database (a snapshot or an xid
-- keeps dead rows alive; a running VACUUM's own, autovacuum's or a manual one's, does not
-- hold back other vacuums, so it is left out: pg_stat_progress_vacuum) and prepared
-- transactions, in seconds; the oldest xmin among those and the replication slots (which
-- carry no timestamp), in transaction ids; the dead tuples of jobd.jobs;
-- pg_notification_queue_usage(). Another role's sessions show their transaction start only
-- to members of pg_read_all_stats.
SELECT coalesce(extract(epoch FROM now() - least(
           (SELECT min(a.xact_start) FROM pg_stat_activity AS a
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
               AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum AS v)
               AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)),
           (SELECT min(p.prepared) FROM pg_prepared_xacts AS p
             WHERE p.database = current_database()))), 0)::float8
           AS oldest_transaction_age,
       coalesce(greatest(
           (SELECT max(age(coalesce(a.backend_xmin, a.backend_xid))) FROM pg_stat_activity AS a
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
               AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum AS v)),
           (SELECT max(age(s.xmin)) FROM pg_replication_slots AS s
             WHERE s.xmin IS NOT NULL),
           (SELECT max(age(p.transaction)) FROM pg_prepared_xacts AS p
             WHERE p.database = current_database())), 0)::bigint AS xmin_horizon_age,
       pg_stat_get_dead_tuples('jobs'::regclass) AS jobs_dead_tuples,
       pg_notification_queue_usage()::float8 AS notification_queue_usage

-- name: list_dead
SELECT id, lane, handler, attempts, last_error, died_at, idempotency_key
  FROM dead_letter
 WHERE (%(lane)s::text IS NULL OR lane = %(lane)s)
 ORDER BY died_at DESC, id DESC
 LIMIT %(limit)s

-- name: replay_dead
-- Moves dead jobs back to the queue with a fresh attempt budget, keeping their error history.
-- The job keeps its id (so its idempotency key still points at it); its next claim draws a
-- new random token, so a worker from before its death can never write to it again. It is due at
-- once, or at its own run_at if that is later (a quarantined job scheduled for later). A dead
-- job stored with the fairness key '' (before migration 0049, or while it was applied) comes
-- back without it, sharing by its handler: jobs refuses the key '' (no fair claim took it).
WITH revived AS (
    DELETE FROM dead_letter WHERE id = ANY(%(ids)s::bigint[]) RETURNING *
)
INSERT INTO jobs (id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
                  idempotency_key, created_at, last_error, errors, fairness_key)
SELECT id, lane, handler, payload, 'pending', priority,
       greatest(run_at, coalesce(%(now)s::timestamptz, now())),
       0, max_attempts, idempotency_key, created_at, last_error,
       errors || jsonb_build_object('replayed_at', coalesce(%(now)s::timestamptz, now())),
       nullif(fairness_key, '')
  FROM revived
RETURNING id

-- name: replay_dead_of_handler
-- replay_dead for every dead job of a handler (in one lane, when given): after a fix, what
-- quarantine or the failures moved to the dead-letter queue comes back in one statement.
WITH revived AS (
    DELETE FROM dead_letter
     WHERE handler = %(handler)s AND (%(lane)s::text IS NULL OR lane = %(lane)s)
    RETURNING *
)
INSERT INTO jobs (id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
                  idempotency_key, created_at, last_error, errors, fairness_key)
SELECT id, lane, handler, payload, 'pending', priority,
       greatest(run_at, coalesce(%(now)s::timestamptz, now())),
       0, max_attempts, idempotency_key, created_at, last_error,
       errors || jsonb_build_object('replayed_at', coalesce(%(now)s::timestamptz, now())),
       nullif(fairness_key, '')
  FROM revived
RETURNING id

-- name: quarantine
-- See quarantine() in migrations/0011_lane_controls.sql: the number moved per lane.
SELECT lane_name, moved FROM quarantine(%(handler)s, %(lane)s, %(payload_match)s)

-- name: cancel_jobs_qualified
-- See cancel() in migrations/0013_fairness.sql. Qualified: jobd.cancel runs on callers' own
-- connections, whatever their search_path.
SELECT id, outcome, state FROM {schema}.cancel(%(ids)s::bigint[])

-- name: pause_qualified
-- jobd.pause and jobd.resume run on callers' own connections too: qualified.
SELECT {schema}.pause(%(lane)s, %(handler)s)

-- name: resume_qualified
SELECT {schema}.resume(%(lane)s, %(handler)s)

-- name: lane_known
-- Whether anything in the database knows the lane: a node's lanes (nodes.lane_settings, kept
-- an hour after the node is gone), a priority in use in it (lane_priorities), a dead job or a
-- schedule. `jobd lanes pause` without a config says so when nothing does: likely a typo,
-- while the lane meant keeps running.
SELECT EXISTS (SELECT 1 FROM nodes WHERE lane_settings ? %(lane)s)
    OR EXISTS (SELECT 1 FROM lane_priorities WHERE lane = %(lane)s)
    OR EXISTS (SELECT 1 FROM dead_letter WHERE lane = %(lane)s)
    OR EXISTS (SELECT 1 FROM schedules WHERE lane = %(lane)s)

-- name: list_pauses
SELECT lane, handler, paused_at, paused_by
  FROM lane_pauses
 WHERE %(lane)s::text IS NULL OR lane = %(lane)s
 ORDER BY lane, handler NULLS FIRST

-- name: lane_controls
-- What a worker needs to know of its lane's pauses: whether the lane is paused, and which of
-- its handlers are.
SELECT coalesce(bool_or(handler IS NULL), false),
       coalesce(array_agg(handler ORDER BY handler) FILTER (WHERE handler IS NOT NULL), '{}')
  FROM lane_pauses
 WHERE lane = %(lane)s

-- name: purge_dead
-- A purged job's key is found by the key it carries, one probe of job_keys' primary key
-- each, not by its id: job_keys has no index on job_id, and a lookup by id (or a join the
-- planner may hash) read the whole table, every keyed job of the retention period, for each
-- purge however few jobs it purged. Every path that records a key stores the same text in
-- the job's idempotency_key; the job_id match keeps a key that another job holds.
WITH purged AS (
    DELETE FROM dead_letter WHERE died_at < %(before)s::timestamptz
    RETURNING id, idempotency_key
),
forgotten AS (
    DELETE FROM job_keys AS k
     WHERE k.idempotency_key = ANY(ARRAY(SELECT p.idempotency_key FROM purged AS p
                                          WHERE p.idempotency_key IS NOT NULL))
       AND k.job_id IN (SELECT p.id FROM purged AS p)
)
SELECT count(*) FROM purged

-- name: ensure_archive_partitions
SELECT ensure_archive_partitions(%(days_ahead)s)

-- name: drop_archive_partitions
SELECT drop_archive_partitions(%(cutoff)s::timestamptz)

-- name: merge_wanted_priorities
-- The lane poll's first step: the pairs enqueues recorded as wanted while another transaction
-- was inserting them go into lane_priorities (migration 0046), in a transaction of their
-- own, so lane_heads, next, sees their jobs. Nothing is wanted almost always: the function
-- is called only when the table has a row.
SELECT merge_wanted_priorities() WHERE EXISTS (SELECT 1 FROM lane_priorities_wanted)

-- name: lane_heads
-- Per lane, the earliest run_at of its claimable jobs (epoch seconds, NULL when it has none),
-- the database clock, and whether suspects are due (made by any node's crash attribution): the
-- supervisor wakes lanes with due work, sets timers for the rest, and tells the workers of a
-- lane with suspects they may claim (not a paused handler's) to look for them when idle. A
-- paused lane has nothing due. The last
-- column names the lane's pauses ('*' for the lane's own): a change the supervisor did not
-- hear of (its LISTEN connection was down) shows there, and it tells the lane's workers.
-- The head is lane_head(), written out to take a look back (seconds): with one, only jobs
-- due since now() less that count, and each priority's scan of jobs_claimable_idx starts
-- there instead of at the head, past the dead entries a held horizon keeps; jobs due
-- earlier wait for the next poll without one (jobd/head_scans.py).
SELECT l.lane,
       CASE WHEN NOT c.lane_paused THEN extract(epoch FROM h.head)::float8 END,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()))::float8,
       NOT c.lane_paused
       AND EXISTS (SELECT 1 FROM jobs AS j
                    WHERE j.lane = l.lane AND j.suspect AND j.state IN ('pending', 'failed')
                      AND j.run_at <= coalesce(%(now)s::timestamptz, now())
                      -- A paused handler's suspect waits, as claim_suspect leaves it: told
                      -- of it, every worker of the lane gave back its buffer and emptied its
                      -- slots to look for it, found nothing, and was told again at the poll.
                      AND NOT EXISTS (SELECT 1 FROM lane_pauses AS p
                                       WHERE p.lane = l.lane AND p.handler = j.handler)),
       c.pauses
  FROM unnest(%(lanes)s::text[]) AS l(lane)
 CROSS JOIN LATERAL (
       SELECT min(first.run_at) AS head
         FROM lane_priorities AS p
        CROSS JOIN LATERAL (
              SELECT j.run_at FROM jobs AS j
               WHERE j.lane = p.lane AND j.state IN ('pending', 'failed')
                 AND j.priority = p.priority
                 AND j.run_at >= coalesce(coalesce(%(now)s::timestamptz, now())
                                          - make_interval(secs => %(look_back)s::float8),
                                          '-infinity')
               ORDER BY j.run_at LIMIT 1) AS first
        WHERE p.lane = l.lane) AS h
 CROSS JOIN LATERAL (
       SELECT coalesce(bool_or(p.handler IS NULL), false) AS lane_paused,
              coalesce(string_agg(coalesce(p.handler, '*'), ',' ORDER BY p.handler NULLS FIRST),
                       '') AS pauses
         FROM lane_pauses AS p
        WHERE p.lane = l.lane) AS c

-- name: session_local
-- The session settings of a connection through a transaction-mode pooler (jobd/db.py,
-- docs/pooler.md), for the transaction this runs in: the pooler may give the next one to
-- another server session. Only built-in functions, which resolve in pg_catalog whatever the
-- search_path (this is what sets it).
SELECT count(set_config(s.name, s.value, true))
  FROM unnest(%(names)s::text[], %(values)s::text[]) AS s(name, value)

-- name: node_heartbeat
-- Keyed by the instance (node name, pid, random suffix), never by the node name: two daemons
-- configured with one node.name keep a row each.
INSERT INTO nodes AS n (instance, node, pid, workers, counters, heartbeat_interval,
                        listening, archive_retention, lane_settings)
VALUES (%(instance)s, %(node)s, %(pid)s, %(workers)s, %(counters)s, %(interval)s,
        %(listening)s, %(archive_retention)s, %(lane_settings)s)
ON CONFLICT (instance) DO UPDATE
   SET seen_at = now(),
       workers = excluded.workers,
       listening = excluded.listening,
       archive_retention = excluded.archive_retention,
       lane_settings = excluded.lane_settings,
       prev_counters = n.counters,
       prev_seen_at = n.seen_at,
       counters = excluded.counters,
       heartbeat_interval = excluded.heartbeat_interval
RETURNING extract(epoch FROM now())::float8

-- name: archive_cutoff
-- What a retention pass may forget: older than the longest retention of this node and of
-- every node with a row (a node gone for an hour has none; see prune_nodes), on the
-- database clock.
SELECT now() - make_interval(secs => greatest(
           %(retention)s::float8,
           (SELECT max(archive_retention) FROM nodes)))

-- name: node_leave
DELETE FROM nodes WHERE instance = %(instance)s

-- name: prune_waiters
-- Armed workers refresh their row on every fallback poll; one this old belongs to a worker
-- gone without a trace (its node killed whole). It only cost a notification per enqueue.
DELETE FROM lane_waiters WHERE armed_at < now() - make_interval(secs => %(older_than)s)

-- name: forget_unused_priorities
SELECT l.lane, forget_unused_priorities(l.lane)
  FROM (SELECT DISTINCT lane FROM lane_priorities) AS l

-- name: horizon_holders
-- What holds back the horizon below which vacuum may remove dead rows of jobd's tables: the
-- oldest open transaction of each kind, in this database (backends of others do not hold
-- back its tables) or anywhere (replication slots, prepared transactions), with its age by
-- the database clock. A slot's age is in transactions: a slot has no start time. A running
-- VACUUM (autovacuum's or a manual one) holds back no other vacuum, and a slot's catalog_xmin
-- only the system catalogs: neither is named, as metrics_database_hazards counts neither.
(SELECT 'transaction' AS kind, a.pid, a.application_name, a.state,
        extract(epoch FROM now() - a.xact_start)::float8 AS age_seconds,
        greatest(age(a.backend_xid), age(a.backend_xmin)) AS age_xids
   FROM pg_stat_activity AS a
  WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
    AND (a.backend_xid IS NOT NULL OR a.backend_xmin IS NOT NULL)
    AND a.xact_start IS NOT NULL
    AND a.pid NOT IN (SELECT v.pid FROM pg_stat_progress_vacuum AS v)
  ORDER BY a.xact_start LIMIT 1)
UNION ALL
(SELECT 'prepared transaction', NULL, p.gid, NULL,
        extract(epoch FROM now() - p.prepared)::float8, age(p.transaction)
   FROM pg_prepared_xacts AS p
  ORDER BY p.prepared LIMIT 1)
UNION ALL
(SELECT 'replication slot', s.active_pid, s.slot_name, CASE WHEN s.active THEN 'active'
                                                            ELSE 'inactive' END,
        NULL, age(s.xmin)
   FROM pg_replication_slots AS s
  WHERE s.xmin IS NOT NULL
  ORDER BY age(s.xmin) DESC LIMIT 1)

-- name: autovacuum_switched_off
-- Why autovacuum would never vacuum jobs, one row a reason: the server's switch, the
-- statistics it decides by, or the table's own option. No row when it would.
SELECT v.reason
  FROM (VALUES
          ('the server setting autovacuum is off', NOT current_setting('autovacuum')::boolean),
          ('the server setting track_counts is off',
           NOT current_setting('track_counts')::boolean),
          ('the table option autovacuum_enabled of jobs is false',
           EXISTS (SELECT 1 FROM pg_class AS c, pg_options_to_table(c.reloptions) AS o
                    WHERE c.oid = 'jobs'::regclass AND o.option_name = 'autovacuum_enabled'
                      AND NOT o.option_value::boolean))) AS v(reason, holds)
 WHERE v.holds

-- name: prune_nodes
DELETE FROM nodes WHERE seen_at < now() - make_interval(secs => %(older_than)s)

-- name: live_nodes
-- Every node that has a row (rows of nodes gone for an hour are pruned), with per-lane rates
-- per second over its last two samples, its heartbeat's age by the database clock, and
-- whether it is gone: no heartbeat for %(misses)s of its intervals and at least %(grace)s
-- seconds, or, for a node that does not state its interval (older daemons), %(unknown)s.
SELECT instance, node, pid, started_at, seen_at, workers, counters, prev_counters,
       extract(epoch FROM seen_at - prev_seen_at)::float8 AS sample_seconds,
       extract(epoch FROM now() - seen_at)::float8 AS heartbeat_age,
       heartbeat_interval,
       now() - seen_at > make_interval(secs => coalesce(
           greatest(%(misses)s * heartbeat_interval, heartbeat_interval + %(grace)s),
           %(unknown)s)) AS gone,
       listening, lane_settings
  FROM nodes
 ORDER BY node, instance

-- name: schedule_before_its_change
-- A stored schedule whose expression or zone this instance's config changes, if it is
-- enabled: what its definition still owes is fired before the change (schedules.sync).
SELECT s.cron, s.timezone, s.catchup, s.overlap, s.materialized_until, clock.at
  FROM schedules AS s, (SELECT coalesce(%(now)s::timestamptz, now()) AS at) AS clock
 WHERE s.id = %(id)s AND s.enabled
   AND (s.cron, s.timezone) IS DISTINCT FROM (%(cron)s::text, %(timezone)s::text)

-- name: declare_schedule
-- One instance declares one schedule of its config (see migrations/0007): creates it if new,
-- refreshes the declaration's expiry, and adopts the definition only if no live declaration
-- carries the stored one. Never changes `enabled`, the operator's flag.
SELECT declare_schedule(%(id)s, %(instance)s, %(definition)s, %(ttl)s,
                        %(now)s::timestamptz)

-- name: withdraw_schedule_declarations_except
-- An instance stops declaring the schedules its config no longer has. The schedules stay
-- (ledger, cursor, flag); they go on firing while another live instance declares them.
DELETE FROM schedule_declarations
 WHERE instance = %(instance)s AND NOT (schedule_id = ANY(%(ids)s::text[]))
RETURNING schedule_id

-- name: withdraw_schedule_declarations
-- A leaving instance: none of its schedules count as declared by it any more.
DELETE FROM schedule_declarations WHERE instance = %(instance)s

-- name: prune_schedule_declarations
-- Declarations of instances that died without leaving; long expired, they only take space.
DELETE FROM schedule_declarations
 WHERE expires_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(after)s)

-- name: refresh_schedule_declarations
-- The duty pass keeps an instance's declarations live; it re-creates any that were pruned
-- while the instance was away. Touches no schedule row, so it takes no schedule lock.
INSERT INTO schedule_declarations AS d (schedule_id, instance, definition, declared_at,
                                        expires_at)
SELECT c.id, %(instance)s, c.definition, clock.at,
       clock.at + make_interval(secs => %(ttl)s)
  FROM unnest(%(ids)s::text[], %(definitions)s::jsonb[]) AS c(id, definition),
       (SELECT coalesce(%(now)s::timestamptz, now()) AS at) AS clock
ON CONFLICT ON CONSTRAINT schedule_declarations_pkey DO UPDATE
   SET expires_at = excluded.expires_at,
       definition = excluded.definition,
       declared_at = CASE WHEN d.definition = excluded.definition THEN d.declared_at
                          ELSE excluded.declared_at END

-- name: undecided_schedule_declarations
-- An instance's declarations that differ from the stored definition: a conflict, or a
-- change waiting for the last live declaration of the old definition to go.
SELECT d.schedule_id
  FROM schedule_declarations AS d JOIN schedules AS s ON s.id = d.schedule_id
 WHERE d.instance = %(instance)s AND d.definition <> schedule_definition(s)
 ORDER BY d.schedule_id

-- name: lock_schedule_without_waiting
-- The refresh's hold on a schedule it may reconcile; no row: busy (or gone), next pass.
SELECT 1 FROM schedules WHERE id = %(schedule_id)s FOR UPDATE SKIP LOCKED

-- name: reconcile_schedule
SELECT reconcile_schedule(%(schedule_id)s, %(now)s::timestamptz, %(wait)s)

-- name: schedule_conflicts
-- Schedules whose live declarations differ from the stored definition, with the instances
-- on each side (all schedules when ids is NULL).
SELECT s.id,
       coalesce(array_agg(d.instance ORDER BY d.instance)
                    FILTER (WHERE d.definition = schedule_definition(s)), '{}') AS stored_by,
       coalesce(array_agg(d.instance ORDER BY d.instance)
                    FILTER (WHERE d.definition <> schedule_definition(s)), '{}') AS differing
  FROM schedules AS s JOIN schedule_declarations AS d ON d.schedule_id = s.id
 WHERE d.expires_at > coalesce(%(now)s::timestamptz, now())
   AND (%(ids)s::text[] IS NULL OR s.id = ANY(%(ids)s::text[]))
 GROUP BY s.id
HAVING bool_or(d.definition <> schedule_definition(s))
 ORDER BY s.id

-- name: set_schedule_enabled
-- The operator's flag. Enabling moves the cursor to now: what fell due while an operator had
-- the schedule switched off is not caught up. Returns the previous flag; no row: unknown id.
UPDATE schedules AS s
   SET enabled = %(enabled)s,
       updated_at = CASE WHEN s.enabled = %(enabled)s THEN s.updated_at ELSE now() END,
       materialized_until = CASE WHEN %(enabled)s AND NOT s.enabled
                                 THEN greatest(s.materialized_until, now())
                                 ELSE s.materialized_until END
  FROM (SELECT id, enabled FROM schedules WHERE id = %(id)s FOR UPDATE) AS before
 WHERE s.id = before.id
RETURNING before.enabled,
          EXISTS (SELECT 1 FROM schedule_declarations AS d
                   WHERE d.schedule_id = s.id AND d.expires_at > now()) AS declared

-- name: schedule_ids
SELECT id FROM schedules ORDER BY id

-- name: due_schedules
-- The schedules to materialize: enabled by the operator and declared by at least one live
-- instance, with their cursors and the database clock to judge "due" and "live" by.
SELECT s.id, s.cron, s.timezone, s.catchup, s.overlap, s.materialized_until, clock.at
  FROM schedules AS s, (SELECT coalesce(%(now)s::timestamptz, now()) AS at) AS clock
 WHERE s.enabled
   AND EXISTS (SELECT 1 FROM schedule_declarations AS d
                WHERE d.schedule_id = s.id AND d.expires_at > clock.at)
 ORDER BY s.id

-- name: fire_schedule
SELECT outcome, job_id FROM fire_schedule(%(schedule_id)s, %(occurrence)s, %(fire_at)s,
                                          %(now)s::timestamptz)

-- name: advance_schedule
-- Moves a schedule's cursor past occurrences that were deliberately not fired (catch-up
-- policy), so they are not considered again.
UPDATE schedules SET materialized_until = greatest(materialized_until, %(until)s::timestamptz)
 WHERE id = %(schedule_id)s

-- name: list_schedules
-- Every schedule with the live instances that declare it, and those of them whose
-- definition differs from the stored one (a conflict).
SELECT s.id, s.cron, s.timezone, s.handler, s.lane, s.catchup, s.overlap, s.enabled,
       s.materialized_until, s.last_fire_at, s.last_job_id,
       coalesce(live.declared_by, '{}') AS declared_by,
       coalesce(live.differing, '{}') AS differing
  FROM schedules AS s
  LEFT JOIN LATERAL (
        SELECT array_agg(d.instance ORDER BY d.instance) AS declared_by,
               array_agg(d.instance ORDER BY d.instance)
                   FILTER (WHERE d.definition <> schedule_definition(s)) AS differing
          FROM schedule_declarations AS d
         WHERE d.schedule_id = s.id AND d.expires_at > coalesce(%(now)s::timestamptz, now())
       ) AS live ON true
 ORDER BY s.id

-- name: prune_schedule_fires
DELETE FROM schedule_fires WHERE fire_at < now() - make_interval(secs => %(older_than)s)

-- name: record_effect_key
-- Inside a transactional handler's transaction: claims the job's idempotency key. No row
-- back means the key's effect already committed (a replay): the handler must not run again.
-- A concurrent transaction holding the same key makes this wait for its outcome.
-- The same statement names the backend after the lease for the rest of the transaction, so a
-- lease sweep that finds the lease expired can end the transaction (terminate_stale_handlers),
-- and bounds the transaction on the server by the lane's timeout (%(timeout_ms)s, NULL for
-- none) in case the worker is frozen where no sweep sees it. A tighter bound of the role's or
-- database's own stands, and without a lane timeout theirs do (current_setting() reads as an
-- interval: 0, 300ms, 5s, 1min). It also marks the transaction as the one that holds the key
-- (jobd.effect_key, local to it: see effect_key_held).
INSERT INTO {schema}.processed_keys (idempotency_key, job_id)
SELECT %(key)s, %(job_id)s
  FROM (SELECT set_config('application_name', %(application_name)s, true),
               set_config('jobd.effect_key', %(key)s, true),
               (SELECT count(set_config(setting, %(timeout_ms)s::bigint::text, true))
                  FROM unnest(ARRAY['idle_in_transaction_session_timeout',
                                    'statement_timeout']) AS setting
                 WHERE %(timeout_ms)s::bigint IS NOT NULL
                   AND NOT coalesce(extract(epoch FROM current_setting(setting)::interval)
                                    * 1000 BETWEEN 0.001 AND %(timeout_ms)s::bigint, false))
       ) AS session
ON CONFLICT DO NOTHING
RETURNING job_id

-- name: effect_key_held
-- After a transactional handler ran, before its job's completion: whether the open
-- transaction is still the one that recorded the job's effect key. record_effect_key set
-- jobd.effect_key local to that transaction; a COMMIT or ROLLBACK the handler sent ended it
-- and took the setting with it, so a transaction begun after that (its next statement, or its
-- own BEGIN) reads NULL or an empty string here.
SELECT current_setting('jobd.effect_key', true) IS NOT DISTINCT FROM %(key)s

-- name: prune_job_keys
-- This and the two prunes after it (jobd/archive.py) delete a batch of rows at most, a
-- statement (and a commit) per batch: a backlog (after archive.retention was shortened, or a
-- long outage) never meets the statement timeout, and each batch keeps what it did.
-- The idempotency keys of jobs created before the retention cutoff that are neither live nor
-- dead-lettered (a key lives as long as its job's history).
-- A sweep walks the expired keys in (created_at, idempotency_key) order, a batch of keys a
-- statement from where key_sweep says the previous one stopped, so a batch reads what it
-- examines and no more (migration 0045). Looking for the keys free to forget among all the
-- expired ones read and sorted the whole backlog for every batch, and the keys that must be
-- kept (dead-lettered and still-live jobs', the oldest) were walked past again each time.
-- Each key's job is probed by primary key: scalar subqueries, which the planner cannot turn
-- into an anti-join that hashes all of jobs or dead_letter. Once a statement examines fewer
-- keys than its batch the sweep has reached the cutoff and starts again from the head, so a
-- key kept because its job was live is looked at again by the next sweep. Returns the keys
-- forgotten and whether the sweep reached the cutoff.
WITH examined AS (
    SELECT k.idempotency_key, k.job_id, k.created_at
      FROM job_keys AS k
     WHERE k.created_at < %(cutoff)s::timestamptz
       AND (k.created_at, k.idempotency_key)
           > ((SELECT coalesce(s.created_at, '-infinity') FROM key_sweep AS s),
              (SELECT coalesce(s.idempotency_key, '') FROM key_sweep AS s))
     ORDER BY k.created_at, k.idempotency_key
     LIMIT %(batch)s
),
forgotten AS (
    DELETE FROM job_keys AS k
     WHERE k.idempotency_key = ANY(ARRAY(
           SELECT e.idempotency_key FROM examined AS e
            WHERE (SELECT j.id FROM jobs AS j WHERE j.id = e.job_id) IS NULL
              AND (SELECT d.id FROM dead_letter AS d WHERE d.id = e.job_id) IS NULL))
    RETURNING 1
),
moved AS (
    -- No row (a short batch) sets NULL: the next sweep starts at the head.
    UPDATE key_sweep AS s
       SET (created_at, idempotency_key) = (
           SELECT e.created_at, e.idempotency_key FROM examined AS e
            WHERE (SELECT count(*) FROM examined) = %(batch)s
            ORDER BY e.created_at DESC, e.idempotency_key DESC
            LIMIT 1)
    RETURNING s.created_at IS NULL AS swept
)
SELECT (SELECT count(*) FROM forgotten), coalesce((SELECT m.swept FROM moved AS m), true)

-- name: prune_processed_keys
DELETE FROM processed_keys
 WHERE idempotency_key = ANY(ARRAY(
       SELECT p.idempotency_key FROM processed_keys AS p
        WHERE p.processed_at < %(cutoff)s::timestamptz
        LIMIT %(batch)s))

-- name: prune_outbox
-- Delivered entries past the retention cutoff. created_at <= delivered_at, so the created_at
-- bound is implied; it is there to let the scan ride outbox_created_at_idx.
DELETE FROM outbox
 WHERE id = ANY(ARRAY(
       SELECT o.id FROM outbox AS o
        WHERE o.created_at < %(cutoff)s::timestamptz
          AND o.state = 'delivered'
          AND o.delivered_at < %(cutoff)s::timestamptz
        LIMIT %(batch)s))

-- name: outbox_add
-- The outbox statements run in transactional handlers' transactions: {schema}. qualified.
-- The delivery job's handler names the sender: only nodes that have it run it (0043).
SELECT {schema}.outbox_add_for_sender(%(key)s, %(sender)s, %(payload)s, %(lane)s,
                                      %(source_job_id)s)

-- name: outbox_entry_for_delivery
SELECT id, key, sender, payload, state FROM {schema}.outbox WHERE id = %(id)s FOR UPDATE

-- name: outbox_delivered
UPDATE {schema}.outbox SET state = 'delivered', delivered_at = now(), last_error = NULL
 WHERE id = %(id)s

-- name: testing_enqueued_jobs_qualified
-- jobd.testing: the live jobs a test asserts on, on the test's own connection (so it sees
-- jobs its open transaction inserted), hence {schema}. Payload matching is JSON containment:
-- the job's payload holds every key and value of %(payload)s. 'jobd.outbox' matches the
-- deliveries of every sender ('jobd.outbox:<sender>', migration 0043) as it did before.
SELECT id, handler, lane, payload, state, priority, run_at, attempts, max_attempts,
       idempotency_key, created_at
  FROM {schema}.jobs
 WHERE (%(handler)s::text IS NULL OR handler = %(handler)s
        OR (%(handler)s = 'jobd.outbox' AND starts_with(handler, 'jobd.outbox:')))
   AND (%(lane)s::text IS NULL OR lane = %(lane)s)
   AND (%(payload)s::jsonb IS NULL OR payload @> %(payload)s::jsonb)
 ORDER BY id

-- name: testing_session_settings
-- jobd.testing runs jobd's statements on a test's own connection: what it changes there (the
-- search_path for jobd's unqualified statements; what record_effect_key sets for the rest of
-- an open transaction) it reads first, to put back afterwards.
SELECT current_setting('search_path'), current_setting('application_name'),
       current_setting('idle_in_transaction_session_timeout'),
       current_setting('statement_timeout')

-- name: testing_set_search_path
-- Local (is_local) inside a transaction block: at its end the setting the caller had in it
-- (local, or session-level) comes back by itself, whatever jobd set in between.
SELECT set_config('search_path', %(path)s, %(local)s)

-- name: testing_restore_session_settings
-- Local (is_local): record_effect_key's settings were local to the open transaction too.
SELECT set_config('application_name', %(application_name)s, true),
       set_config('idle_in_transaction_session_timeout', %(idle_timeout)s, true),
       set_config('statement_timeout', %(statement_timeout)s, true)

-- name: testing_handler_savepoint
-- jobd.testing runs a plain handler on a test's own connection in a savepoint of the test's
-- open transaction. On a worker a plain handler's statements run on the application's own
-- connections: one that fails aborts the application's transaction, never the one jobd
-- records the job's outcome in. In a test both are the test's transaction; rolling back to
-- this savepoint undoes what the aborting statement took with it, so the outcome can still
-- be recorded. Utility statements, run unprepared (psycopg would PREPARE a statement it saw
-- often, and PostgreSQL prepares none of these).
SAVEPOINT jobd_testing_handler

-- name: testing_release_handler_savepoint
RELEASE SAVEPOINT jobd_testing_handler

-- name: testing_rollback_to_handler_savepoint
-- The handler's statement aborted the test's transaction: back to where it stood before the
-- handler's call, and the savepoint released (the next job takes a new one).
ROLLBACK TO SAVEPOINT jobd_testing_handler; RELEASE SAVEPOINT jobd_testing_handler

-- name: role_grants_exist
SELECT to_regclass('role_grants') IS NOT NULL

-- name: role_exists
-- By the role's name as it is, not parsed as an identifier: to_regrole would fold 'Alice' to
-- alice and refuse 'etl jobs' as bad syntax.
SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %(role)s)

-- name: schema_usage
-- Whether the current role may use the schema (no row: there is none), and the role's name.
-- Without USAGE the schema's names are left out of its search_path: its tables look missing.
SELECT has_schema_privilege(n.oid, 'USAGE'), current_user::text
  FROM pg_namespace AS n
 WHERE n.nspname = %(schema)s

-- name: role_owns_schema
-- Whether %(role)s (by its name as it is, as role_exists) owns the schema %(schema)s.
SELECT EXISTS (SELECT 1 FROM pg_namespace AS n JOIN pg_roles AS r ON r.oid = n.nspowner
                WHERE n.nspname = %(schema)s AND r.rolname = %(role)s)

-- name: record_role_grant
INSERT INTO role_grants (role, kind) VALUES (%(role)s, %(kind)s) ON CONFLICT DO NOTHING

-- name: recorded_role_grants
SELECT g.role::text, g.kind, EXISTS (SELECT 1 FROM pg_roles AS r WHERE r.rolname = g.role)
  FROM role_grants AS g
 ORDER BY g.role, g.kind

-- name: forget_role_grant
DELETE FROM role_grants WHERE role = %(role)s AND kind = %(kind)s

-- name: grant_runtime_qualified
-- The daemon, the CLI and enqueue: reading and writing rows of every table, drawing ids and
-- lease tokens, calling every function. No CREATE on the schema and no ownership, so it
-- cannot create, alter or drop anything. The migration ledger, the settings `jobd migrate`
-- writes and the grants themselves are read-only to it (the daemon reads the first two).
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role};
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role};
REVOKE INSERT, UPDATE, DELETE ON {schema}.schema_migrations, {schema}.settings FROM {role};
REVOKE ALL ON {schema}.role_grants FROM {role};

-- name: revoke_maintenance_qualified
-- Migration 0014's revocation, made again by every `jobd migrate`: the archive maintenance
-- runs as the owner, so a role that may call it can drop the whole archive. A restore that
-- leaves out the privileges (pg_restore --no-acl, --no-privileges; the way into a server
-- whose roles differ) gives every function back to PUBLIC, and with it to the producers.
REVOKE EXECUTE ON FUNCTION {schema}.ensure_archive_partitions(integer),
                           {schema}.drop_archive_partitions(timestamptz) FROM PUBLIC

-- name: grant_producer_qualified
-- Only enqueue, which runs as the owner (migration 0014): no privilege on any table, so a
-- producer cannot read the queue's payloads or write a row but through enqueue's checks.
-- Named without its arguments (there is one enqueue), so a new optional argument keeps it.
GRANT USAGE ON SCHEMA {schema} TO {role};
GRANT EXECUTE ON FUNCTION {schema}.enqueue TO {role};

-- name: schema_ownership
-- Whether the schema exists, and whether the current role may act as its owner (is it, is a
-- member of it, or is a superuser): only then may `jobd migrate` change it.
SELECT pg_has_role(n.nspowner, 'USAGE') FROM pg_namespace AS n WHERE n.nspname = %(schema)s

-- name: schema_other_objects
-- What a schema without jobd's migration ledger holds already: tables, views, sequences,
-- functions and types of their own (a table's row type and array types come with another).
SELECT (SELECT count(*) FROM pg_class AS c WHERE c.relnamespace = n.oid)
     + (SELECT count(*) FROM pg_proc AS p WHERE p.pronamespace = n.oid)
     + (SELECT count(*) FROM pg_type AS t
         WHERE t.typnamespace = n.oid AND t.typrelid = 0 AND t.typelem = 0)
  FROM pg_namespace AS n WHERE n.nspname = %(schema)s

-- name: migrate_read_committed
-- jobd migrate's transaction, whatever the role's or database's default isolation: each
-- statement sees what committed before it. A migration that rewrites rows once it holds its
-- lock on a table (0049) must see the rows committed while it waited for that lock, which a
-- REPEATABLE READ snapshot, taken at the transaction's first statement, does not show.
SET TRANSACTION ISOLATION LEVEL READ COMMITTED

-- name: migrate_lock
-- One `jobd migrate` at a time per schema, across every node that runs it at once; held to
-- the end of its transaction.
SELECT pg_advisory_xact_lock(hashtext('jobd.migrate'), hashtext(%(schema)s))

-- name: create_schema_qualified
CREATE SCHEMA {schema}

-- name: set_local_search_path_qualified
SET LOCAL search_path TO {schema}

-- name: set_local_no_statement_timeout
-- A migration may rewrite a large table: database.statement_timeout is for the statements of
-- a running node, not for this.
SET LOCAL statement_timeout = 0

-- name: migration_ledger_exists
SELECT to_regclass('schema_migrations') IS NOT NULL

-- name: create_migration_ledger
-- The ledger of applied migrations, created by the first `jobd migrate` before the first
-- migration runs (no migration creates it).
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: applied_migrations
SELECT version, name, checksum FROM schema_migrations ORDER BY version

-- name: record_migration
INSERT INTO schema_migrations (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s)

-- name: functions_pinned_elsewhere
-- The functions of the schema whose pinned search_path is not the schema's own, `<schema>,
-- pg_temp` (migration 0014): a schema restored or renamed under another name keeps the old
-- name in them, so they would read and write the tables of a schema that is gone, or of
-- another copy still there under the old name. Their signatures and the path they pin.
SELECT p.oid::regprocedure::text, substr(c, length('search_path=') + 1)
  FROM pg_proc AS p
  JOIN pg_namespace AS n ON n.oid = p.pronamespace
 CROSS JOIN LATERAL unnest(p.proconfig) AS c
 WHERE n.nspname = %(schema)s
   AND c LIKE 'search_path=%%'
   AND c <> 'search_path=' || quote_ident(%(schema)s) || ', pg_temp'
 ORDER BY 1

-- name: pin_search_path_qualified
-- {function} is a signature from functions_pinned_elsewhere (regprocedure's text, quoted by
-- the server): the pin every function of the schema has, as migration 0014 set it.
ALTER FUNCTION {function} SET search_path = {schema}, pg_temp

-- name: latest_migration
SELECT max(version) FROM schema_migrations

-- name: payload_limit
SELECT value::bigint FROM settings WHERE name = 'max_payload_bytes'

-- name: set_payload_limit
-- limits.max_payload_bytes of the config `jobd migrate` was given: the limit every enqueue
-- path checks, the database's.
UPDATE settings SET value = to_jsonb(%(max_payload_bytes)s::bigint)
 WHERE name = 'max_payload_bytes'

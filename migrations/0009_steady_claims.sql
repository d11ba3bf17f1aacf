-- Steady under pressure (see docs/design/queue.md, "Wake-ups" and "Claim floors").
--
-- 1. Enqueue commits without NOTIFY's global lock unless a worker waits. PostgreSQL serializes
--    the commits of every transaction that has notified on one lock held across its WAL
--    flush, so a NOTIFY per enqueue caps single-job enqueue. A worker that runs out of work
--    arms itself in lane_waiters; the insert trigger notifies a lane's due work only while
--    one is armed. A shared advisory lock, taken by the trigger before it reads lane_waiters
--    and released at commit, closes the race with a worker that arms meanwhile (arm_waiter).
-- 2. Claims that do not walk history vacuum cannot remove. Every claimed or finished job
--    leaves a dead entry in the claim index; while a long transaction holds the xmin horizon
--    back none can be removed, and a scan from the head of a lane walks all of them. Workers
--    now pass floors ((run_at, id) per priority) below which they know nothing is due, and
--    the priorities of a lane are listed in lane_priorities instead of discovered by a walk.

-- The claim index gains id, so a floor can sit between jobs that share a run_at (a bulk
-- enqueue gives thousands of jobs the same one).
DROP INDEX jobs_claimable_idx;
CREATE INDEX jobs_claimable_idx ON jobs (lane, priority DESC, run_at, id)
    WHERE state IN ('pending', 'failed');

-- Every (lane, priority) that has had claimable jobs. Rows are added by the insert trigger
-- (ON CONFLICT DO NOTHING writes nothing once a pair exists) and removed only by the
-- retention duty when a pair has no live job, so the claim reads a handful of live rows.
CREATE TABLE lane_priorities (
    lane     text    NOT NULL,
    priority integer NOT NULL,
    PRIMARY KEY (lane, priority)
);
INSERT INTO lane_priorities SELECT DISTINCT lane, priority FROM jobs;

-- Workers that wait for a wake-up. UNLOGGED: arming and disarming write no WAL, so they cost
-- no flush; after a crash of the server the table is empty and the workers, reconnecting,
-- claim before they arm again. A row of a worker that died stays until crash attribution
-- or the lease sweep removes it: until then it only costs a notification per enqueue.
CREATE UNLOGGED TABLE lane_waiters (
    worker_id text        PRIMARY KEY,
    lane      text        NOT NULL,
    armed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX lane_waiters_lane_idx ON lane_waiters (lane);

-- The advisory lock key of a lane's wake-ups: the schema is part of it, so two jobd schemas
-- in one database do not share locks.
CREATE FUNCTION wake_lock_key(lane text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path FROM CURRENT
AS $$ SELECT hashtextextended(current_schema() || '.' || lane, 0) $$;

CREATE OR REPLACE FUNCTION notify_new_jobs() RETURNS trigger LANGUAGE plpgsql
-- It reads jobd's tables: whatever search_path the enqueuing session has (a caller's COPY).
SET search_path FROM CURRENT
AS $$
DECLARE
    entry record;
    -- Outside READ COMMITTED the transaction's snapshot may predate a worker's arming, so
    -- reading lane_waiters proves nothing: notify as before.
    always boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    FOR entry IN SELECT lane, min(run_at) AS first_run_at,
                        count(*) FILTER (WHERE run_at <= now()) AS due
                   FROM new_jobs GROUP BY lane
    LOOP
        -- Held until commit. A worker arming meanwhile sees this enqueue as 'contended' and
        -- claims again instead of sleeping (arm_waiter); the retention duty's clean-up of
        -- lane_priorities skips the lane. The next statements' snapshots see every arming
        -- committed before the lock was granted.
        PERFORM pg_advisory_xact_lock_shared(wake_lock_key(entry.lane));
        INSERT INTO lane_priorities (lane, priority)
        SELECT DISTINCT entry.lane, n.priority FROM new_jobs AS n WHERE n.lane = entry.lane
            ON CONFLICT DO NOTHING;
        IF entry.due = 0 THEN
            -- Work for later: the supervisors set a timer for it.
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup',
                              entry.lane || '@' || extract(epoch FROM entry.first_run_at)::text);
        ELSIF always OR EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = entry.lane) THEN
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup', entry.lane || '#' || entry.due);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- The retention duty forgets the priorities a lane no longer uses, one lane at a time and
-- only while no enqueue into it is in flight (the exclusive try-lock): an enqueue that
-- found its pair present cannot have the pair deleted under its uncommitted job.
CREATE FUNCTION forget_unused_priorities(lane text) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    forgotten integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(forget_unused_priorities.lane)) THEN
        RETURN 0;
    END IF;
    DELETE FROM lane_priorities AS p
     WHERE p.lane = forget_unused_priorities.lane
       -- Claimable jobs through the claim index, claimed ones (which a release or an expired
       -- lease makes claimable again) through the lease index.
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.lane = p.lane AND j.priority = p.priority
                          AND j.state IN ('pending', 'failed'))
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.state = 'claimed' AND j.lease_until IS NOT NULL
                          AND j.lane = p.lane AND j.priority = p.priority);
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$$;

-- Where a worker's scan of each priority of a lane starts (jobd/claim_floors.py): the later
-- of a (run_at, id) position and an instant the priority was dry at, given as an age before
-- `at` (default_age for priorities without one of their own); the head ('-infinity', 0)
-- when neither is known. Used by claim_jobs and arm_waiter. No SET search_path, so that the
-- planner can inline it into the claim: its callers run with jobd's schema on the path.
CREATE FUNCTION lane_floors(lane text, priorities integer[], run_ats timestamptz[],
                            ids bigint[], ages float8[], default_age float8, at timestamptz)
RETURNS TABLE (priority integer, floor_at timestamptz, floor_id bigint)
LANGUAGE sql STABLE
AS $$
    SELECT p.priority,
           CASE WHEN f.run_at > dry.floor_at THEN f.run_at ELSE dry.floor_at END,
           CASE WHEN f.run_at > dry.floor_at THEN f.id ELSE 0 END
      FROM lane_priorities AS p
      LEFT JOIN unnest(priorities, run_ats, ids, ages) AS f(priority, run_at, id, age)
             ON f.priority = p.priority
     CROSS JOIN LATERAL (
           SELECT coalesce(at - make_interval(secs => coalesce(f.age, default_age)),
                           '-infinity') AS floor_at) AS dry
     WHERE p.lane = lane_floors.lane
$$;

-- A worker with nothing left to claim arms itself, unless work may have arrived since its
-- last claim. 'contended': an enqueue is between its insert and its commit (it holds the
-- lane's shared lock), so the worker claims again shortly instead of sleeping. 'work': a
-- due job is visible above the worker's floors. 'armed': the worker's row is in
-- lane_waiters; every enqueue that takes the lock after this commit sees it and notifies.
-- The exclusive try-lock never waits: producers are never queued behind a worker.
CREATE FUNCTION arm_waiter(lane text, worker_id text, floor_priorities integer[],
                           floor_run_ats timestamptz[], floor_ids bigint[],
                           floor_ages float8[], default_floor_age float8)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    level integer;
    floor_at timestamptz;
    floor_id bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(arm_waiter.lane)) THEN
        RETURN 'contended';
    END IF;
    -- This statement's snapshot is taken after the lock: it sees every job whose enqueue
    -- held the lock before.
    FOR level, floor_at, floor_id IN
        SELECT l.priority, l.floor_at, l.floor_id
          FROM lane_floors(arm_waiter.lane, floor_priorities, floor_run_ats, floor_ids,
                           floor_ages, default_floor_age, now()) AS l
    LOOP
        IF EXISTS (SELECT 1 FROM jobs AS j
                    WHERE j.lane = arm_waiter.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
                      AND j.run_at <= now() AND NOT j.suspect) THEN
            RETURN 'work';
        END IF;
    END LOOP;
    INSERT INTO lane_waiters (worker_id, lane) VALUES (arm_waiter.worker_id, arm_waiter.lane)
        ON CONFLICT ON CONSTRAINT lane_waiters_pkey
        DO UPDATE SET lane = excluded.lane, armed_at = now();
    RETURN 'armed';
END
$$;

-- The earliest run_at of a lane's claimable jobs: one index probe per listed priority.
CREATE OR REPLACE FUNCTION lane_head(lane text) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT min(first.run_at)
      FROM lane_priorities AS p
     CROSS JOIN LATERAL (
           SELECT j.run_at FROM jobs AS j
            WHERE j.lane = p.lane AND j.state IN ('pending', 'failed') AND j.priority = p.priority
            ORDER BY j.run_at LIMIT 1) AS first
     WHERE p.lane = lane_head.lane
$$;

-- A worker's arming probe that finds work no longer removes the worker's row from
-- lane_waiters: the worker claims while armed and stays armed while its claims come back
-- short; the claim after a full one removes the row (jobd/claimer.py, docs/design/queue.md,
-- "Wake-ups"). At a steady 400 jobs/s an unarmed worker's armings answered 'work' or
-- 'contended' nine times in ten, so each removal meant another arming per job, each a row
-- version that a held xmin horizon keeps and the next registration's uniqueness check visits.
-- arm_waiter, the one-transaction arming of daemons before 0020, removes the row itself on
-- 'work', as those daemons expect.
CREATE OR REPLACE FUNCTION arm_waiter_probe(lane text, worker_id text, floor_priorities integer[],
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
    paused_handlers text[] := ARRAY(SELECT p.handler FROM lane_pauses AS p
                                     WHERE p.lane = arm_waiter_probe.lane
                                       AND p.handler IS NOT NULL);
BEGIN
    FOR level, floor_at, floor_id IN
        SELECT l.priority, l.floor_at, l.floor_id
          FROM lane_floors(arm_waiter_probe.lane, floor_priorities, floor_run_ats, floor_ids,
                           floor_ages, default_floor_age, now()) AS l
    LOOP
        -- In claim order, so jobs_claimable_idx serves it from the floor (0023): an
        -- EXISTS drops its ORDER BY, and from jobs_fair_idx the floor bounds nothing.
        PERFORM FROM jobs AS j
          WHERE j.lane = arm_waiter_probe.lane AND j.state IN ('pending', 'failed')
            AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
            AND j.run_at <= now() AND NOT j.suspect
            AND runnable(j.handler, paused_handlers)
          ORDER BY j.run_at, j.id
          LIMIT 1;
        IF FOUND THEN
            -- The worker's row stays (0024): it claims while armed, as after a wake-up.
            RETURN 'work';
        END IF;
    END LOOP;
    RETURN 'armed';
END
$$;

CREATE OR REPLACE FUNCTION arm_waiter(lane text, worker_id text, floor_priorities integer[],
                                      floor_run_ats timestamptz[], floor_ids bigint[],
                                      floor_ages float8[], default_floor_age float8)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    registered text := arm_waiter_register(arm_waiter.lane, arm_waiter.worker_id);
    probed     text;
BEGIN
    IF registered <> 'registered' THEN
        RETURN registered;
    END IF;
    probed := arm_waiter_probe(arm_waiter.lane, arm_waiter.worker_id, floor_priorities,
                               floor_run_ats, floor_ids, floor_ages, default_floor_age);
    IF probed = 'work' THEN
        -- Those daemons take 'work' as "not armed" (0024 keeps the row in the probe).
        DELETE FROM lane_waiters AS w WHERE w.worker_id = arm_waiter.worker_id;
    END IF;
    RETURN probed;
END
$$;

-- The ids a claim in a lane with max_wait or fair_by takes (claim_jobs_ordered), in claim
-- order, and locked (FOR UPDATE SKIP LOCKED) for the claiming statement.
--
-- Two passes over the lane's priorities (their floors from lane_floors, as in claim_jobs):
-- 1. Overdue: with max_wait, jobs due since `at - max_wait` or earlier come first, whatever
--    their priority; the priorities whose oldest overdue job is oldest go first. So a job
--    passed over for max_wait is next once the overdue jobs older than it are claimed.
-- 2. The rest, highest priority first, each oldest first.
-- Within a priority and pass, with `fair`, the jobs are shared round-robin across share
-- keys (coalesce(fairness_key, handler)): the keys with due jobs are found one index
-- descent each, starting after key_cursor (the claiming worker's last key) and wrapping,
-- up to as many keys as jobs wanted; each takes an equal share, then the keys that filled
-- their share split what is left. Without `fair`, a priority's jobs are taken oldest first.

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION arm_waiter_probe(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION arm_waiter(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8) SET search_path = %I, pg_temp', current_schema());
END
$$;

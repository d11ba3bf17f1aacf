-- The arming probe looks for work in claim order, so it walks the claim index from the
-- worker's floors. Its EXISTS had no order, and PostgreSQL throws an ORDER BY away inside
-- EXISTS; so the planner was free to answer it from jobs_fair_idx, which has the same
-- predicate but the share key between priority and run_at: there the floor is no range
-- bound, and the probe walked every entry of the priority, the dead ones a held horizon
-- keeps included (bench/pressure.py, three minutes of an idle transaction: 14 million entries
-- read in jobs_fair_idx by 70,000 probes of a lane that is not fair, 1.3 ms a probe). A
-- query with ORDER BY run_at, id LIMIT 1 (PERFORM keeps it a query, not an EXISTS) is served
-- in order by jobs_claimable_idx, from the floor.
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
            DELETE FROM lane_waiters AS w WHERE w.worker_id = arm_waiter_probe.worker_id;
            RETURN 'work';
        END IF;
    END LOOP;
    RETURN 'armed';
END
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION arm_waiter_probe(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8) SET search_path = %I, pg_temp', current_schema());
END
$$;

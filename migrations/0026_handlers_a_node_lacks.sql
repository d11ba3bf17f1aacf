-- A worker no longer claims the jobs of handlers its node does not have. Before, it claimed
-- them and failed each attempt with "no handler named ...": during a rolling deploy that adds a
-- handler, the nodes not yet upgraded spent the new jobs' attempts, and a lane served by nodes
-- with different handler sets (a second node's own config) could dead-letter good jobs. Now a
-- worker that claims such a job gives it back unstarted, its attempt returned, and from then on
-- steps over that handler's jobs as over a paused handler's: the claims take the list as a
-- parameter (jobd/sql/queries.sql), and so does the arming probe, below, so that a worker whose
-- lane holds only jobs it cannot run sleeps instead of claiming again and again. The new
-- parameter has a default: daemons of earlier releases call the probe as before.
DROP FUNCTION arm_waiter_probe(text, text, integer[], timestamptz[], bigint[], float8[], float8);

CREATE FUNCTION arm_waiter_probe(lane text, worker_id text, floor_priorities integer[],
                                 floor_run_ats timestamptz[], floor_ids bigint[],
                                 floor_ages float8[], default_floor_age float8,
                                 skipped_handlers text[] DEFAULT '{}')
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
                                       AND p.handler IS NOT NULL)
                              || coalesce(skipped_handlers, '{}');
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION arm_waiter_probe(text, text, integer[], timestamptz[], bigint[],'
                   ' float8[], float8, text[]) SET search_path = %I, pg_temp', current_schema());
END
$$;

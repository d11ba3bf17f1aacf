-- With max_wait, claim_order put first the priority whose oldest overdue job was oldest, and
-- that look did not step over what the claim itself steps over (claim_level): a paused
-- handler's job, one of a handler the claiming node lacks, or a suspect. Such a job put its
-- priority first, the claim filled with that priority's younger overdue jobs, and an older
-- overdue job of another priority was passed over: at every scan from the head, and for as
-- long as the pause lasted in a lane with fair_by (whose claims scan the priorities from the
-- head). The look, and the second pass's probe, now filter as the claim does.
CREATE OR REPLACE FUNCTION claim_order(lane text, priorities integer[], run_ats timestamptz[],
                            ids bigint[], ages float8[], default_age float8, at timestamptz,
                            max_wait float8, fair boolean, key_cursor text, wanted integer,
                            paused_handlers text[], key_floors_priority integer[],
                            key_floors_key text[], key_floors_run_at timestamptz[],
                            key_floors_id bigint[])
RETURNS bigint[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    picked bigint[] := '{}';
    overdue_before timestamptz := at - make_interval(secs => max_wait);
    level record;
    -- The positions per share key, looked up by key (key_floor) rather than searched; only
    -- a fair claim has any use for them.
    positions jsonb := CASE WHEN fair THEN key_positions(key_floors_priority, key_floors_key,
                                                         key_floors_run_at, key_floors_id)
                            ELSE '{}' END;
BEGIN
    IF max_wait IS NOT NULL THEN
        FOR level IN
            SELECT l.priority, l.floor_at, l.floor_id
              FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
                   AS l
             CROSS JOIN LATERAL (
                   -- The oldest overdue job the claim may take (claim_level's filters): a
                   -- paused or lacking handler's, or a suspect, put its priority first and
                   -- an older overdue job of another priority waited behind it.
                   SELECT j.run_at FROM jobs AS j
                    WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = l.priority
                      AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                      AND j.run_at <= overdue_before
                      AND NOT j.suspect
                      AND (cardinality(paused_handlers) = 0
                           OR runnable(j.handler, paused_handlers))
                    ORDER BY j.run_at, j.id
                    LIMIT 1) AS head
             ORDER BY head.run_at
        LOOP
            picked := picked || claim_level(claim_order.lane, level.priority, level.floor_at,
                                            level.floor_id, '-infinity', overdue_before, fair,
                                            key_cursor, wanted - cardinality(picked),
                                            paused_handlers, positions);
            EXIT WHEN cardinality(picked) >= wanted;
        END LOOP;
    END IF;
    IF cardinality(picked) < wanted THEN
        -- Only the priorities with a due job (one probe each of the claim index): a fair
        -- claim would otherwise step through the keys of a priority whose jobs are all
        -- scheduled for later.
        FOR level IN
            SELECT l.priority, l.floor_at, l.floor_id
              FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
                   AS l
             WHERE EXISTS (SELECT 1 FROM jobs AS j
                            WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                              AND j.priority = l.priority
                              AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                              AND j.run_at > coalesce(overdue_before, '-infinity')
                              AND j.run_at <= at
                              AND NOT j.suspect
                              AND (cardinality(paused_handlers) = 0
                                   OR runnable(j.handler, paused_handlers)))
             ORDER BY l.priority DESC
        LOOP
            picked := picked || claim_level(claim_order.lane, level.priority, level.floor_at,
                                            level.floor_id,
                                            coalesce(overdue_before, '-infinity'), at, fair,
                                            key_cursor, wanted - cardinality(picked),
                                            paused_handlers, positions);
            EXIT WHEN cardinality(picked) >= wanted;
        END LOOP;
    END IF;
    RETURN picked;
END
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION claim_order(text, integer[], timestamptz[], bigint[], '
                   'float8[], float8, timestamptz, float8, boolean, text, integer, text[], '
                   'integer[], text[], timestamptz[], bigint[]) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$$;

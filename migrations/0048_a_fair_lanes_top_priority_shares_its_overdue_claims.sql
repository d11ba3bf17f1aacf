-- With max_wait and fair_by both set, a fair lane's overdue jobs filled its claims ahead of
-- every younger job of their own priority, so a herd of one key older than max_wait (a
-- backlog that took longer than max_wait to drain, or delayed jobs a clock jump made due at
-- once) held back every other key's new jobs for max_wait each: the shares fair_by promises
-- came only once those jobs were overdue too. max_wait bounds the wait behind higher
-- priorities, and the highest priority with due jobs has none above it: its overdue level
-- now takes all of its due jobs, shared across keys as its plain level does, in the place its
-- oldest overdue job gives it among the overdue levels. Overdue jobs of lower priorities
-- still go ahead of it when they are older. Lanes without fair_by are unchanged.
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
    -- A fair lane's highest priority with a due job the claim may take (NULL otherwise):
    -- its overdue level takes all of its due jobs, shared across keys (migration 0048).
    top integer;
    -- Whether the overdue pass visited the top priority: it then took all of its due jobs,
    -- which the second pass must not take again (rows this transaction locked are not
    -- skipped: each would be listed twice).
    top_visited boolean := false;
BEGIN
    IF max_wait IS NOT NULL AND fair THEN
        -- No priority above it passes its overdue jobs over. Taken alone they filled the
        -- claim (a herd older than max_wait, or due since before a clock jump), and the
        -- priority's other keys waited max_wait behind them.
        SELECT max(l.priority) INTO top
          FROM lane_floors(claim_order.lane, priorities, run_ats, ids, ages, default_age, at)
               AS l
         WHERE EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                          AND j.priority = l.priority
                          AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                          AND j.run_at <= at
                          AND NOT j.suspect
                          AND (cardinality(paused_handlers) = 0
                               OR runnable(j.handler, paused_handlers)));
    END IF;
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
                                            level.floor_id, '-infinity',
                                            CASE WHEN level.priority = top THEN at
                                                 ELSE overdue_before END,
                                            fair, key_cursor, wanted - cardinality(picked),
                                            paused_handlers, positions);
            top_visited := top_visited OR level.priority IS NOT DISTINCT FROM top;
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
               AND NOT (top_visited AND l.priority IS NOT DISTINCT FROM top)
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

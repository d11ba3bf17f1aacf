-- A fair claim starts each share key's scan at the later of the priority's floor and the key's
-- own position, which the worker sends as four parallel arrays (jobd/claim_floors.py, up to
-- 256 positions). key_floor found a key's position by unnesting the four arrays and joining
-- them on the key, once for every key the walk visited and again for every key given a share:
-- some 20 us a lookup with 256 positions, 5 ms of a 9 ms claim over 10,000 keys.
--
-- claim_order now turns the arrays into one jsonb object per claim (key_positions: "priority:
-- key" -> [run_at, id]), and key_floor looks the key up in it (a binary search of the
-- object's sorted keys). The functions that pass the positions along take that object in
-- place of the arrays; claim_order keeps its signature, so a daemon of an older version
-- claims through the new functions unchanged.
--
-- due_keys, the walk from key to key, becomes PL/pgSQL: as a SQL function with SET clauses
-- it was planned again at every claim, more than half of a fair claim over one key.
DROP FUNCTION claim_level(text, integer, timestamptz, bigint, timestamptz, timestamptz, boolean,
                          text, integer, text[], integer[], text[], timestamptz[], bigint[]);
DROP FUNCTION due_keys(text, integer, text, text, timestamptz, bigint, timestamptz,
                       timestamptz, integer, integer[], text[], timestamptz[], bigint[]);
DROP FUNCTION key_floor(text, integer, timestamptz, bigint, integer[], text[], timestamptz[],
                        bigint[]);

-- The worker's positions per share key as one object: "priority:key" -> [run_at, id]. The
-- priority is an integer, so the first ':' ends it whatever the key holds.
CREATE FUNCTION key_positions(priorities integer[], keys text[], run_ats timestamptz[],
                              ids bigint[])
RETURNS jsonb
-- STABLE: a timestamptz's text in the object depends on the session's TimeZone (the instant
-- read back from it does not). PL/pgSQL, as due_keys: planned once per session.
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (SELECT coalesce(jsonb_object_agg(f.priority || ':' || f.key,
                                             jsonb_build_array(f.run_at, f.id)), '{}')
              FROM unnest(priorities, keys, run_ats, ids) AS f(priority, key, run_at, id));
END
$$;

-- Where a fair claim's scan of one key of a priority starts: the later of the priority's
-- floor and the key's own position (the last job of it the worker took, jobd/claim_floors.py),
-- so that the scan does not walk the dead index entries of the key's jobs claimed before,
-- which vacuum has not removed yet: a herd of one key leaves tens of thousands.
CREATE FUNCTION key_floor(key text, level integer, floor_at timestamptz, floor_id bigint,
                          positions jsonb)
RETURNS TABLE (floor_at timestamptz, floor_id bigint)
LANGUAGE sql STABLE
AS $$
    SELECT CASE WHEN (p.run_at, p.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN p.run_at ELSE key_floor.floor_at END,
           CASE WHEN (p.run_at, p.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN p.id ELSE key_floor.floor_id END
      FROM (SELECT (found.entry ->> 0)::timestamptz AS run_at, (found.entry ->> 1)::bigint AS id
              FROM (SELECT positions -> (level || ':' || key_floor.key) AS entry) AS found) AS p
$$;

-- The share keys of one priority of a lane that have due jobs with run_at in (after, up_to],
-- in order after from_key and up to to_key (NULL: to the end), at most `wanted`: a skip scan
-- of jobs_fair_idx, one index descent per key (a recursive query stepping from key to key),
-- and one more to see whether the key has a due job. Keys whose jobs are all scheduled for
-- later cost their two descents each time a claim passes them. Sorts are priced out
-- (migration 0027): a step planned on jobs_claimable_idx, sorting what it reads by key, read
-- every due job of the priority; statistics taken while the table was empty make that plan
-- cost the same as the descent of jobs_fair_idx to the planner. PL/pgSQL, not SQL: a SQL
-- function with SET clauses is never inlined, and PostgreSQL plans its body again in every
-- transaction that calls it (every claim), where PL/pgSQL keeps the plan for the session
-- (migration 0028: the planning was more than half of a fair claim over one key).
CREATE FUNCTION due_keys(lane text, level integer, from_key text, to_key text,
                         floor_at timestamptz, floor_id bigint, after timestamptz,
                         up_to timestamptz, wanted integer, positions jsonb)
RETURNS text[]
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_sort = off
AS $$
BEGIN
    RETURN (
        WITH RECURSIVE walk(key) AS (
            SELECT (SELECT coalesce(j.fairness_key, j.handler) COLLATE "C" FROM jobs AS j
                     WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                       AND j.priority = level
                       AND coalesce(j.fairness_key, j.handler) COLLATE "C" > from_key
                     ORDER BY 1
                     LIMIT 1)
            UNION ALL
            SELECT (SELECT coalesce(j.fairness_key, j.handler) COLLATE "C" FROM jobs AS j
                     WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                       AND j.priority = level
                       AND coalesce(j.fairness_key, j.handler) COLLATE "C" > w.key
                     ORDER BY 1
                     LIMIT 1)
              FROM walk AS w
             WHERE w.key IS NOT NULL AND (to_key IS NULL OR w.key < to_key)
        )
        SELECT coalesce(array_agg(d.key), '{}')
          FROM (SELECT w.key FROM walk AS w
                 CROSS JOIN LATERAL key_floor(w.key, level, floor_at, floor_id, positions) AS f
                 -- A probe per key (LIMIT 1 in a lateral: never a hash of a key's every job).
                 CROSS JOIN LATERAL (
                       SELECT 1 FROM jobs AS j
                        WHERE j.lane = due_keys.lane AND j.state IN ('pending', 'failed')
                          AND j.priority = level
                          AND coalesce(j.fairness_key, j.handler) COLLATE "C" = w.key
                          AND (j.run_at, j.id) >= (f.floor_at, f.floor_id)
                          AND j.run_at > after AND j.run_at <= up_to
                        LIMIT 1) AS due
                 WHERE w.key IS NOT NULL AND (to_key IS NULL OR w.key <= to_key)
                 LIMIT wanted) AS d);
END
$$;

-- Up to `wanted` due jobs of one priority of a lane with run_at in (after, up_to] and at or
-- above the floor: oldest first, or shared across keys (see claim_order). In a round, each
-- key takes an equal share (the first keys one more, so the shares add up to what is
-- wanted); the keys that filled theirs split what is left in the next round.
CREATE FUNCTION claim_level(lane text, level integer, floor_at timestamptz, floor_id bigint,
                            after timestamptz, up_to timestamptz, fair boolean,
                            key_cursor text, wanted integer, paused_handlers text[],
                            positions jsonb)
RETURNS bigint[]
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    picked bigint[] := '{}';
    keys text[];
    taken bigint[];
BEGIN
    IF NOT fair THEN
        RETURN ARRAY(SELECT j.id FROM jobs AS j
                      WHERE j.lane = claim_level.lane AND j.state IN ('pending', 'failed')
                        AND j.priority = level AND (j.run_at, j.id) >= (floor_at, floor_id)
                        AND j.run_at > after AND j.run_at <= up_to AND NOT j.suspect
                        AND runnable(j.handler, paused_handlers)
                      ORDER BY j.run_at, j.id
                      LIMIT wanted
                        FOR UPDATE SKIP LOCKED);
    END IF;
    -- The keys after the cursor, then from the start around to it.
    keys := due_keys(claim_level.lane, level, coalesce(key_cursor, ''), NULL, floor_at,
                     floor_id, after, up_to, wanted, positions);
    IF cardinality(keys) < wanted AND coalesce(key_cursor, '') <> '' THEN
        keys := keys || due_keys(claim_level.lane, level, '', key_cursor, floor_at, floor_id,
                                 after, up_to, wanted - cardinality(keys), positions);
    END IF;
    WHILE cardinality(keys) > 0 AND cardinality(picked) < wanted LOOP
        WITH shares AS (
            SELECT k.key, k.position, (wanted - cardinality(picked)) / cardinality(keys)
                          + CASE WHEN k.position <= (wanted - cardinality(picked))
                                                    % cardinality(keys)
                                 THEN 1 ELSE 0 END AS share,
                   f.floor_at, f.floor_id
              FROM unnest(keys) WITH ORDINALITY AS k(key, position)
             CROSS JOIN LATERAL key_floor(k.key, level, floor_at, floor_id, positions) AS f
        ),
        got AS (
            SELECT s.key, s.share, t.id
              FROM shares AS s
             CROSS JOIN LATERAL (
                   SELECT j.id FROM jobs AS j
                    WHERE j.lane = claim_level.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = level
                      AND coalesce(j.fairness_key, j.handler) COLLATE "C" = s.key
                      AND (j.run_at, j.id) >= (s.floor_at, s.floor_id)
                      AND j.run_at > after AND j.run_at <= up_to AND NOT j.suspect
                      AND runnable(j.handler, paused_handlers)
                      AND NOT (j.id = ANY(picked))
                    ORDER BY j.run_at, j.id
                    LIMIT s.share
                      FOR UPDATE SKIP LOCKED) AS t
             WHERE s.share > 0
        )
        -- The next round's keys: those that filled their share, and those whose share was
        -- 0 (fewer jobs left than keys); a key that took less than its share has run dry.
        -- Each round takes a job or drops a key, so the loop ends.
        SELECT coalesce((SELECT array_agg(g.id) FROM got AS g), '{}'),
               coalesce((SELECT array_agg(s.key ORDER BY s.position)
                           FROM shares AS s
                           LEFT JOIN (SELECT g.key, count(*) AS n FROM got AS g
                                       GROUP BY g.key) AS t ON t.key = s.key
                          WHERE s.share = 0 OR t.n = s.share), '{}')
          INTO taken, keys;
        picked := picked || taken;
    END LOOP;
    RETURN picked;
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
                   SELECT j.run_at FROM jobs AS j
                    WHERE j.lane = claim_order.lane AND j.state IN ('pending', 'failed')
                      AND j.priority = l.priority
                      AND (j.run_at, j.id) >= (l.floor_at, l.floor_id)
                      AND j.run_at <= overdue_before
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
                              AND j.run_at <= at)
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
    EXECUTE format('ALTER FUNCTION due_keys(text, integer, text, text, timestamptz, bigint, '
                   'timestamptz, timestamptz, integer, jsonb) SET search_path = %I, pg_temp',
                   current_schema());
    EXECUTE format('ALTER FUNCTION claim_level(text, integer, timestamptz, bigint, timestamptz, '
                   'timestamptz, boolean, text, integer, text[], jsonb) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION claim_order(text, integer[], timestamptz[], bigint[], '
                   'float8[], float8, timestamptz, float8, boolean, text, integer, text[], '
                   'integer[], text[], timestamptz[], bigint[]) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

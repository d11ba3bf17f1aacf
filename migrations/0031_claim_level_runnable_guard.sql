-- claim_level (the claims of lanes with fair_by or max_wait) filtered every row it takes with
-- runnable(handler, paused_handlers): a PL/pgSQL call, 0.3-0.5 us a row, kept opaque so
-- that the planner keeps the ordered index scans (migration 0011). It is now made only when
-- some handler is paused or lacking, as claim_jobs and claim_jobs_limited make it since the
-- same change (jobd/sql/queries.sql): with nothing to step over, cardinality() = 0 holds for
-- every row. Same signature and answers.
CREATE OR REPLACE FUNCTION claim_level(lane text, level integer, floor_at timestamptz, floor_id bigint,
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
                        AND (cardinality(paused_handlers) = 0
                             OR runnable(j.handler, paused_handlers))
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
                      AND (cardinality(paused_handlers) = 0
                           OR runnable(j.handler, paused_handlers))
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION claim_level(text, integer, timestamptz, bigint, timestamptz, '
                   'timestamptz, boolean, text, integer, text[], jsonb) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$$;

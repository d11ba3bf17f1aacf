-- A fair claim (claim_level with fair_by) asks due_keys for up to `wanted` share keys with a
-- due job, then takes each key's share, stepping over the jobs of paused handlers, of handlers
-- the claiming node lacks, and suspects. due_keys's probe did not step over them: a key whose
-- due jobs were all such jobs counted towards `wanted`, claim_level took nothing from it and
-- asked for no other key, and the worker's key cursor, which moves only with what a claim
-- takes, started the next claim at the same keys. With as many such keys as a claim wants
-- ahead of the others (a paused handler's tenants first in key order), the lane claimed
-- nothing for as long as the pause lasted, or for good for a handler the node lacks.
--
-- due_keys now takes the paused (and lacking) handlers and probes with the claim's own
-- filters; claim_level passes them on. claim_level keeps its signature, so a daemon of the
-- previous release claims through the new functions unchanged.
DROP FUNCTION due_keys(text, integer, text, text, timestamptz, bigint, timestamptz,
                       timestamptz, integer, jsonb);

CREATE FUNCTION due_keys(lane text, level integer, from_key text, to_key text,
                         floor_at timestamptz, floor_id bigint, after timestamptz,
                         up_to timestamptz, wanted integer, positions jsonb,
                         paused_handlers text[])
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
                          -- What claim_level may take: a key whose due jobs are all a
                          -- paused or lacking handler's, or suspects, must not count
                          -- towards `wanted`, or it would stand in for a key after it at
                          -- every claim for as long as the pause lasts (migration 0033).
                          AND NOT j.suspect
                          AND (cardinality(paused_handlers) = 0
                               OR runnable(j.handler, paused_handlers))
                        LIMIT 1) AS due
                 WHERE w.key IS NOT NULL AND (to_key IS NULL OR w.key <= to_key)
                 LIMIT wanted) AS d);
END
$$;

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
                     floor_id, after, up_to, wanted, positions, paused_handlers);
    IF cardinality(keys) < wanted AND coalesce(key_cursor, '') <> '' THEN
        keys := keys || due_keys(claim_level.lane, level, '', key_cursor, floor_at, floor_id,
                                 after, up_to, wanted - cardinality(keys), positions,
                                 paused_handlers);
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
    EXECUTE format('ALTER FUNCTION due_keys(text, integer, text, text, timestamptz, bigint, '
                   'timestamptz, timestamptz, integer, jsonb, text[]) '
                   'SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION claim_level(text, integer, timestamptz, bigint, timestamptz, '
                   'timestamptz, boolean, text, integer, text[], jsonb) '
                   'SET search_path = %I, pg_temp', current_schema());
END
$$;

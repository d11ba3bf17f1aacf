-- A fair claim lists up to `wanted` share keys with due jobs (due_keys) and takes each key's
-- share with FOR UPDATE SKIP LOCKED. due_keys's probe sees the rows another claim has locked
-- and not committed yet, so a key whose due jobs another worker is claiming was listed and then
-- took nothing. With every listed key run dry that way the claim came back short while keys it
-- never listed held due jobs, and a short claim tells the worker the lane is dry: it waited for
-- its next scan from the head (about a second; up to a minute under a held horizon). Two
-- workers of one fair lane met this at every other claim. claim_level now goes on listing keys
-- from where it stopped while jobs are still wanted; without contention the first list fills
-- the claim as before, and no extra descent is made.

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
    -- Where the listing of keys goes on: after list_from, up to list_to (NULL: to the end,
    -- the keys after the cursor; then from the start around to the cursor).
    list_from text := coalesce(key_cursor, '');
    list_to text := NULL;
    listed_all boolean := false;
    page text[];
    want integer;
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
    -- Up to as many keys as jobs are still wanted, then their shares. due_keys sees a key
    -- whose due jobs another claim holds (not committed yet), and its share takes nothing:
    -- when every listed key has run dry with jobs still wanted, the listing goes on from where
    -- it stopped (migration 0040). Otherwise the claim came back short with jobs left in keys
    -- it never listed, and its worker took the lane for dry.
    WHILE NOT listed_all AND cardinality(picked) < wanted LOOP
        keys := '{}';
        WHILE NOT listed_all AND cardinality(keys) < wanted - cardinality(picked) LOOP
            want := wanted - cardinality(picked) - cardinality(keys);
            page := due_keys(claim_level.lane, level, list_from, list_to, floor_at, floor_id,
                             after, up_to, want, positions, paused_handlers);
            keys := keys || page;
            IF cardinality(page) = want THEN
                list_from := page[cardinality(page)];
            ELSIF list_to IS NULL AND key_cursor <> '' THEN
                list_from := '';
                list_to := key_cursor;
            ELSE
                listed_all := true;
            END IF;
        END LOOP;
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
            -- The next round's keys: those that filled their share, and those whose share
            -- was 0 (fewer jobs left than keys); a key that took less than its share has run
            -- dry. Each round takes a job or drops a key, so the loop ends.
            SELECT coalesce((SELECT array_agg(g.id) FROM got AS g), '{}'),
                   coalesce((SELECT array_agg(s.key ORDER BY s.position)
                               FROM shares AS s
                               LEFT JOIN (SELECT g.key, count(*) AS n FROM got AS g
                                           GROUP BY g.key) AS t ON t.key = s.key
                              WHERE s.share = 0 OR t.n = s.share), '{}')
              INTO taken, keys;
            picked := picked || taken;
        END LOOP;
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

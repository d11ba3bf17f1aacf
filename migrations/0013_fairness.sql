-- Fairness within a lane (docs/design/fairness.md): a job's fairness key, age-based
-- promotion (lanes.<l>.max_wait) and round-robin shares across keys (lanes.<l>.fair_by).
--
-- A job's share key is its fairness_key when the producer set one (a tenant, a customer),
-- else its handler. Adding the nullable columns rewrites nothing; the new index is built while
-- the migration holds its lock on jobs (see docs/upgrades.md for a large backlog).

ALTER TABLE jobs ADD COLUMN fairness_key text;
ALTER TABLE jobs_archive ADD COLUMN fairness_key text;
ALTER TABLE dead_letter ADD COLUMN fairness_key text;

-- The fair claim's index: a lane's claimable jobs by priority, then share key, then age, so
-- the claim steps from one key to the next (a skip scan written as a loop, claim_order) and
-- takes each key's oldest jobs without walking past another key's herd.
-- The key compares in code point order (COLLATE "C"): cheaper than a language's rules, and
-- the order the workers' cursors (jobd/claimer.py) assume.
CREATE INDEX jobs_fair_idx ON jobs (lane, priority DESC,
                                    (coalesce(fairness_key, handler) COLLATE "C"), run_at, id)
    WHERE state IN ('pending', 'failed');

CREATE OR REPLACE VIEW all_jobs AS
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           lease_until, claimed_by, idempotency_key, created_at, last_error, errors,
           NULL::timestamptz AS finished_at, cancel_requested_at, fairness_key
      FROM jobs
    UNION ALL
    SELECT id, lane, handler, payload, state, priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           finished_at, NULL::timestamptz, fairness_key
      FROM jobs_archive
    UNION ALL
    SELECT id, lane, handler, payload, 'dead', priority, run_at, attempts, max_attempts,
           NULL::timestamptz, claimed_by, idempotency_key, created_at, last_error, errors,
           died_at, NULL::timestamptz, fairness_key
      FROM dead_letter;

-- The rules every entry point applies to a job, now with its fairness key.
DROP FUNCTION check_job(text, text, jsonb, timestamptz, text, integer);
CREATE FUNCTION check_job(
    handler text, lane text, payload jsonb, run_at timestamptz, idempotency_key text,
    max_attempts integer, fairness_key text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    name_rule constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$';
BEGIN
    IF check_job.handler IS NULL OR check_job.handler !~ name_rule THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid handler name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.handler), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.lane IS NULL OR check_job.lane !~ name_rule THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid lane name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.lane), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.idempotency_key IS NOT NULL THEN
        IF check_job.idempotency_key = '' THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency_key must be a non-empty string'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(check_job.idempotency_key) > 512 THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency_key is % bytes; at most 512 are allowed',
                octet_length(check_job.idempotency_key)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- Keys starting with 'jobd:' name jobd's own jobs (schedule occurrences, outbox
        -- deliveries, keys derived from job ids); a caller's key must not collide with them.
        IF starts_with(check_job.idempotency_key, 'jobd:') THEN
            RAISE EXCEPTION 'jobd.enqueue: idempotency keys starting with ''jobd:'' are reserved for jobd''s own jobs'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    -- The key is part of an index entry: bounded well below B-tree's entry size limit.
    IF check_job.fairness_key IS NOT NULL THEN
        IF check_job.fairness_key = '' THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key must be a non-empty string'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(check_job.fairness_key) > 256 THEN
            RAISE EXCEPTION 'jobd.enqueue: fairness_key is % bytes; at most 256 are allowed',
                octet_length(check_job.fairness_key)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;
    IF check_job.max_attempts IS NOT NULL AND check_job.max_attempts < 1 THEN
        RAISE EXCEPTION 'jobd.enqueue: max_attempts must be a positive integer, not %',
            check_job.max_attempts USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.run_at IS NOT NULL AND NOT (check_job.run_at >= '1970-01-01 00:00:00+00'
                                             AND check_job.run_at < '9999-01-01 00:00:00+00') THEN
        RAISE EXCEPTION 'jobd.enqueue: run_at % is out of range: it must be from 1970-01-01 to before 9999-01-01 (UTC)',
            check_job.run_at USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.payload IS NULL THEN
        RAISE EXCEPTION 'jobd.enqueue: payload must not be SQL NULL (a JSON null is ''null''::jsonb; leave it out for {})'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM check_payload_size(octet_length(check_job.payload::text));
    -- Both limits are what the workers' decoder (Python's json) can read back: nesting
    -- below its recursion limit, integers below its 4300-digit limit.
    IF jsonb_path_exists(check_job.payload, 'strict $.**{257}') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload is nested more than 256 levels deep'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_path_exists(check_job.payload,
                         'strict $.** ? (@.type() == "number" && (@ >= 1e4300 || @ <= -1e4300))') THEN
        RAISE EXCEPTION 'jobd.enqueue: payload holds a number of 4300 digits or more'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- jobd.enqueue with the contract's eighth argument. The seven-argument calls of the previous
-- release resolve to this function (the new argument has a default).
DROP FUNCTION enqueue(text, jsonb, text, timestamptz, integer, text, integer);
CREATE FUNCTION enqueue(
    handler         text,
    payload         jsonb       DEFAULT '{}',
    lane            text        DEFAULT 'default',
    run_at          timestamptz DEFAULT now(),
    priority        integer     DEFAULT 0,
    idempotency_key text        DEFAULT NULL,
    max_attempts    integer     DEFAULT NULL,
    fairness_key    text        DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    new_id bigint;
BEGIN
    PERFORM check_job(enqueue.handler, enqueue.lane, enqueue.payload, enqueue.run_at,
                      enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    IF enqueue.idempotency_key IS NOT NULL THEN
        INSERT INTO job_keys AS k (idempotency_key, job_id)
             VALUES (enqueue.idempotency_key, nextval('job_id_seq'))
        ON CONFLICT DO NOTHING
        RETURNING k.job_id INTO new_id;
        IF new_id IS NULL THEN
            -- A new statement takes a new snapshot, so a key committed by a concurrent
            -- enqueue (which ON CONFLICT waited for) is visible here.
            SELECT k.job_id INTO new_id FROM job_keys AS k
             WHERE k.idempotency_key = enqueue.idempotency_key;
            RETURN new_id;
        END IF;
    ELSE
        new_id := nextval('job_id_seq');
    END IF;
    INSERT INTO jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts,
                      fairness_key)
         VALUES (new_id, enqueue.lane, enqueue.handler, enqueue.payload,
                 coalesce(enqueue.priority, 0), coalesce(enqueue.run_at, now()),
                 enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    RETURN new_id;
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
CREATE FUNCTION claim_order(lane text, priorities integer[], run_ats timestamptz[],
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
                                            paused_handlers, key_floors_priority,
                                            key_floors_key, key_floors_run_at, key_floors_id);
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
                                            paused_handlers, key_floors_priority,
                                            key_floors_key, key_floors_run_at, key_floors_id);
            EXIT WHEN cardinality(picked) >= wanted;
        END LOOP;
    END IF;
    RETURN picked;
END
$$;

-- Where a fair claim's scan of one key of a priority starts: the later of the priority's
-- floor and the key's own position (the last job of it the worker took, jobd/claim_floors.py),
-- so that the scan does not walk the dead index entries of the key's jobs claimed before,
-- which vacuum has not removed yet: a herd of one key leaves tens of thousands.
CREATE FUNCTION key_floor(key text, level integer, floor_at timestamptz, floor_id bigint,
                          priorities integer[], keys text[], run_ats timestamptz[],
                          ids bigint[])
RETURNS TABLE (floor_at timestamptz, floor_id bigint)
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN (f.run_at, f.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN f.run_at ELSE key_floor.floor_at END,
           CASE WHEN (f.run_at, f.id) > (key_floor.floor_at, key_floor.floor_id)
                THEN f.id ELSE key_floor.floor_id END
      FROM (SELECT NULL) AS one
      LEFT JOIN unnest(priorities, keys, run_ats, ids) AS f(priority, key, run_at, id)
             ON f.priority = level AND f.key = key_floor.key
     LIMIT 1
$$;

-- The share keys of one priority of a lane that have due jobs with run_at in (after, up_to],
-- in order after from_key and up to to_key (NULL: to the end), at most `wanted`: a skip scan
-- of jobs_fair_idx, one index descent per key (a recursive query stepping from key to key),
-- and one more to see whether the key has a due job. Keys whose jobs are all scheduled for
-- later cost their two descents each time a claim passes them.
CREATE FUNCTION due_keys(lane text, level integer, from_key text, to_key text,
                         floor_at timestamptz, floor_id bigint, after timestamptz,
                         up_to timestamptz, wanted integer, key_floors_priority integer[],
                         key_floors_key text[], key_floors_run_at timestamptz[],
                         key_floors_id bigint[])
RETURNS text[]
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
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
             CROSS JOIN LATERAL key_floor(w.key, level, floor_at, floor_id, key_floors_priority,
                                          key_floors_key, key_floors_run_at, key_floors_id)
                        AS f
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
             LIMIT wanted) AS d
$$;

-- Up to `wanted` due jobs of one priority of a lane with run_at in (after, up_to] and at or
-- above the floor: oldest first, or shared across keys (see claim_order). In a round, each
-- key takes an equal share (the first keys one more, so the shares add up to what is
-- wanted); the keys that filled theirs split what is left in the next round.
CREATE FUNCTION claim_level(lane text, level integer, floor_at timestamptz, floor_id bigint,
                            after timestamptz, up_to timestamptz, fair boolean,
                            key_cursor text, wanted integer, paused_handlers text[],
                            key_floors_priority integer[], key_floors_key text[],
                            key_floors_run_at timestamptz[], key_floors_id bigint[])
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
                     floor_id, after, up_to, wanted, key_floors_priority, key_floors_key,
                     key_floors_run_at, key_floors_id);
    IF cardinality(keys) < wanted AND coalesce(key_cursor, '') <> '' THEN
        keys := keys || due_keys(claim_level.lane, level, '', key_cursor, floor_at, floor_id,
                                 after, up_to, wanted - cardinality(keys), key_floors_priority,
                                 key_floors_key, key_floors_run_at, key_floors_id);
    END IF;
    WHILE cardinality(keys) > 0 AND cardinality(picked) < wanted LOOP
        WITH shares AS (
            SELECT k.key, k.position, (wanted - cardinality(picked)) / cardinality(keys)
                          + CASE WHEN k.position <= (wanted - cardinality(picked))
                                                    % cardinality(keys)
                                 THEN 1 ELSE 0 END AS share,
                   f.floor_at, f.floor_id
              FROM unnest(keys) WITH ORDINALITY AS k(key, position)
             CROSS JOIN LATERAL key_floor(k.key, level, floor_at, floor_id,
                                          key_floors_priority, key_floors_key,
                                          key_floors_run_at, key_floors_id) AS f
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

-- Quarantine and cancel carry the fairness key into the dead-letter queue and the archive.
CREATE OR REPLACE FUNCTION quarantine(handler text, lane text DEFAULT NULL,
                                      payload_match jsonb DEFAULT NULL)
RETURNS TABLE (lane_name text, moved bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    reason text;
BEGIN
    IF quarantine.handler IS NULL THEN
        RAISE EXCEPTION 'jobd.quarantine: handler must not be NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM check_name('jobd.quarantine', 'handler', quarantine.handler);
    PERFORM check_name('jobd.quarantine', 'lane', quarantine.lane);
    reason := 'quarantined: the pending jobs of handler ' || quarantine.handler
              || coalesce(' in lane ' || quarantine.lane, '')
              || coalesce(' whose payload contains ' || quarantine.payload_match::text, '')
              || ' were moved to the dead-letter queue';
    RETURN QUERY
    WITH moved AS (
        DELETE FROM jobs AS j
         WHERE j.handler = quarantine.handler AND j.state IN ('pending', 'failed')
           AND (quarantine.lane IS NULL OR j.lane = quarantine.lane)
           AND (quarantine.payload_match IS NULL OR j.payload @> quarantine.payload_match)
        RETURNING j.*
    ),
    buried AS (
        INSERT INTO dead_letter AS d (id, lane, handler, payload, priority, run_at, attempts,
                                      max_attempts, claimed_by, idempotency_key, created_at,
                                      last_error, errors, died_at, fairness_key)
        SELECT m.id, m.lane, m.handler, m.payload, m.priority, m.run_at, m.attempts,
               m.max_attempts, m.claimed_by, m.idempotency_key, m.created_at, reason,
               m.errors || jsonb_build_object('quarantined_at', now(), 'reason', reason),
               now(), m.fairness_key
          FROM moved AS m
        RETURNING d.lane
    )
    SELECT b.lane, count(*) FROM buried AS b GROUP BY b.lane ORDER BY b.lane;
END
$$;

CREATE OR REPLACE FUNCTION cancel(ids bigint[])
RETURNS TABLE (id bigint, outcome text, state text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    stopped bigint[];
    asked bigint[];
    lanes text[];
BEGIN
    -- Lock the live rows first, in id order, so two cancels never deadlock: a claim passes
    -- them meanwhile (SKIP LOCKED), a worker's write of an outcome waits for this commit.
    PERFORM 1 FROM jobs AS j WHERE j.id = ANY(cancel.ids) ORDER BY j.id FOR UPDATE;
    WITH gone AS (
        DELETE FROM jobs AS j
         WHERE j.id = ANY(cancel.ids) AND j.state IN ('pending', 'failed')
        RETURNING j.*
    ),
    archived AS (
        INSERT INTO jobs_archive AS a (id, lane, handler, payload, state, priority, run_at,
                                       attempts, max_attempts, claimed_by, idempotency_key,
                                       created_at, last_error, errors, finished_at,
                                       claimed_at, fairness_key)
        SELECT g.id, g.lane, g.handler, g.payload, 'cancelled', g.priority, g.run_at,
               g.attempts, g.max_attempts, g.claimed_by, g.idempotency_key, g.created_at,
               g.last_error, g.errors || jsonb_build_object('cancelled_at', now()), now(),
               g.claimed_at, g.fairness_key
          FROM gone AS g
        RETURNING a.id
    )
    SELECT coalesce(array_agg(archived.id), '{}') INTO stopped FROM archived;
    WITH requested AS (
        UPDATE jobs AS j SET cancel_requested_at = coalesce(j.cancel_requested_at, now())
         WHERE j.id = ANY(cancel.ids) AND j.state = 'claimed'
        RETURNING j.id, j.lane
    )
    SELECT coalesce(array_agg(r.id), '{}'), coalesce(array_agg(DISTINCT r.lane), '{}')
      INTO asked, lanes FROM requested AS r;
    PERFORM pg_notify(current_schema() || '_wakeup', l.lane || '!cancel')
       FROM unnest(lanes) AS l(lane);
    RETURN QUERY
    SELECT i.id,
           CASE WHEN i.id = ANY(stopped) THEN 'cancelled'
                WHEN i.id = ANY(asked) THEN 'requested'
                WHEN now_state.state IS NULL THEN 'unknown'
                ELSE 'finished' END,
           CASE WHEN i.id = ANY(stopped) THEN 'cancelled'
                WHEN i.id = ANY(asked) THEN 'claimed'
                ELSE now_state.state END
      FROM (SELECT DISTINCT u.id FROM unnest(cancel.ids) AS u(id) WHERE u.id IS NOT NULL) AS i
      LEFT JOIN LATERAL (
            SELECT a.state FROM jobs_archive AS a WHERE a.id = i.id
            UNION ALL
            SELECT 'dead' FROM dead_letter AS d WHERE d.id = i.id
            LIMIT 1) AS now_state ON true
     ORDER BY i.id;
END
$$;

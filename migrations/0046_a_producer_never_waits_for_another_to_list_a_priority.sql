-- One producer's open transaction stalled every other producer of the same lane and priority.
-- The first enqueue of a (lane, priority) pair that lane_priorities does not hold (a new lane
-- or priority, or one the retention duty forgot while the lane was empty) inserts the pair;
-- until its transaction ends, every other enqueue of that pair waited in the INSERT ... ON
-- CONFLICT DO NOTHING for the uncommitted row (a slow web request or a backfill that enqueued
-- first held up every producer of the pair: all three entry points were cancelled after a
-- 3 s statement_timeout).
--
-- Now every writer of a pair holds the pair's advisory lock until it ends, taken without
-- waiting and only when the pair is not visible (a known pair, the common path, costs nothing
-- more). With the lock no other transaction is inserting the pair, so the insert cannot wait.
-- Without it another one is, and has not ended: the enqueue does not wait but records the
-- pair in lane_priorities_wanted, since that other transaction may roll back and leave this
-- job's pair missing (no claim would ever see the job). The lane poll merges what is wanted
-- into lane_priorities (merge_wanted_priorities), and the retention duty keeps a pair that
-- is still wanted.

-- Pairs an enqueue needed while another transaction was inserting them. No unique
-- constraint: a unique row would make a second writer wait for the first, as before. Logged:
-- the job whose pair it keeps is durable.
CREATE TABLE lane_priorities_wanted (
    lane     text    NOT NULL,
    priority integer NOT NULL
);
CREATE INDEX lane_priorities_wanted_idx ON lane_priorities_wanted (lane, priority);

-- enqueue: the pair's lock before its insert, or the pair recorded as wanted.
CREATE OR REPLACE FUNCTION enqueue(
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
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    new_id      bigint;
    due_at      timestamptz := coalesce(enqueue.run_at, now());
    level       integer     := coalesce(enqueue.priority, 0);
    lane_state  record;
BEGIN
    PERFORM check_job(enqueue.handler, enqueue.lane, enqueue.payload, enqueue.run_at,
                      enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    -- The lane's shared wake-up lock, held until commit, before the one read below: as in
    -- notify_new_jobs, a worker arming meanwhile sees this enqueue as 'contended', and the
    -- read's snapshot sees every arming committed before the lock was granted; the retention
    -- duty cannot forget the job's priority under it. The key is wake_lock_key(lane), written
    -- out as in notify_new_jobs: calling a function that sets search_path costs (0019).
    PERFORM pg_advisory_xact_lock_shared(
        hashtextextended(current_schema() || '.' || enqueue.lane, 0));
    SELECT (SELECT s.value::bigint FROM settings AS s
             WHERE s.name = 'max_payload_bytes') AS max_payload_bytes,
           EXISTS (SELECT 1 FROM lane_priorities AS p
                    WHERE p.lane = enqueue.lane AND p.priority = level) AS priority_known,
           EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = enqueue.lane) AS waited
      INTO lane_state;
    IF octet_length(enqueue.payload::text) > lane_state.max_payload_bytes THEN
        PERFORM check_payload_size(octet_length(enqueue.payload::text));  -- raises
    END IF;
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
    -- The insert trigger steps aside for this one statement (jobs_notify_insert's WHEN); the
    -- setting is cleared again before anything else can insert.
    PERFORM set_config('jobd.enqueue_announces', 'on', true);
    INSERT INTO jobs (id, lane, handler, payload, priority, run_at, idempotency_key, max_attempts,
                      fairness_key)
         VALUES (new_id, enqueue.lane, enqueue.handler, enqueue.payload, level, due_at,
                 enqueue.idempotency_key, enqueue.max_attempts, enqueue.fairness_key);
    PERFORM set_config('jobd.enqueue_announces', '', true);
    -- Outside READ COMMITTED the transaction's snapshot may predate the retention duty's
    -- forgetting of the priority (forget_unused_priorities): seen in the snapshot, gone from
    -- the table, and every claim, arming and poll, which read the lane's priorities there,
    -- would never see the job. Recorded whatever the snapshot says, as the insert trigger does.
    -- Every writer of a pair holds the pair's lock until it ends, so with the lock the insert
    -- cannot wait for another's uncommitted row. Without it another transaction is inserting
    -- the pair: waiting for it stalled this producer as long as that one stayed open, and it
    -- may still roll back, so the pair is recorded as wanted for the lane poll to merge
    -- (merge_wanted_priorities). The key is the pair's, written out as the lane's above.
    IF NOT lane_state.priority_known
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        IF pg_try_advisory_xact_lock(
               hashtextextended(current_schema() || '.' || enqueue.lane || '#' || level, 0)) THEN
            INSERT INTO lane_priorities (lane, priority) VALUES (enqueue.lane, level)
                ON CONFLICT DO NOTHING;
        ELSE
            -- A wanted row already committed covers this job too (while a long transaction
            -- lists the pair, one row, not one per enqueue): the merge deletes it only in the
            -- transaction that lists the pair, and the retention duty cannot forget the pair
            -- under the lane's shared lock. Not outside READ COMMITTED, where the snapshot
            -- may show a row merged, and its pair forgotten, since.
            INSERT INTO lane_priorities_wanted (lane, priority)
            SELECT enqueue.lane, level
             WHERE current_setting('transaction_isolation') <> 'read committed'
                OR NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                                WHERE w.lane = enqueue.lane AND w.priority = level);
        END IF;
    END IF;
    -- The notifications notify_new_jobs sends for a statement of one job.
    IF due_at > now() THEN
        PERFORM pg_notify(current_schema() || '_wakeup',
                          enqueue.lane || '@' || extract(epoch FROM due_at)::text);
    ELSIF lane_state.waited
          OR current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pg_notify(current_schema() || '_wakeup', enqueue.lane || '#1');
        IF due_at < clock_timestamp() - interval '0.5 seconds' THEN
            PERFORM pg_notify(current_schema() || '_wakeup', enqueue.lane || '!behind');
        END IF;
    END IF;
    RETURN new_id;
END
$$;

-- The insert trigger: the same, for each priority of the statement's lane not listed yet.
CREATE OR REPLACE FUNCTION notify_new_jobs() RETURNS trigger LANGUAGE plpgsql
-- It reads jobd's tables: whatever search_path the enqueuing session has (a caller's COPY).
SET search_path FROM CURRENT
AS $$
DECLARE
    entry record;
    level integer;
    -- Outside READ COMMITTED the transaction's snapshot may predate a worker's arming, so
    -- reading lane_waiters proves nothing: notify as before.
    always boolean := current_setting('transaction_isolation') <> 'read committed';
BEGIN
    FOR entry IN SELECT lane, min(run_at) AS first_run_at,
                        count(*) FILTER (WHERE run_at <= now()) AS due,
                        min(run_at) FILTER (WHERE run_at <= now()) AS first_due
                   FROM new_jobs GROUP BY lane
    LOOP
        -- Held until commit. A worker arming meanwhile sees this enqueue as 'contended' and
        -- claims again instead of sleeping (arm_waiter); the retention duty's clean-up of
        -- lane_priorities skips the lane. The next statements' snapshots see every arming
        -- committed before the lock was granted.
        -- wake_lock_key(entry.lane), computed here: a call of a function that sets
        -- search_path cost every single-job enqueue about a tenth of its rate.
        PERFORM pg_advisory_xact_lock_shared(
            hashtextextended(TG_TABLE_SCHEMA || '.' || entry.lane, 0));
        -- Each of the statement's priorities not listed yet (any, outside READ COMMITTED:
        -- the snapshot may predate the retention duty's forgetting of one), as in enqueue:
        -- with the pair's lock inserted, without it (another transaction is inserting the
        -- pair and has not ended) recorded as wanted, never waited for.
        FOR level IN SELECT DISTINCT n.priority FROM new_jobs AS n
                      WHERE n.lane = entry.lane
                        AND (always OR NOT EXISTS (
                                 SELECT 1 FROM lane_priorities AS p
                                  WHERE p.lane = entry.lane AND p.priority = n.priority))
        LOOP
            IF pg_try_advisory_xact_lock(
                   hashtextextended(TG_TABLE_SCHEMA || '.' || entry.lane || '#' || level, 0)) THEN
                INSERT INTO lane_priorities (lane, priority) VALUES (entry.lane, level)
                    ON CONFLICT DO NOTHING;
            ELSE
                -- Unless a committed wanted row covers it already, as in enqueue.
                INSERT INTO lane_priorities_wanted (lane, priority)
                SELECT entry.lane, level
                 WHERE always
                    OR NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                                    WHERE w.lane = entry.lane AND w.priority = level);
            END IF;
        END LOOP;
        IF entry.due = 0 THEN
            -- Work for later: the supervisors set a timer for it.
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup',
                              entry.lane || '@' || extract(epoch FROM entry.first_run_at)::text);
        ELSIF always OR EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = entry.lane) THEN
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup', entry.lane || '#' || entry.due);
            -- Due since before the claim floors' margin (jobd.claim_floors.CAUGHT_UP_MARGIN):
            -- the jobs may sit below the waiting workers' floors, where a claim from the
            -- floors would not see them for up to a second (a herd enqueued due in the
            -- past, a transaction that began long before it enqueued). 'behind' tells the
            -- lane's workers to claim from the head.
            IF entry.first_due < clock_timestamp() - interval '0.5 seconds' THEN
                PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup', entry.lane || '!behind');
            END IF;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- The retention duty keeps a pair that is still wanted.
CREATE OR REPLACE FUNCTION forget_unused_priorities(lane text) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    forgotten integer;
BEGIN
    IF NOT pg_try_advisory_xact_lock(wake_lock_key(forget_unused_priorities.lane)) THEN
        RETURN 0;
    END IF;
    DELETE FROM lane_priorities AS p
     WHERE p.lane = forget_unused_priorities.lane
       -- Claimable jobs through the claim index, claimed ones (which a release or an expired
       -- lease makes claimable again) through the lease index.
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.lane = p.lane AND j.priority = p.priority
                          AND j.state IN ('pending', 'failed'))
       AND NOT EXISTS (SELECT 1 FROM jobs AS j
                        WHERE j.state = 'claimed' AND j.lease_until IS NOT NULL
                          AND j.lane = p.lane AND j.priority = p.priority)
       -- Wanted by an enqueue that met the pair being inserted: kept until the merge has
       -- seen to it (merge_wanted_priorities).
       AND NOT EXISTS (SELECT 1 FROM lane_priorities_wanted AS w
                        WHERE w.lane = p.lane AND w.priority = p.priority);
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$$;

-- The lane poll's merge (jobd/duties/lane_poll.py): each wanted pair whose lock is free goes
-- into lane_priorities, and its wanted rows go. A pair whose lock is held is left for the next
-- turn: the transaction holding it is inserting the pair, and if it commits the rows only
-- cost a turn; if it rolls back, the merge lists the pair for the jobs that wanted it.
CREATE FUNCTION merge_wanted_priorities() RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    pair   record;
    merged integer := 0;
BEGIN
    FOR pair IN SELECT DISTINCT w.lane, w.priority FROM lane_priorities_wanted AS w LOOP
        -- Held: a transaction is inserting the pair (or another node merges it) and has not
        -- ended. Its end decides; the rows wait for the next turn, and nothing waits here.
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(
            hashtextextended(current_schema() || '.' || pair.lane || '#' || pair.priority, 0));
        INSERT INTO lane_priorities (lane, priority) VALUES (pair.lane, pair.priority)
            ON CONFLICT DO NOTHING;
        -- The rows committed by now: one committed later waits for the next turn.
        DELETE FROM lane_priorities_wanted AS w
         WHERE w.lane = pair.lane AND w.priority = pair.priority;
        merged := merged + 1;
    END LOOP;
    RETURN merged;
END
$$;

DO $$
DECLARE
    fn text;
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    FOREACH fn IN ARRAY ARRAY['enqueue(text, jsonb, text, timestamptz, integer, text, integer, text)',
                              'notify_new_jobs()', 'forget_unused_priorities(text)',
                              'merge_wanted_priorities()']
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', fn, current_schema());
    END LOOP;
END
$$;

-- jobd.enqueue records the job's (lane, priority) in lane_priorities only when its read says
-- the pair is unknown. From a REPEATABLE READ or SERIALIZABLE producer that read uses the
-- transaction's snapshot, which may predate the retention duty's forgetting of the pair
-- (forget_unused_priorities, hourly, for priorities without jobs): the pair is seen, not
-- recorded, and gone; every claim, arming probe and poll reads the lane's priorities there,
-- so the job was never claimed until another enqueue of that lane and priority. Outside READ
-- COMMITTED the pair is now recorded whatever the snapshot says (ON CONFLICT DO NOTHING), as
-- the insert trigger always does.
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
    IF NOT lane_state.priority_known
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        INSERT INTO lane_priorities (lane, priority) VALUES (enqueue.lane, level)
            ON CONFLICT DO NOTHING;
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION enqueue(text, jsonb, text, timestamptz, integer, text, '
                   'integer, text) SET search_path = %I, pg_temp', current_schema());
END
$$;

-- Single-job enqueue announces its own job (migration 0021). The insert trigger, written for
-- statements of any size, cost one jobd.enqueue call more than the insert itself: a trigger
-- function with its own search_path, a transition table, a grouping query over it and a
-- statement per step. For its one row, enqueue now takes the lane's lock, reads what it
-- needs in one statement and notifies; the trigger steps aside for the row it inserts (the
-- WHEN below) and still announces every other insert (the bulk COPY, a caller's INSERT).
-- The lane name rule, the same set of names, is matched without a bounded repetition, whose
-- automaton made each match cost microseconds; the length is checked apart.

CREATE OR REPLACE FUNCTION check_name(caller text, what text, value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    name_chars constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]*$';
BEGIN
    IF check_name.value IS NOT NULL AND (check_name.value !~ name_chars
                                         OR octet_length(check_name.value) > 128) THEN
        RAISE EXCEPTION '%: invalid % name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            check_name.caller, check_name.what, quote_literal(check_name.value)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION check_job(
    handler text, lane text, payload jsonb, run_at timestamptz, idempotency_key text,
    max_attempts integer, fairness_key text DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    name_chars constant text := '^[A-Za-z0-9][A-Za-z0-9_.:-]*$';
BEGIN
    IF check_job.handler IS NULL OR check_job.handler !~ name_chars
       OR octet_length(check_job.handler) > 128 THEN
        RAISE EXCEPTION 'jobd.enqueue: invalid handler name %: use 1-128 letters, digits and _ . : - (starting with a letter or digit)',
            coalesce(quote_literal(check_job.handler), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF check_job.lane IS NULL OR check_job.lane !~ name_chars
       OR octet_length(check_job.lane) > 128 THEN
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
    IF NOT lane_state.priority_known THEN
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
    EXECUTE format('ALTER FUNCTION check_name(text, text, text) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

-- Every insert but jobd.enqueue's own, which announces itself. A trigger inside that insert
-- (pg_trigger_depth() > 0: a caller's trigger on jobs that inserts more jobs) is announced
-- here as before.
DROP TRIGGER jobs_notify_insert ON jobs;
CREATE TRIGGER jobs_notify_insert AFTER INSERT ON jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT
    WHEN (pg_trigger_depth() > 0
          OR current_setting('jobd.enqueue_announces', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION notify_new_jobs();

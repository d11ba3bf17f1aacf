-- The contenders of bench/enqueue_parts.py: single-job enqueue built up from a bare INSERT, one
-- part at a time, so that what each part of jobd.enqueue costs the server can be read off.
-- Run in a scratch database migrated by `jobd migrate` (schema jobd). The functions are
-- owned by the migrating role and run as it (SECURITY DEFINER, a pinned search_path), as
-- jobd.enqueue does for a producer role (least privilege, migration 0014).
CREATE SCHEMA enqueue_parts;

-- jobd.jobs's columns, defaults, checks and indexes; no trigger, so nothing announced.
CREATE TABLE enqueue_parts.bare_jobs (LIKE jobd.jobs INCLUDING ALL);

-- The same, with a statement trigger that collects the inserted rows (a transition table, as
-- jobd.jobs's insert trigger has) and whose WHEN never holds: what the collecting costs an
-- insert that the trigger steps aside for.
CREATE TABLE enqueue_parts.collected_jobs (LIKE jobd.jobs INCLUDING ALL);
CREATE FUNCTION enqueue_parts.never_fires() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END
$$;
CREATE TRIGGER collected_jobs_insert AFTER INSERT ON enqueue_parts.collected_jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT
    WHEN (pg_trigger_depth() > 1000)
    EXECUTE FUNCTION enqueue_parts.never_fires();

-- The insert from a PL/pgSQL function run with the caller's rights (what a function call
-- costs), and the same body with least privilege (SECURITY DEFINER, a pinned search_path),
-- still into the trigger-less copy: one body for both, so only the options differ.
DO $do$
DECLARE
    body constant text := $body$
DECLARE
    new_id bigint;
BEGIN
    INSERT INTO enqueue_parts.bare_jobs AS j (handler, payload, lane)
         VALUES ($1, $2, $3)
    RETURNING j.id INTO new_id;
    RETURN new_id;
END
$body$;
    signature constant text := '(handler text, payload jsonb, lane text) RETURNS bigint '
                               'LANGUAGE plpgsql';
BEGIN
    EXECUTE format('CREATE FUNCTION enqueue_parts.plain_function%s AS %L', signature, body);
    EXECUTE format('CREATE FUNCTION enqueue_parts.least_privilege%s SECURITY DEFINER '
                   'SET search_path TO enqueue_parts, pg_temp AS %L', signature, body);
END
$do$;

-- The least a least-privilege enqueue does: insert into jobd.jobs, the insert trigger
-- stepping aside as it does for jobd.enqueue (which announces its own job).
CREATE FUNCTION enqueue_parts.insert_only(handler text, payload jsonb, lane text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'jobd', 'pg_temp'
AS $$
DECLARE
    new_id bigint;
BEGIN
    PERFORM set_config('jobd.enqueue_announces', 'on', true);
    INSERT INTO jobs AS j (lane, handler, payload)
         VALUES (insert_only.lane, insert_only.handler, insert_only.payload)
    RETURNING j.id INTO new_id;
    PERFORM set_config('jobd.enqueue_announces', '', true);
    RETURN new_id;
END
$$;

-- That plus the wake-up protocol's core: the lane's shared wake-up lock before a snapshot
-- that reads whether a worker waits (lane_waiters), and a notification only then. No entry
-- rules, no payload limit, no priority bookkeeping: less than jobd.enqueue must do.
CREATE FUNCTION enqueue_parts.wake_core(handler text, payload jsonb, lane text)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path TO 'jobd', 'pg_temp'
AS $$
DECLARE
    job record;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(
        hashtextextended(current_schema() || '.' || wake_core.lane, 0));
    PERFORM set_config('jobd.enqueue_announces', 'on', true);
    -- The insert's snapshot is taken after the lock was granted (a new statement).
    INSERT INTO jobs AS j (lane, handler, payload)
         VALUES (wake_core.lane, wake_core.handler, wake_core.payload)
    RETURNING j.id, EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = j.lane) AS waited
         INTO job;
    PERFORM set_config('jobd.enqueue_announces', '', true);
    IF job.waited THEN
        PERFORM pg_notify(current_schema() || '_wakeup', wake_core.lane || '#1');
    END IF;
    RETURN job.id;
END
$$;

-- Single-job enqueue, cheaper: each call of a function that sets its own search_path costs a
-- switch and a switch back, and one enqueue made four. check_job runs on enqueue's pinned
-- path (its only caller), and the insert trigger computes the lane's lock key itself
-- instead of calling wake_lock_key (the same value: the trigger's schema is jobd's).
ALTER FUNCTION check_job(text, text, jsonb, timestamptz, text, integer, text) RESET search_path;

CREATE OR REPLACE FUNCTION notify_new_jobs() RETURNS trigger LANGUAGE plpgsql
-- It reads jobd's tables: whatever search_path the enqueuing session has (a caller's COPY).
SET search_path FROM CURRENT
AS $$
DECLARE
    entry record;
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
        INSERT INTO lane_priorities (lane, priority)
        SELECT DISTINCT entry.lane, n.priority FROM new_jobs AS n WHERE n.lane = entry.lane
            ON CONFLICT DO NOTHING;
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION notify_new_jobs() SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

-- Work for later enqueued beside due work got no timer. The insert trigger sent 'lane@t' (the
-- supervisors wake the lane at t) only for a statement whose jobs were all for later; one that
-- also held due jobs (enqueue_many, a COPY, a caller's INSERT of several rows) sent 'lane#n'
-- for those, and only while a worker was armed. Its jobs for later then waited for the lane
-- poll past their run_at: up to poll_interval (5 s by default; a minute where it is set so).
-- Now a statement with jobs for later always announces the earliest of them, and its due
-- jobs as before. jobd.enqueue (one job: due or for later) is unchanged.

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
    FOR entry IN SELECT lane, count(*) FILTER (WHERE run_at <= now()) AS due,
                        min(run_at) FILTER (WHERE run_at <= now()) AS first_due,
                        min(run_at) FILTER (WHERE run_at > now()) AS first_later
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
        IF entry.due > 0
           AND (always OR EXISTS (SELECT 1 FROM lane_waiters AS w WHERE w.lane = entry.lane)) THEN
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
        IF entry.first_later IS NOT NULL THEN
            -- Work for later, beside due work or not: the supervisors set a timer for it.
            PERFORM pg_notify(TG_TABLE_SCHEMA || '_wakeup',
                              entry.lane || '@' || extract(epoch FROM entry.first_later)::text);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION notify_new_jobs() SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

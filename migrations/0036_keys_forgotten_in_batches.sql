-- Retention forgot the idempotency keys of old jobs in the same statement that dropped the
-- archive's old partitions: one unbounded DELETE, under the supervisor's statement_timeout,
-- holding the dropped partitions' ACCESS EXCLUSIVE lock on jobs_archive (every completion
-- waits for it) until it finished. A backlog of keys larger than the timeout allows (after
-- archive.retention was shortened, or a long outage) made every hourly run fail and roll the
-- drops back with it: retention stopped for good. drop_archive_partitions now drops
-- partitions only; the keys are forgotten apart, in bounded batches that each commit
-- (prune_job_keys in jobd/sql/queries.sql).
--
-- A daemon of the previous release calling this function no longer forgets keys: a fleet
-- forgets them once one node runs this release.
CREATE OR REPLACE FUNCTION drop_archive_partitions(cutoff timestamptz) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    part    record;
    dropped integer := 0;
    saved_lock_timeout text := current_setting('lock_timeout');
BEGIN
    FOR part IN
        SELECT c.relname,
               (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz
                   AS upper_bound
          FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'jobs_archive'::regclass
           AND c.relname <> 'jobs_archive_default'
    LOOP
        CONTINUE WHEN part.upper_bound > cutoff;
        -- Dropping a partition needs ACCESS EXCLUSIVE on jobs_archive. Queued behind a long
        -- reader, that request would block every completion; give up after a second instead
        -- and let the next maintenance run try again.
        BEGIN
            PERFORM set_config('lock_timeout', '1s', true);
            EXECUTE format('DROP TABLE %I', part.relname);
            dropped := dropped + 1;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'jobd: archive partition % is in use; retention will retry', part.relname;
        END;
    END LOOP;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    DELETE FROM jobs_archive_default WHERE finished_at < cutoff;
    RETURN dropped;
END
$$;

DO $$
BEGIN
    -- As migrations 0014 set it: the owner's rights (the runtime role has no DDL), and the
    -- schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION drop_archive_partitions(timestamptz) '
                   'SET search_path = %I, pg_temp', current_schema());
    ALTER FUNCTION drop_archive_partitions(timestamptz) SECURITY DEFINER;
END
$$;

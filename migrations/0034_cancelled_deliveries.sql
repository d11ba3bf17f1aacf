-- Cancelling an outbox delivery job (jobd jobs cancel, jobd.cancel()) archived it as
-- cancelled and left its outbox entry 'pending' for good: never delivered, never marked dead,
-- and neither replay nor a rerun of the source job (its key exists) could deliver it. The
-- entry of a delivery cancelled before it delivered is now marked 'dead' ("cancelled before
-- delivery"): here for the pending and failed ones cancel() archives at once, and in
-- fail_jobs (jobd/sql/queries.sql) for a running one whose run ends without delivering.
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
    -- A delivery job cancelled before it delivered: its entry will not be delivered.
    UPDATE outbox AS o SET state = 'dead', last_error = 'cancelled before delivery'
     WHERE o.delivery_job_id = ANY(stopped) AND o.state = 'pending';
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

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION cancel(bigint[]) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

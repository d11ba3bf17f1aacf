-- A job enqueued with a run_at in the past (a replayed event keeping its own timestamp, a
-- job back-dated to go first) has waited since it was enqueued, not since its run_at: the
-- oldest-wait gauge (jobd_oldest_unclaimed_age_seconds), the pickup histogram and the
-- pickup percentiles counted from run_at, so one such job read as days late and fired the
-- stale-queue and SLO alerts. They now count from greatest(run_at, created_at).
--
-- lane_waiting_since is lane_head's probe with that rule: for each priority of the lane,
-- the job at the head of jobs_claimable_idx and one heap fetch for its created_at. It is
-- the head's wait, not a scan of every due job: behind a back-dated head, a job due
-- earlier than the head was enqueued can have waited longer, and shows once the head is
-- claimed. lane_head itself is unchanged: wake-ups and timers follow run_at.
CREATE FUNCTION lane_waiting_since(lane text) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT min(first.waiting_since)
      FROM lane_priorities AS p
     CROSS JOIN LATERAL (
           SELECT greatest(j.run_at, j.created_at) AS waiting_since FROM jobs AS j
            WHERE j.lane = p.lane AND j.state IN ('pending', 'failed') AND j.priority = p.priority
            ORDER BY j.run_at LIMIT 1) AS first
     WHERE p.lane = lane_waiting_since.lane
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION lane_waiting_since(text) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

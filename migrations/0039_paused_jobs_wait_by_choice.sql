-- jobd_oldest_unclaimed_age_seconds (lane_waiting_since) counted the jobs an operator had
-- paused: with the poison handler paused, as the incident runbook says, the gauge grew with
-- the paused jobs' wait and JobdPickupSLOBreached (critical) fired and stayed firing while the
-- lane served everything else in milliseconds. Paused jobs (the whole lane, or their handler)
-- are left out now; jobd_lane_paused and jobd_queue_depth still show them.
CREATE OR REPLACE FUNCTION lane_waiting_since(lane text) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    -- Jobs an operator paused (the lane, or their handler) wait by choice: left out, so that
    -- the pickup SLO shows whether the lane does the rest of its work (migration 0039).
    SELECT min(first.waiting_since)
      FROM lane_priorities AS p
     CROSS JOIN (SELECT coalesce(bool_or(lp.handler IS NULL), false) AS whole_lane,
                        coalesce(array_agg(lp.handler) FILTER (WHERE lp.handler IS NOT NULL),
                                 '{}') AS handlers
                   FROM lane_pauses AS lp
                  WHERE lp.lane = lane_waiting_since.lane) AS paused
     CROSS JOIN LATERAL (
           SELECT greatest(j.run_at, j.created_at) AS waiting_since FROM jobs AS j
            WHERE j.lane = p.lane AND j.state IN ('pending', 'failed') AND j.priority = p.priority
              AND (cardinality(paused.handlers) = 0 OR runnable(j.handler, paused.handlers))
            ORDER BY j.run_at LIMIT 1) AS first
     WHERE p.lane = lane_waiting_since.lane AND NOT paused.whole_lane
$$;

DO $$
BEGIN
    -- As migration 0014 pinned every function's search_path: the schema, then pg_temp.
    EXECUTE format('ALTER FUNCTION lane_waiting_since(text) SET search_path = %I, pg_temp',
                   current_schema());
END
$$;

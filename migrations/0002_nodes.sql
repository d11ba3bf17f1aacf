-- Live supervisors: each writes its row every duty tick, so `jobd status` can show live
-- workers per node and claim/failure rates without asking the nodes themselves.

-- The earliest run_at of a lane's claimable jobs, due or not: one index probe per distinct
-- priority (a loose scan of jobs_claimable_idx, like the claim), so it stays cheap however
-- many jobs wait. The supervisor's fallback poll asks it for every lane in one statement.
CREATE FUNCTION lane_head(lane text) RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
DECLARE
    level     integer;
    first_due timestamptz;
    earliest  timestamptz;
BEGIN
    SELECT j.priority INTO level FROM jobs AS j
     WHERE j.lane = lane_head.lane AND j.state IN ('pending', 'failed')
     ORDER BY j.priority DESC LIMIT 1;
    WHILE level IS NOT NULL LOOP
        SELECT j.run_at INTO first_due FROM jobs AS j
         WHERE j.lane = lane_head.lane AND j.state IN ('pending', 'failed')
           AND j.priority = level
         ORDER BY j.run_at LIMIT 1;
        earliest := least(earliest, first_due);
        -- SELECT INTO with no row sets level to NULL, which ends the loop.
        SELECT j.priority INTO level FROM jobs AS j
         WHERE j.lane = lane_head.lane AND j.state IN ('pending', 'failed')
           AND j.priority < level
         ORDER BY j.priority DESC LIMIT 1;
    END LOOP;
    RETURN earliest;
END
$$;

CREATE TABLE nodes (
    instance        text        PRIMARY KEY,      -- node name, pid and a random suffix
    node            text        NOT NULL,
    pid             integer     NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    seen_at         timestamptz NOT NULL DEFAULT now(),
    -- {"lane": number of live workers}
    workers         jsonb       NOT NULL DEFAULT '{}',
    -- {"lane": {"claimed": n, "completed": n, "failed": n, "dead": n}}, totals since start;
    -- the previous sample is kept so rates need only this row.
    counters        jsonb       NOT NULL DEFAULT '{}',
    prev_counters   jsonb       NOT NULL DEFAULT '{}',
    prev_seen_at    timestamptz
);

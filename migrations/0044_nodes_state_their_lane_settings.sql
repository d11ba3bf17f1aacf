-- Nodes that serve one lane each apply their own config's settings of it to the jobs they
-- claim: with max_attempts 6 on one node and 2 on another, a lane's failing job died after
-- two attempts or six depending on which node took it, a 3s timeout on one node failed jobs
-- the other ran to the end, and nothing said the configs disagreed. Nodes now state the
-- settings of their lanes that decide a job's fate or the fleet's limits in their heartbeat,
-- so `jobd status` and every node's log name a disagreement. NULL: a daemon of an earlier
-- release, which does not say.
ALTER TABLE nodes ADD COLUMN lane_settings jsonb;

-- The metrics sampler's per-lane counts, shared by the fleet. Every node exports the same
-- queue gauges, and each counted them itself: with a backlog, a fleet of n nodes read the
-- backlog's index entries n times per sampling interval. A node now uses the counts another
-- node took within the interval, and counts (and stores) only when they are older or
-- missing. UNLOGGED: a cache of what can be counted again, so its writes cost no WAL, and
-- after a crash of the server it is empty, which only means the next sample counts.
CREATE UNLOGGED TABLE queue_samples (
    lane                 text        PRIMARY KEY,
    due                  bigint      NOT NULL,
    scheduled            bigint      NOT NULL,
    retrying             bigint      NOT NULL,
    claimed              bigint      NOT NULL,
    dead                 bigint      NOT NULL,
    oldest_unclaimed_age float8      NOT NULL,
    taken_at             timestamptz NOT NULL
);

-- When each job's latest attempt was claimed. With run_at (when the job became due) and
-- finished_at (when it was done) it gives every finished job's pickup delay (claimed_at -
-- run_at) and its time from claim to finish (finished_at - claimed_at), which `jobd top`
-- reports per lane from the database alone. NULL for jobs claimed before this migration.
ALTER TABLE jobs ADD COLUMN claimed_at timestamptz;
ALTER TABLE jobs_archive ADD COLUMN claimed_at timestamptz;

-- The jobs of one lane that finished recently, newest first: a short backward range scan in
-- the partitions a recent window touches, never a scan of the archive. Jobs completed in one
-- batch share finished_at, so B-tree deduplication keeps the entries small. On a large
-- archive, build it per partition with CREATE INDEX CONCURRENTLY before migrating
-- (docs/design/queue.md): this statement then attaches those indexes instead of building
-- them while completions wait.
CREATE INDEX jobs_archive_lane_finished_idx ON jobs_archive (lane, finished_at);

-- Queue-state metrics (jobd_queue_depth{state="retrying"}): jobs that failed and wait for
-- their retry, counted per lane from an index alone. jobs_claimable_idx holds pending and
-- failed rows together and has no state column, so without this index telling them apart
-- would visit the heap of every job scheduled for later. Only failed rows are indexed: the
-- claim, the heartbeat and completion of a job that never failed do not write to it.
CREATE INDEX jobs_retrying_idx ON jobs (lane, run_at) WHERE state = 'failed';

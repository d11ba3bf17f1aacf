-- Poison isolation. When a worker process dies while it runs several jobs, nothing says which
-- one killed it. Its jobs become suspects: their attempt is given back, and each runs alone on
-- a worker that holds nothing else. A worker that dies holding a single job has found the
-- poison: that job alone spends an attempt (and stays a suspect, so its retries run alone).
ALTER TABLE jobs ADD COLUMN suspect boolean NOT NULL DEFAULT false;

-- Suspects are rare; a lane's suspects, due or claimed, are found without touching the claim
-- index.
CREATE INDEX jobs_suspect_idx ON jobs (lane, run_at) WHERE suspect;

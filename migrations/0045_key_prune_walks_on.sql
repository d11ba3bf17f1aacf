-- The retention pass's prune of idempotency keys (prune_job_keys) found each batch by reading
-- and sorting every key past the cutoff, with a hash anti-join over jobs and dead_letter: a
-- batch of 10,000 cost as much as the whole backlog (623,000 expired keys: 0.3 to 0.5 s and
-- 20 MB spilled to disk, for each batch). Ordering by created_at made it worse, since the
-- keys that must be kept (dead-lettered and still-live jobs') sit at the head of that order
-- and every batch walked past them again. Now a sweep walks the expired keys in
-- (created_at, idempotency_key) order, a batch at a time, probing jobs and dead_letter per
-- key, and key_sweep keeps where it stands between batches, passes, restarts and nodes; at
-- the cutoff it starts again from the head, so a key passed over because its job was live
-- is looked at again by the next sweep.
-- Where the current sweep stands: the last key it examined; NULL, at the head.
CREATE TABLE key_sweep (
    only_row        boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    created_at      timestamptz,
    idempotency_key text
);
INSERT INTO key_sweep DEFAULT VALUES;

-- The sweep's order, so a batch starts at its position in the index. Built anew and swapped
-- in under the old name (a copy built by hand CONCURRENTLY beforehand, as docs/upgrades.md
-- suggests, is taken); the old index served only this prune.
CREATE INDEX IF NOT EXISTS job_keys_created_at_idx_0045 ON job_keys (created_at, idempotency_key);
DROP INDEX job_keys_created_at_idx;
ALTER INDEX job_keys_created_at_idx_0045 RENAME TO job_keys_created_at_idx;

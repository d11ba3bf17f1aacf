-- jobs_fair_idx serves the fair claims only. It had the claim index's predicate, so the
-- planner could answer a claim from the floors in a lane without fair_by from it too, at the
-- same estimated cost while the table is small; but there the share key comes before run_at,
-- so a floor bounds nothing and the scan walks every entry of the priority, the dead ones a
-- held xmin horizon keeps included. A prepared claim planned that way stayed so (0023 fixed
-- the arming probe's case alone). The predicate now also requires the share key to be
-- non-NULL: true of every row (handler is NOT NULL), and implied by the fair queries' own
-- comparisons on the key (due_keys, claim_level), but by no other query, so none can be
-- planned on this index. The same entries; built anew and swapped in under the old name (a
-- copy built by hand CONCURRENTLY beforehand, as docs/upgrades.md suggests, is taken).
CREATE INDEX IF NOT EXISTS jobs_fair_idx_0025
    ON jobs (lane, priority DESC, (coalesce(fairness_key, handler) COLLATE "C"), run_at, id)
    WHERE state IN ('pending', 'failed')
      AND (coalesce(fairness_key, handler) COLLATE "C") IS NOT NULL;
DROP INDEX jobs_fair_idx;
ALTER INDEX jobs_fair_idx_0025 RENAME TO jobs_fair_idx;

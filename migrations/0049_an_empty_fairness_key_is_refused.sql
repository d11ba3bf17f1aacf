-- A job whose fairness_key was the empty string was never claimed in a fair lane (fair_by):
-- a fair claim lists a priority's share keys after its worker's cursor, or after '' when it
-- starts from the first key (claim_level, due_keys), and no key sorts after '' that is ''
-- itself. Such a job waited in the queue for ever, unreported. Every entry point
-- (jobd.enqueue, the Python API, the CLI) refuses an empty key; a caller's own INSERT INTO
-- jobd.jobs, or COPY, which only the table's constraints check, stored it. Now the table
-- refuses it too, for every write: inserts, COPY, and updates.
--
-- The entry points' other bound on the key, 256 bytes, stays theirs. A longer key does not
-- stop a job: it is claimed as any other up to the size a B-tree entry can hold, and past
-- that the INSERT itself fails on jobs_fair_idx. As a constraint, it would make every later
-- update of a job already stored with a longer key (its claim, with the claim's other jobs)
-- fail, unless this migration rewrote those keys, which it could only find by reading every
-- live job under the lock taken below.

-- The dead-letter queue first, before the lock on jobs: a dead job with the key '' comes
-- back with it when replayed. Dead rows are not claimed or updated, so this takes no lock
-- beyond the rows it changes. A job dead-lettered between this statement and the lock below
-- is replayed without its key anyway (replay_dead's nullif, jobd/sql/queries.sql).
UPDATE dead_letter SET fairness_key = NULL WHERE fairness_key = '';

-- NOT VALID: no scan of the live jobs. Rows written from now on are checked, and the rows
-- stored before are handled just below. The lock this takes (ACCESS EXCLUSIVE on jobs) is
-- held to the commit of `jobd migrate`, so no job with the key '' can be added meanwhile.
-- `ALTER TABLE jobd.jobs VALIDATE CONSTRAINT jobs_fairness_key_not_empty` validates it later
-- without blocking the queue, if wanted: after the statements below every row complies.
ALTER TABLE jobs ADD CONSTRAINT jobs_fairness_key_not_empty
    CHECK (fairness_key <> '') NOT VALID;

-- The live jobs already stored with the key '' get none (NULL): they share by their handler,
-- as a job enqueued without a key does, and a fair lane claims them. Left as they were, they
-- would stay stuck in a fair lane; and in any lane the next update of such a job (its claim)
-- would fail the constraint, and the whole claim with it. NULL rather than a key of jobd's
-- choosing: '' is what every entry point calls no key at all.
--
-- Found through the indexes rather than by reading every live job while the lock is held:
-- the running jobs through jobs_lease_idx, and the claimable ones (pending, failed) through
-- jobs_fair_idx, whose entries are ordered by (lane, priority, share key): for each
-- (lane, priority), found one after the other on jobs_claimable_idx, the jobs of the key ''
-- are one range of it. Every live job is running or claimable (the state check), so none is
-- missed; the cost is a few index descents per (lane, priority) the live jobs hold.
DO $$
DECLARE
    at_lane text;
    at_priority integer;
BEGIN
    UPDATE jobs AS j SET fairness_key = NULL WHERE j.state = 'claimed' AND j.fairness_key = '';
    SELECT j.lane, j.priority INTO at_lane, at_priority
      FROM jobs AS j WHERE j.state IN ('pending', 'failed')
     ORDER BY j.lane, j.priority DESC LIMIT 1;
    WHILE at_lane IS NOT NULL LOOP
        UPDATE jobs AS j SET fairness_key = NULL
         WHERE j.lane = at_lane AND j.state IN ('pending', 'failed')
           AND j.priority = at_priority
           AND coalesce(j.fairness_key, j.handler) COLLATE "C" = ''
           AND j.fairness_key = '';
        -- The next (lane, priority): a lower priority of the same lane, else the next lane's
        -- highest. No row leaves both NULL, which ends the walk.
        SELECT n.lane, n.priority INTO at_lane, at_priority
          FROM ((SELECT j.lane, j.priority FROM jobs AS j
                  WHERE j.lane = at_lane AND j.state IN ('pending', 'failed')
                    AND j.priority < at_priority
                  ORDER BY j.lane, j.priority DESC LIMIT 1)
                UNION ALL
                (SELECT j.lane, j.priority FROM jobs AS j
                  WHERE j.lane > at_lane AND j.state IN ('pending', 'failed')
                  ORDER BY j.lane, j.priority DESC LIMIT 1)
                -- The same lane's first: UNION ALL alone does not promise its branches' order.
                ORDER BY 1, 2 DESC
                LIMIT 1) AS n;
    END LOOP;
END
$$;

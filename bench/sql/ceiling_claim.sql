-- The SQL ceiling, part 1: claim a batch of :batch due jobs with the minimal statement
-- (setting the lease columns jobd's CHECK requires); gset carries the ids to part 2.
WITH claimed AS (
    UPDATE jobd.jobs
       SET state = 'claimed',
           attempts = attempts + 1,
           claimed_by = 'pgbench',
           lease_until = now() + interval '30 seconds',
           lease_token = (SELECT jobd.new_lease_token())
     WHERE id IN (SELECT id FROM jobd.jobs
                   WHERE lane = 'default' AND state IN ('pending', 'failed')
                     AND run_at <= now()
                   ORDER BY priority DESC, run_at
                   LIMIT :batch
                     FOR UPDATE SKIP LOCKED)
    RETURNING id
)
SELECT array_agg(id) AS ids FROM claimed
\gset
